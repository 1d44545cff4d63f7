"""Timing that holds in real use: CUDA-graph replay, L2-cold operands, warm-up, median of many runs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

__all__ = ["SETTLE_MS", "copies_for_cold_l2", "settle", "time_cpu", "time_cuda"]

DEFAULT_L2_BYTES = 60 * 2**20
# Untimed replays before timing operands just written: on the H200 the FP8 GEMM read freshly prepared weights ~8%
# slower for the first 20-100 ms, then at its steady speed for good (lab/diag_settle.py).
# At large M they also bring the GPU to the clocks its power limit allows under sustained load.
SETTLE_MS = 100.0


def copies_for_cold_l2(bytes_per_copy: int, l2_bytes: int | None, factor: int = 3) -> int:
    """How many copies of an operand to rotate through so that together they exceed ``factor`` x the L2."""
    l2 = l2_bytes or DEFAULT_L2_BYTES
    return max(2, -(-factor * l2 // max(bytes_per_copy, 1)))


def time_cuda(
    calls: Sequence[Callable[[], object]], *, replays: int = 15, replay_ms: float = 2.0, warmup_ms: float = 0.0
) -> float:
    """Median microseconds per call of ``calls`` (each reading its own operand copy), replayed as a CUDA graph.

    Each replay runs the calls round-robin, as many rounds as make it last about ``replay_ms`` (so it is long
    enough for event timing and the operands rotate out of L2), at most 50. Before the timed replays the graph
    replays once, or for about ``warmup_ms`` (``SETTLE_MS`` for operands just written).
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in calls:  # warm-up: compilation, handles, allocator
            f()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for f in calls:
            f()
        end.record()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    per_round_ms = max(start.elapsed_time(end), 1e-3)
    rounds = int(min(50, max(1, replay_ms // per_round_ms)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for f in calls:
                f()
    for _ in range(max(1, round(warmup_ms / (rounds * per_round_ms)))):
        graph.replay()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for s, e in zip(starts, ends, strict=True):
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    per_call = [s.elapsed_time(e) * 1e3 / (rounds * len(calls)) for s, e in zip(starts, ends, strict=True)]
    del graph
    return statistics.median(per_call)


def settle(fn: Callable[[], object], ms: float = SETTLE_MS) -> None:
    """Run ``fn`` (GPU work) back to back, untimed, for about ``ms`` milliseconds: the operands it reads, if just
    written, read at their steady speed afterwards."""
    deadline = time.perf_counter() + ms / 1e3
    while time.perf_counter() < deadline:
        fn()
        torch.cuda.synchronize()


def time_cpu(call: Callable[[], object], *, repeats: int = 5, budget_ms: float = 200.0) -> float:
    """Least microseconds of ``call`` on the CPU after one warm-up: over at least ``repeats`` runs, and more (up to
    100) while they take less than ``budget_ms`` together. The least, since on a shared CPU every other sample adds
    time of other processes (a median of 5 on a busy two-core machine varied tenfold between runs)."""
    call()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < repeats or (len(samples) < 100 and (time.perf_counter() - start) * 1e3 < budget_ms):
        t0 = time.perf_counter()
        call()
        samples.append((time.perf_counter() - t0) * 1e6)
    return min(samples)
