"""Every `generate` call of bench/model_e2e.py printed with its time: which calls of a run make its medians. The
models are named in the order of their first call, which is model_e2e's warm-up order: model0 is bf16, model1 mxgemm.
With each call, what might make one slow: the time Python's garbage collector ran during it (collections by
generation) and what the CUDA caching allocator did (segments it allocated from and returned to the device, retries
after freeing its cache).

Run on the device: PYTHONPATH=src python3 lab/ttft_probe.py --modes eager --batches 1 --repeats 9
"""

import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import model_e2e

_generate = model_e2e.Timer.generate
_names: dict[int, str] = {}
_gc = {"start": 0.0, "seconds": 0.0, "runs": [0, 0, 0]}


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc["start"] = time.perf_counter()
    else:
        _gc["seconds"] += time.perf_counter() - _gc["start"]
        _gc["runs"][info["generation"]] += 1


def _allocator() -> tuple[int, int, int]:
    stats = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    return (stats.get("segment.all.allocated", 0), stats.get("segment.all.freed", 0),
            stats.get("num_alloc_retries", 0))  # fmt: skip


def generate(self, model, ids, new, **kwargs):
    _gc["seconds"], _gc["runs"] = 0.0, [0, 0, 0]
    before = _allocator()
    seconds, above, stays = _generate(self, model, ids, new, **kwargs)
    segments, freed, retries = (a - b for a, b in zip(_allocator(), before, strict=True))
    who = _names.setdefault(id(model), f"model{len(_names)}")
    mode = "graphs" if "compile_config" in kwargs else "eager"
    print(f"{who} {mode} ids={tuple(ids.shape)} new={new} {seconds * 1e3:.1f} ms; gc {_gc['seconds'] * 1e3:.1f} ms "
          f"(collections by generation {_gc['runs']}); segments +{segments} -{freed}, retries {retries}",
          flush=True)  # fmt: skip
    return seconds, above, stays


gc.callbacks.append(_on_gc)
model_e2e.Timer.generate = generate
model_e2e.main(sys.argv[1:])
