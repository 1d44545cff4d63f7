"""Where the eager 2048-token prefill of a Llama at 8B dimensions spends its time, bf16 against mxgemm, as
``bench/model_e2e.py`` runs it (``generate`` of one token, compile off): the call's wall time, the GPU's busy time
and the host gaps within it, its kernels by kind (mxgemm's, cuBLAS's, attention's, the rest) and the top kernels.
``--max-rows``: mxgemm's model measured once for each value of ``mxgemm.fusion.MAX_ROWS`` (eager calls of groups
without a threshold of their own read it when called: above it the members run their own GEMMs), and with
``--unshared`` again with each member quantizing the input itself (its backend's ``run_sharing`` answering None); with
``--qkv-max-rows`` again with the three-member (q/k/v) groups' threshold set to each value (as shipped:
``fusion.JOINED_MAX_ROWS``); with ``--ungated`` again with the gated MLPs' products computed as the model's own steps
do (``MXFP8Linear.on_gated`` answering None) and their gate/up groups' threshold ``MAX_ROWS`` (not
``fusion.JOINED_MAX_ROWS``).

Run on the device: PYTHONPATH=src python3 lab/prefill_anatomy.py --layers 32 --json prefill-anatomy.json
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
from decode_anatomy import busy_ns, kernels, kind, wall

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from model_e2e import build

from mxgemm import MXFP8Linear, fusion
from mxgemm.backends import get_backend


def anatomy(model, who: str, args, shared: bool = True, gated: bool = True) -> dict:
    kw = {"disable_compile": True}
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (1, args.tokens), device="cuda", generator=g)
    with torch.inference_mode():
        for _ in range(2):
            wall(model, ids, 1, kw)
        wall_ms = statistics.median(wall(model, ids, 1, kw) for _ in range(args.repeats)) * 1e3
        ks, _ = kernels(model, ids, 1, kw)
    by_kind, by_name = collections.Counter(), collections.defaultdict(lambda: [0, 0])
    for name, s, e in ks:
        by_kind[kind(name)] += e - s
        by_name[name][0] += 1
        by_name[name][1] += e - s
    gaps = [b[1] - a[2] for a, b in itertools.pairwise(ks)]
    row = {
        "who": who, "max_rows": fusion.MAX_ROWS, "shared": shared, "gated": gated, "layers": args.layers,
        "tokens": args.tokens,
        "wall_ms": wall_ms,
        "profiled_ms": (ks[-1][2] - ks[0][1]) / 1e6, "busy_ms": busy_ns(ks) / 1e6, "kernels": len(ks),
        "gaps_over_20us_ms": sum(g for g in gaps if g > 20_000) / 1e6, "gaps_over_20us": sum(g > 20_000 for g in gaps),
        "kinds_ms": {k: v / 1e6 for k, v in by_kind.most_common()},
        "top": [{"name": n[:90], "count": c, "us": t / c / 1e3, "ms": t / 1e6}
                for n, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[: args.top]],
        # the longest gaps: where in the call (the kernel's index of all, from the first) and between which kernels
        "longest_gaps": [{"us": gaps[i] / 1e3, "after": i, "of": len(ks), "before_name": ks[i][0][:60],
                          "after_name": ks[i + 1][0][:60]}
                         for i in sorted(range(len(gaps)), key=lambda i: -gaps[i])[: args.top]],
    }  # fmt: skip
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--max-rows", type=int, nargs="+", default=[fusion.MAX_ROWS])
    parser.add_argument("--unshared", action="store_true", help="also with each member quantizing its input")
    parser.add_argument("--qkv-max-rows", type=int, nargs="*", default=[], help="also with q/k/v groups' threshold")
    parser.add_argument("--ungated", action="store_true", help="also with the gated MLPs' own steps")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows, on_gated = [], MXFP8Linear.on_gated
    for who in ("bf16", "mxgemm"):
        model, _ = build(args.layers, who, ())
        backend = get_backend(model.model.layers[0].self_attn.q_proj.prepared.backend) if who == "mxgemm" else None
        for max_rows in args.max_rows if backend else [fusion.MAX_ROWS]:
            fusion.MAX_ROWS = max_rows
            variants = [(True, None, True)]
            if backend:
                variants += [(False, None, True)] * args.unshared + [(True, q, True) for q in args.qkv_max_rows]
                variants += [(True, None, False)] * args.ungated
            for shared, qkv, gated in variants:
                if not shared:  # the instance's attribute shadows the method until deleted
                    backend.run_sharing = lambda x, weight, bias: None
                groups = {id(m.shared[0]): m.shared[0] for m in model.modules() if getattr(m, "shared", None)}
                kept = {key: g.max_rows for key, g in groups.items()}
                if not gated:
                    MXFP8Linear.on_gated = lambda self, gate, up: None
                for g in groups.values():
                    if len(g.sizes) == 3 and qkv is not None:
                        g.max_rows = qkv
                    elif len(g.sizes) == 2 and not gated:
                        g.max_rows = None
                qkv_rows = next((g.max_rows for g in groups.values() if len(g.sizes) == 3), None)
                rows.append({**anatomy(model, who, args, shared, gated), "qkv_max_rows": qkv_rows})
                if not shared:
                    del backend.run_sharing
                if not gated:
                    MXFP8Linear.on_gated = on_gated
                for key, g in groups.items():
                    g.max_rows = kept[key]
                print(json.dumps(rows[-1], indent=1), flush=True)
                if args.json:
                    doc = {"device": torch.cuda.get_device_name(), "rows": rows}
                    Path(args.json).write_text(json.dumps(doc, indent=1))
        del model
        torch.cuda.empty_cache()
    print("| who | groups up to rows | q/k/v up to rows | shared quantization | gated MLPs | wall ms | profiled ms | "
          "GPU busy ms | gaps > 20 µs ms (count) | kernels | kinds ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in r["kinds_ms"].items())
        print(f"| {r['who']} | {r['max_rows']} | {r['qkv_max_rows']} | {r['shared']} | {r['gated']} | "
              f"{r['wall_ms']:.1f} | {r['profiled_ms']:.1f} | "
              f"{r['busy_ms']:.1f} | {r['gaps_over_20us_ms']:.2f} ({r['gaps_over_20us']}) | {r['kernels']} | "
              f"{kinds} |")  # fmt: skip


if __name__ == "__main__":
    main()
