"""Autotuning: which tactic of the resolved backend runs a problem; the choices go to the tuning store
(:mod:`mxgemm.tuning`: keys, files, generation).

* Only the backend that was resolved is tuned, and only if it has tactics (``Backend.tunable``). Its first tactic is
  the default and always valid; a tactic that fails or is invalid scores infinity, is counted, and is never chosen.
* A recorded tactic is used only where it equals one the backend offers for its bucket now (as :meth:`Tactic.json`
  writes it); the user's file first, then the shipped one. ``TuningCache.describe`` says whether a file is used, and
  why not (``mxgemm info`` prints it).
* Determinism: a tactic replaces the default only when it is faster by ``margin`` (above the timing noise) in two
  timings of both; ties keep the earlier tactic. For a given cache the same tactic runs every time.
* Timing as DESIGN.md asks: CUDA-graph replay, the weight rotated through copies beyond 3x the L2, median.
* Never during CUDA-graph capture; on the hot path only with ``MXGEMM_AUTOTUNE=1``; otherwise lookups only.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from . import settings, tuning
from .backends import Backend, PreparedGroupedWeight, PreparedWeight
from .backends.base import PlanCache, recorded_as, tactic_json
from .backends.capabilities import GroupedWeights
from .device import DeviceInfo, describe_device
from .tuning import (
    TuneKey,
    TuningCache,
    bucket,
    default_cache_path,
    environment_metadata,
    grouped_buckets,
    shipped_cache_path,
)

__all__ = [
    "DEFAULT_MARGIN",
    "Autotuner",
    "TuneResult",
    "tactic_for_call",
    "tactic_for_grouped_call",
    "tactics_for_experts_call",
    "tuner_for",
    "tuning_routings",
    "tuning_top_k",
]

logger = logging.getLogger("mxgemm")
DEFAULT_MARGIN = 0.03  # a tactic must be 3% faster than the default: above the spread of repeated timings
TUNING_ROUTINGS = 8  # the routings a grouped tactic is timed on in each round, as mxgemm bench --moe times its calls


@dataclass(frozen=True)
class TuneResult:
    key: TuneKey
    tactic: Any  # the chosen tactic (the default when none beats it by the margin)
    default_us: float
    best_us: float
    failed: int
    timed: int
    is_default: bool

    @property
    def speedup(self) -> float:
        return self.default_us / self.best_us if self.best_us else float("nan")


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class Autotuner:
    """Chooses tactics from the cache (user file, then shipped file) and tunes on request."""

    def __init__(
        self,
        cache: TuningCache,
        *,
        shipped: TuningCache | None = None,
        timer: Callable[[Callable[[], object]], float] | None = None,
        margin: float = DEFAULT_MARGIN,
    ):
        self.cache = cache
        self.shipped = shipped
        self.timer = timer
        self.margin = margin
        self._memo: dict[tuple, Any] = {}  # lookups by (backend, weight meta, bucket, dtype); cleared on tuning

    @classmethod
    def for_device(cls, device: DeviceInfo | None = None) -> Autotuner:
        device = device or describe_device()
        meta = environment_metadata(device)
        shipped_path = shipped_cache_path(device)
        shipped = TuningCache(shipped_path, meta, packaged=True) if shipped_path.exists() else None
        return cls(TuningCache(default_cache_path(device), meta), shipped=shipped)

    def choice(self, backend: Backend, weight: PreparedWeight, m: int, x_dtype: torch.dtype) -> tuple[Any, str]:
        """(tactic, where it comes from: ``"cache"``, ``"shipped"`` or ``"default"``, whose tactic is None);
        memoized, as calls ask every time."""
        if not backend.tunable:
            return None, "default"
        m_bucket = bucket(m)
        return self._recorded(
            (backend.name, weight.op_meta, m_bucket, x_dtype),
            lambda: TuneKey.of(backend.name, weight, m, x_dtype),
            lambda: backend.tactics(m_bucket, weight),
            backend.name,
        )

    def grouped_choice(
        self, backend: Backend, weight: PreparedGroupedWeight, rows: int, x_dtype: torch.dtype, op: str = "grouped"
    ) -> tuple[Any, str]:
        """:meth:`choice` for grouped weights at ``rows`` rows sorted by expert (:meth:`TuneKey.grouped`); ``op``
        "experts": gate/up's tactic in the routed block of ``rows`` token copies, as :meth:`tune_experts` records
        it."""
        if not backend.tunable or not isinstance(backend, GroupedWeights):
            return None, "default"
        per_bucket, active = grouped_buckets(rows, weight.experts)  # TuneKey.grouped's, without building the key
        return self._recorded(
            (op, backend.name, weight.op_meta, per_bucket, active, x_dtype),
            lambda: TuneKey.grouped(backend.name, weight, rows, x_dtype, op=op),
            lambda: backend.grouped_tactics(per_bucket, weight, active),
            backend.name,
        )

    def _recorded(
        self, memo_key: tuple, make_key: Callable[[], TuneKey], offered: Callable[[], list[Any]], backend: str
    ) -> tuple[Any, str]:
        """The first file's (user's, then shipped) tactic for the key that the backend offers now, memoized."""
        if memo_key not in self._memo:
            key = make_key()
            files = [(c, src) for c, src in ((self.cache, "cache"), (self.shipped, "shipped")) if c is not None]
            choice = None, "default"
            for cache, src in files:
                record = cache.get(key)
                if record is None:
                    continue
                tactic = self._known(offered, record["tactic"])
                if tactic is not None:
                    choice = tactic, src
                    break
                logger.warning(
                    "mxgemm: tuning file %s: tactic %s for %s is not one %s has now; ignored",
                    cache.path,
                    record["tactic"],
                    key,
                    backend,
                )
            self._memo[memo_key] = choice
        return self._memo[memo_key]

    @staticmethod
    def _known(offered: Callable[[], list[Any]], recorded: Any) -> Any:
        """The tactic the backend offers now that a file records as ``recorded``, or None (a file edited by hand, or
        from kernels whose tactics differ, may hold others)."""
        try:
            return next((t for t in offered() if recorded_as(t, recorded)), None)
        except Exception:  # a tactic list that cannot be made: follow nothing from the file
            return None

    def lookup(self, backend: Backend, weight: PreparedWeight, m: int, x_dtype: torch.dtype) -> Any:
        """The cached tactic for this problem, or None (the backend's default)."""
        return self.choice(backend, weight, m, x_dtype)[0]

    def tune(
        self, backend: Backend, weight: PreparedWeight, m: int, x_dtype: torch.dtype, *, write: bool = True
    ) -> TuneResult | None:
        """Time every tactic of ``backend`` for this problem at its M bucket and record the choice.

        Returns None (and times nothing) for backends without tactics or during CUDA-graph capture.
        """
        if not backend.tunable or _capturing():
            return None
        key = TuneKey.of(backend.name, weight, m, x_dtype)
        x = torch.randn(key.m_bucket, weight.in_features, device=weight.device).to(x_dtype)
        tactics: Sequence[Any] = backend.tactics(key.m_bucket, weight)
        copies = _cold_copies(weight)
        if self.timer is None and weight.device.type == "cuda":  # the copies were just written: let them settle
            from .timing import settle

            try:
                settle(lambda: [backend.run(x, w, None, tactic=tactics[0]) for w in copies])
            except Exception as exc:  # the default tactic failing is reported by its measurement below
                logger.debug("mxgemm: settling %s failed: %s", key, exc)
        with backend.tuning_context(weight):
            return self._decide(
                key, tactics, lambda t: [backend.run(x, w, None, tactic=t) for w in copies], len(copies), write
            )

    def tune_grouped(
        self,
        backend: Backend,
        weight: PreparedGroupedWeight,
        rows: int,
        x_dtype: torch.dtype,
        *,
        topk: int | None = None,
        write: bool = True,
    ) -> TuneResult | None:
        """:meth:`tune` for grouped weights at ``rows`` rows sorted by expert: each tactic timed on a round of
        :func:`tuning_routings` of the key's buckets (its rows per expert times its active experts, drawn at random,
        as a router spreads them; as the top-``topk`` copies of tokens where the rows are a routed block's)."""
        if not backend.tunable or not isinstance(backend, GroupedWeights) or _capturing():
            return None
        key = TuneKey.grouped(backend.name, weight, rows, x_dtype)
        per, active = grouped_buckets(rows, weight.experts)
        routings = tuning_routings(per, active, weight.experts, weight.device, topk=topk)
        x = torch.randn(int(routings[0][-1]), weight.in_features, device=weight.device).to(x_dtype)
        tactics = backend.grouped_tactics(per, weight, active)

        def calls(tactic: Any) -> list:
            return [backend.run_grouped(x, weight, offsets, tactic) for offsets in routings]

        return self._decide(key, tactics, calls, len(routings), write)

    def tune_experts(
        self,
        backend: Backend,
        gate_up: PreparedGroupedWeight,
        down: PreparedGroupedWeight,
        tokens: int,
        topk: int,
        x_dtype: torch.dtype,
        *,
        write: bool = True,
    ) -> TuneResult | None:
        """Gate/up's tactic in the routed block of ``tokens`` tokens of ``topk`` copies, each of its grouped tactics
        timed on the whole block (:meth:`GroupedWeights.run_experts`, down on its own recorded choice) over a round of
        :func:`tuning_top_k` routings of the key's buckets: the block runs a tactic of the Triton kernel in its gated
        form (half its weight rows gate, half up), not as :meth:`tune_grouped` times it."""
        if not backend.tunable or not isinstance(backend, GroupedWeights) or _capturing():
            return None
        rows = tokens * topk
        key = TuneKey.grouped(backend.name, gate_up, rows, x_dtype, op="experts")
        per, active = grouped_buckets(rows, gate_up.experts)
        timed = _bucket_tokens(per, active, topk)
        second = self.grouped_choice(backend, down, timed * topk, x_dtype)[0]
        routings = tuning_top_k(timed, topk, gate_up.experts, gate_up.device, x_dtype)
        x = torch.randn(timed, gate_up.in_features, device=gate_up.device).to(x_dtype)
        tactics = backend.grouped_tactics(per, gate_up, active)

        def calls(tactic: Any) -> list:
            return [backend.run_experts(x, ids, w, gate_up, down, (tactic, second)) for ids, w in routings]

        return self._decide(key, tactics, calls, len(routings), write)

    def _decide(
        self, key: TuneKey, tactics: Sequence[Any], calls: Callable[[Any], list], per_round: int, write: bool
    ) -> TuneResult:
        """Time ``calls(tactic)`` (a round of ``per_round`` calls) for each tactic; the fastest replaces the default
        (the first) only by the margin in two timings of both; recorded under ``key`` when ``write``."""
        timer = self.timer or _default_timer
        failed = 0

        def measure(tactic: Any) -> float:
            nonlocal failed
            try:
                return timer(lambda: calls(tactic)) / per_round
            except Exception as exc:  # an invalid tactic scores infinity and is counted, never chosen
                logger.debug("mxgemm: tactic %s failed for %s: %s", tactic, key, exc)
                failed += 1
                return math.inf

        times = [measure(tactic) for tactic in tactics]
        best = min(range(len(times)), key=lambda i: (times[i], i))
        chosen = 0
        if best and times[best] < times[0] * (1 - self.margin):
            # confirmed by a second timing of both: one slow reading of the default must not replace it (the first
            # shipped H200 file's default timings were 4-14% above later ones)
            times[0], times[best] = measure(tactics[0]), measure(tactics[best])
            chosen = best if times[best] < times[0] * (1 - self.margin) else 0
        result = TuneResult(key, tactics[chosen], times[0], times[chosen], failed, len(tactics), chosen == 0)
        if write:
            record = {
                "tactic": tactic_json(result.tactic),
                "us": result.best_us,
                "default_us": result.default_us,
                "failed": failed,
            }
            self.cache.put({str(key): record})
            self._memo.clear()
            tuning.changed()
        return result


def _cold_copies(weight: PreparedWeight) -> list[PreparedWeight]:
    """The weight and enough copies of it that a round over them exceeds 3x the L2 (on a GPU): tactics are timed
    with the weight read from memory, as in real use, not from L2."""
    if weight.device.type != "cuda":
        return [weight]
    from .timing import copies_for_cold_l2

    nbytes = sum(t.numel() * t.element_size() for t in weight.tensors.values())
    count = copies_for_cold_l2(nbytes, describe_device(weight.device).l2_bytes)

    def clone() -> PreparedWeight:  # op tensors and meta recomputed from the cloned tensors
        tensors = {n: t.clone() for n, t in weight.tensors.items()}
        return replace(weight, tensors=tensors, op_tensors=None, op_meta=None, plans=PlanCache())

    return [weight] + [clone() for _ in range(count - 1)]


def _default_timer(fn: Callable[[], object]) -> float:
    from .timing import time_cpu, time_cuda

    if torch.cuda.is_available():
        return time_cuda([fn], replays=10, replay_ms=1.0)
    return time_cpu(fn, repeats=3, budget_ms=0)


_TUNERS: dict[Any, Autotuner] = {}


def tuner_for(device: torch.device) -> Autotuner:
    """The process-wide tuner of a device (created on first use: reads the cache files once)."""
    key = (device.type, device.index)
    if key not in _TUNERS:
        _TUNERS[key] = Autotuner.for_device(describe_device(device))
    return _TUNERS[key]


def tactic_for_call(backend: Backend, weight: PreparedWeight, x: torch.Tensor) -> Any:
    """The tactic a call runs with: cached, or tuned now when ``MXGEMM_AUTOTUNE=1`` (never during capture)."""
    if not backend.tunable:
        return None
    tuner = tuner_for(x.device)
    return _recorded_or_tuned(
        tuner.lookup(backend, weight, x.shape[0], x.dtype), lambda: tuner.tune(backend, weight, x.shape[0], x.dtype)
    )


def tuning_routings(
    per: int,
    active: int,
    experts: int,
    device: torch.device,
    rounds: int | None = None,
    topk: int | None = None,
) -> list[torch.Tensor]:
    """The routings a grouped tactic is timed on: ``rounds`` (:data:`TUNING_ROUTINGS` unless given) offsets (int32 [E],
    cumulative row ends) of ``per * active`` rows each, drawn from a fixed seed, each row to an expert drawn uniformly
    from all ``experts``, as a router's rows fall across tokens: the experts a round reads change from call to call, so
    that their weights do not stay in L2, as a decode's do not, and the loads are as uneven as a router's (16 tokens of
    Qwen3-30B-A3B's top-8, 128 rows over 128 experts, read about 81 experts, some of them for 2-4 rows; one row on each
    of 128 experts, or an even routing that fills every token tile of ``per`` rows exactly, favours kernels that routed
    calls do not). With ``topk``, the rows are the top-``topk`` copies of as many tokens as the buckets hold
    (:func:`tuning_top_k`'s draws), so that a token's experts are distinct, as a router's are (one token of
    Mixtral-8x7B's top-2 reads two experts, never one)."""
    if topk:
        tokens = _bucket_tokens(per, active, topk)
        picks = [ids.flatten() for ids, _ in tuning_top_k(tokens, topk, experts, "cpu", torch.float32, rounds)]
    else:
        g = torch.Generator().manual_seed(0)
        picks = [torch.randint(experts, (per * active,), generator=g) for _ in range(rounds or TUNING_ROUTINGS)]
    return [torch.bincount(p, minlength=experts).cumsum(0).to(torch.int32).to(device) for p in picks]


def _bucket_tokens(per: int, active: int, topk: int) -> int:
    """The tokens whose top-``topk`` copies fill the buckets' ``per * active`` rows (at least one)."""
    return max(1, per * active // topk)


def tuning_top_k(
    tokens: int, topk: int, experts: int, device: torch.device, dtype: torch.dtype, rounds: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The routings the routed block is timed on: ``rounds`` (:data:`TUNING_ROUTINGS` unless given) uniform top-k
    draws from a fixed seed, each the expert ids [tokens, topk] (distinct for each token) and their weights [tokens,
    topk] in ``dtype`` (softmaxed)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(rounds or TUNING_ROUTINGS):
        ids = torch.rand(tokens, experts, generator=g).topk(min(topk, experts), dim=1).indices
        weights = torch.rand(ids.shape, generator=g).softmax(-1).to(dtype)
        out.append((ids.to(device), weights.to(device)))
    return out


def tactic_for_grouped_call(
    backend: Backend, weight: PreparedGroupedWeight, rows: int, x: torch.Tensor, topk: int | None = None
) -> Any:
    """:func:`tactic_for_call` for grouped weights at ``rows`` rows sorted by expert of ``x``'s dtype (the top-``topk``
    copies of a routed block's tokens, where given)."""
    if not backend.tunable or not isinstance(backend, GroupedWeights):
        return None
    tuner = tuner_for(x.device)
    return _recorded_or_tuned(
        tuner.grouped_choice(backend, weight, rows, x.dtype)[0],
        lambda: tuner.tune_grouped(backend, weight, rows, x.dtype, topk=topk),
    )


def _recorded_or_tuned(recorded: Any, tune: Callable[[], TuneResult | None]) -> Any:
    """``recorded``, or on a miss (None) the tactic ``tune`` finds where ``MXGEMM_AUTOTUNE=1`` and no capture is under
    way (None where it finds none)."""
    if recorded is None and settings.autotune_enabled() and not _capturing():
        result = tune()
        recorded = result.tactic if result else None
    return recorded


def tactics_for_experts_call(
    backend: Backend,
    gate_up: PreparedGroupedWeight,
    down: PreparedGroupedWeight,
    tokens: int,
    topk: int,
    x: torch.Tensor,
) -> tuple[Any, Any]:
    """The routed block's two tactics for ``tokens`` tokens of ``topk`` copies of ``x``'s dtype: down's as
    :func:`tactic_for_grouped_call` finds it; gate/up's the block's own (:meth:`Autotuner.grouped_choice` of op
    "experts"; tuned on a miss only with ``MXGEMM_AUTOTUNE=1``), else the projection's."""
    rows = tokens * topk
    second = tactic_for_grouped_call(backend, down, rows, x, topk)
    if not backend.tunable or not isinstance(backend, GroupedWeights):
        return None, second
    tuner = tuner_for(x.device)
    first = _recorded_or_tuned(
        tuner.grouped_choice(backend, gate_up, rows, x.dtype, op="experts")[0],
        lambda: tuner.tune_experts(backend, gate_up, down, tokens, topk, x.dtype),
    )
    if first is None:
        first = tuner.grouped_choice(backend, gate_up, rows, x.dtype)[0]
    return first, second
