"""Kernels of grouped weights (the experts of a mixture of experts). They sit apart from the dense kernels'
:func:`mxgemm.kernels.source_digest`, which the tuning files record: no grouped kernel runs a dense tactic, so
changing one leaves the files' dense entries valid, and the commit that changes one retunes the grouped entries it
touches or says which it leaves (docs/design.md). ``source_digest(Path(__file__).parent)`` digests them alone. The
Triton modules import Triton at import time, so import them lazily."""
