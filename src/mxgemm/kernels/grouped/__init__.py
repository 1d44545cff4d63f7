"""Kernels of grouped weights (the experts of a mixture of experts). They sit apart from the dense kernels'
:func:`mxgemm.kernels.source_digest`, which the tuning files of dense tactics record: no grouped kernel runs a dense
tactic, so changing one leaves those files valid. ``source_digest(Path(__file__).parent)`` is theirs, for the day
grouped tactics are tuned. The Triton modules import Triton at import time, so import them lazily."""
