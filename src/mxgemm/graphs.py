"""Eager calls replayed as CUDA graphs.

An eager call of many launches pays each launch's host time (the routed block of a mixture of experts: four to six
Triton launches and their Python, a few hundred µs a call, where its GPU work at decode takes tens). An
:class:`EagerGraphs` keeps, for each signature of a callable's tensor arguments (shapes, strides, dtypes, device,
inference mode, and a key its owner adds), a CUDA graph of the callable's launches and static copies of its
arguments: the first call of a signature runs directly (kernels built, tactics looked up), the second captures the
graph, and every call from there copies its arguments into the static ones, replays the graph and answers a copy of
the graph's output (a caller keeping an output across calls never sees it change). The same launches run on the
same bytes, so the bits are those of a direct call.

Calls from several threads take turns (a lock per :class:`EagerGraphs`: one call's copies, replay and output
copy are never interleaved with another's), and a capture fails only on its own thread's calls that cannot be
captured, never on other threads' work (thread-local capture mode).

All graphs of a device capture into one memory pool: a graph's intermediates are dead once it has replayed and its
output has been copied out, so graphs replayed in any order never read each other's memory. A pool no graph uses any
more is only waiting to be freed: PyTorch's caching allocator refuses it to a capture (an internal assertion that the
pool has users), so the first capture after every graph is gone (their holders freed) takes a new pool. Calls that
cannot be graphed run directly (:func:`graphable`): tensors not on a GPU, or subclasses, gradients asked for, a stream
being captured already (the caller's own CUDA graph), ``torch.compile`` tracing, a dispatch mode, a stream other than
the device's default one (calls on several streams at once would share the graphs' static tensors and memory), or
``MXGEMM_EAGER_GRAPHS=0``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from . import settings

__all__ = ["EagerGraphs", "graphable"]

logger = logging.getLogger("mxgemm")


@dataclass
class _Pool:
    """A device's graph memory pool, shared by every EagerGraphs, and how many graphs captured into it are alive."""

    handle: tuple
    alive: int = 0

    def freed(self) -> None:
        self.alive -= 1


_POOLS: dict[int, _Pool] = {}


def graphable(*tensors: torch.Tensor, max_rows: int | None = None) -> bool:
    """Whether a call on ``tensors`` may replay a graph: plain, non-empty CUDA tensors of one device (an empty one
    leaves nothing to replay), no gradient asked for, no capture, tracing or dispatch mode under way, the device's
    default stream current, ``MXGEMM_EAGER_GRAPHS`` not 0, and (``max_rows``) the first tensor's leading dimension at
    most that. Traced calls answer False before the rows are read (a guard on them); an eager call of more rows
    answers False before the device is asked."""
    if torch.compiler.is_compiling() or not all(type(t) is torch.Tensor and t.is_cuda and t.numel() for t in tensors):
        return False
    if max_rows is not None and tensors[0].shape[0] > max_rows:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    if not settings.eager_graphs_enabled() or torch.cuda.is_current_stream_capturing():
        return False
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if _get_current_dispatch_mode() is not None or len({t.device for t in tensors}) != 1:
        return False
    device = tensors[0].device if tensors else None
    return device is not None and torch.cuda.current_stream(device) == torch.cuda.default_stream(device)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    output: torch.Tensor


class EagerGraphs:
    """Graphs of one callable's eager calls, by the signature of their tensor arguments; at most ``limit`` kept (the
    least recently replayed dropped first). Copies (``copy.deepcopy``, pickling) start empty."""

    def __init__(self, limit: int = 8):
        self.limit = limit
        self._graphs: OrderedDict[Hashable, _Graph] = OrderedDict()
        self._seen: set[Hashable] = set()  # signatures called once, to capture on their next call
        self._refused: set[Hashable] = set()  # signatures whose capture failed: they run directly
        self._lock = threading.Lock()  # one call at a time: the static copies are shared

    def __deepcopy__(self, memo) -> EagerGraphs:
        return EagerGraphs(self.limit)

    def __getstate__(self) -> dict:
        return {"limit": self.limit}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["limit"])

    def __len__(self) -> int:
        return len(self._graphs)

    def __call__(self, fn: Callable[..., torch.Tensor], *tensors: torch.Tensor, key: Hashable = ()) -> torch.Tensor:
        """``fn(*tensors)``, from a graph where this signature has one (call :func:`graphable` first)."""
        # inference mode apart: static copies made under it cannot be written outside it
        sig = (key, torch.is_inference_mode_enabled(), *((t.shape, t.stride(), t.dtype, t.device) for t in tensors))
        with self._lock:
            return self._call(sig, fn, tensors)

    def _call(self, sig: Hashable, fn: Callable[..., torch.Tensor], tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
        entry = self._graphs.get(sig)
        if entry is None:
            if sig in self._refused or sig not in self._seen:
                self._seen.add(sig)
                return fn(*tensors)
            entry = self._capture(sig, fn, tensors)
            if entry is None:
                return fn(*tensors)
        else:
            self._graphs.move_to_end(sig)
            for static, t in zip(entry.inputs, tensors, strict=True):
                static.copy_(t)
        entry.graph.replay()
        return entry.output.clone()

    def _capture(self, sig: Hashable, fn: Callable[..., torch.Tensor], tensors: tuple[torch.Tensor, ...]):
        device = tensors[0].device
        current = torch.cuda.current_stream(device)
        inputs = [t.clone() for t in tensors]
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        pool = _pool(device)
        try:
            with torch.cuda.device(device), torch.cuda.stream(side):
                graph.capture_begin(pool=pool.handle, capture_error_mode="thread_local")
                try:
                    output = fn(*inputs)
                finally:
                    graph.capture_end()
        except Exception as exc:  # a launch that cannot be captured: this signature runs directly from now on
            logger.info("mxgemm: eager calls of %s run without a graph: capture failed (%s)", sig, exc)
            self._refused.add(sig)
            return None
        finally:
            current.wait_stream(side)
        if not isinstance(output, torch.Tensor):
            self._refused.add(sig)
            return None
        pool.alive += 1
        weakref.finalize(graph, pool.freed)
        entry = _Graph(graph, inputs, output)
        self._graphs[sig] = entry
        self._seen.discard(sig)
        while len(self._graphs) > self.limit:
            self._graphs.popitem(last=False)
        return entry


def _pool(device: torch.device) -> _Pool:
    """The device's pool; a new one where none of its graphs is alive (the allocator keeps a pool no graph uses
    only to free it, and refuses it to a capture)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    pool = _POOLS.get(index)
    if pool is None or pool.alive == 0:
        pool = _POOLS[index] = _Pool(torch.cuda.graph_pool_handle())
    return pool
