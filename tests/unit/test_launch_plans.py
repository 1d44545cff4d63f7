"""Typed launch plans (:class:`mxgemm.kernels.Launch`): what a plan made in C is freed when the Launch is dropped,
and not while a route built on it (the bf16 epilogue of the own call or of the gated call) is alive."""

import ctypes
import gc

import torch

from mxgemm.backends.hybrid_sm90 import _bf16_epilogue
from mxgemm.kernels import Launch, LaunchEntry, free_with


class _Plan(ctypes.Structure):
    _fields_ = [("value", ctypes.c_int)]


def _launch(freed: list[int]) -> tuple[Launch, list[int]]:
    plans = [_Plan(1), _Plan(2)]
    entry = LaunchEntry(0, 1, ctypes.addressof(plans[0]), 4, 8)
    launch = Launch(lambda x, bias: x * 2, entry=entry, gated=Launch(lambda g, u, bias: g * u), keep=plans)
    free_with(launch, freed.append, plans)
    return launch, [ctypes.addressof(p) for p in plans]


def test_a_launch_frees_its_plans_when_dropped():
    freed = []
    launch, addresses = _launch(freed)
    x = torch.ones(4, 8, dtype=torch.bfloat16)
    assert torch.equal(launch(x, None), x * 2) and launch.entry.plan == addresses[0]
    del launch
    gc.collect()
    assert freed == addresses


def test_routes_keep_the_launch_they_wrap():
    """The epilogues hold the launch (not only its launcher or its gated child), take its entries, and add a bias
    the kernel does not (fp32 here) after it, in the activations' dtype."""
    freed = []
    launch, addresses = _launch(freed)
    own, gated = _bf16_epilogue(launch), _bf16_epilogue(launch, gated=True)
    assert own.entry == launch.entry and gated.entry is None  # the stand-in's gated call has no C++ entry
    del launch
    gc.collect()
    assert not freed
    x, up = torch.full((4, 8), 3.0, dtype=torch.bfloat16), torch.full((4, 8), 2.0, dtype=torch.bfloat16)
    bias = torch.ones(8)
    assert torch.equal(own(x, bias), torch.full((4, 8), 7.0, dtype=torch.bfloat16))
    assert torch.equal(gated(x, None, up), x * up)
    assert torch.equal(own(x.half(), None), torch.full((4, 8), 6.0, dtype=torch.float16))
    del own
    gc.collect()
    assert not freed  # the gated route still holds it
    del gated
    gc.collect()
    assert freed == addresses
