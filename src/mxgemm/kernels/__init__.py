"""Hand-written kernels. Each module imports its compiler (Triton) at import time, so import them lazily."""
