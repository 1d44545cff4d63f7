"""The weights of groups of layers (q/k/v, gate/up) as ``quantize_model`` makes them, tuned in their own regime.

Times every tactic of each group's regime at M = 1-8 (the tuner's own timing, cold weights, a fresh cache), beside
the default of the same shape prepared alone (as the benchmark sets prepare it). Measured when a group kept its
members' crossover (`group-regime-h200.json`, 5340f77): the 8B gate/up group (members 14336 x 4096: crossover 16)
ran the exact small-M kernel at M = 1-15, 35.2 µs at M = 1 with the best of its 21 configs, where the shape alone
(crossover 1) runs the FP8 kernel in 32.1 µs. Groups take their joined weight's crossover since; the two columns
then time the same regime.

Run on the device: PYTHONPATH=src python3 lab/group_regime.py --json group-regime.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from torch import nn

import mxgemm
from mxgemm.autotune import Autotuner
from mxgemm.backends import get_backend
from mxgemm.backends.base import tactic_json
from mxgemm.device import describe_device
from mxgemm.tuning import TuningCache, environment_metadata


class _Attn(nn.Module):
    def __init__(self, hidden: int, kv: int):
        super().__init__()
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, kv, bias=False)
        self.v_proj = nn.Linear(hidden, kv, bias=False)


class _Mlp(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)


class _Block(nn.Module):
    def __init__(self, hidden: int, kv: int, ffn: int):
        super().__init__()
        self.self_attn = _Attn(hidden, kv)
        self.mlp = _Mlp(hidden, ffn)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--json")
    args = parser.parse_args()
    device = describe_device()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tuner = Autotuner(TuningCache(Path(tmp) / "cache.json", environment_metadata(device)))
        block = _Block(4096, 1024, 14336).to("cuda", torch.bfloat16)
        block.apply(lambda m: nn.init.normal_(m.weight, std=0.02) if isinstance(m, nn.Linear) else None)
        mxgemm.quantize_model(block, backend="hybrid_sm90")
        for name, layer in (("qkv", block.self_attn.q_proj), ("gate_up", block.mlp.gate_proj)):
            group = layer.shared[0].weight
            t = mxgemm.quantize(torch.randn(group.out_features, group.in_features, device="cuda").mul_(0.02).bfloat16())
            alone = mxgemm.prepare_weight(t.qdata, t.scale, backend="hybrid_sm90")
            backend = get_backend(group.backend)
            for m in args.ms:
                row = {"name": name, "n": group.out_features, "k": group.in_features, "m": m,
                       "crossovers": [group.info["crossover"], alone.info["crossover"]]}  # fmt: skip
                for who, w in (("group", group), ("alone", alone)):
                    r = tuner.tune(backend, w, m, torch.bfloat16, write=False)
                    row[who] = {"default_us": r.default_us, "best_us": r.best_us, "timed": r.timed,
                                "tactic": None if r.is_default else tactic_json(r.tactic),
                                "default": tactic_json(backend.choose(m, w))}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(device), "rows": rows}, indent=1))
    print("| shape | M | group default µs | group tuned µs | its tactic | alone (other regime) default µs |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        g, a = r["group"], r["alone"]
        print(f"| {r['name']} {r['n']}x{r['k']} | {r['m']} | {g['default_us']:.1f} | {g['best_us']:.1f} | "
              f"{json.dumps(g['tactic'])} | {a['default_us']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
