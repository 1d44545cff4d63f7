"""Host time of a compiled model's guards (Dynamo's "TorchDynamo Cache Lookup", from torch.profiler), bf16 layers
against MXFP8Linear layers. One variant a process (Dynamo's caches are per code object):

- ``blocks``: 32 blocks of q, k and v projections (128 x 128) whose outputs are summed, compiled; ``mxgemm`` layers
  one by one, ``fused`` as one (``fuse_shared_inputs``); the median over 50 calls, per round.
- ``--llama LAYERS``: a few-MB Llama (``bench/model_e2e.py --tiny``; q/k/v and gate/up as one) through ``generate``
  with a static cache and the decode step compiled, as model_e2e.py's graphs mode; the guard time per decode step.
  ``--moe``: the few-MB Qwen3-MoE instead (its experts ``MXFP8Experts``).

Run: PYTHONPATH=src python3 lab/guard_cost.py {bf16,mxgemm,fused} [--device cuda] [--dict-tags]
     PYTHONPATH=src python3 lab/guard_cost.py {bf16,mxgemm} --llama 32 [--moe] --dict-tags
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import transformers
from torch import nn
from torch.profiler import ProfilerActivity, profile

from mxgemm.fusion import fuse_shared_inputs
from mxgemm.linear import MXFP8Linear

LOOKUP = "TorchDynamo Cache Lookup"


class Block(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = make(), make(), make()

    def forward(self, x):
        return self.q_proj(x) + self.k_proj(x) + self.v_proj(x)


def lookups_ns(fn) -> list[int]:
    """The guard checks' durations during ``fn()``."""
    with profile(activities=[ProfilerActivity.CPU]) as p:
        fn()
    return [e.duration_ns() for e in p.profiler.kineto_results.events() if e.name() == LOOKUP]


def blocks(args) -> list[float]:
    dev = args.device

    def bf16():
        return nn.Linear(128, 128, bias=False).to(dev, torch.bfloat16)

    def mx():
        return MXFP8Linear.from_linear(bf16())

    model = nn.Sequential(*(Block(bf16 if args.variant == "bf16" else mx) for _ in range(args.blocks)))
    if args.variant == "fused":
        fuse_shared_inputs(model)
    f = torch.compile(model, dynamic=False)
    x = torch.randn(4, 128, dtype=torch.bfloat16, device=dev)
    with torch.inference_mode():
        for _ in range(3):
            f(x)
        return [statistics.median(lookups_ns(lambda: [f(x) for _ in range(50)])) / 1e6 for _ in range(args.rounds)]


def llama(args) -> list[float]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from model_e2e import build, config

    model, _ = build(config(args.llama, tiny=True, moe=args.moe), args.variant, (), args.device)
    config = transformers.CompileConfig(dynamic=False)
    config._compile_all_devices = True  # Hugging Face compiles the decode step on CUDA devices only otherwise
    kw = {"cache_implementation": "static", "compile_config": config, "do_sample": False}
    ids = torch.randint(1, model.config.vocab_size, (1, 16), device=args.device)

    def generate(new: int) -> None:
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)

    with torch.inference_mode():
        for _ in range(2):
            generate(9)
        # the decode steps' guard checks: those of 1 + 8 new tokens less those of one
        return [(sum(lookups_ns(lambda: generate(9))) - sum(lookups_ns(lambda: generate(1)))) / 8 / 1e6
                for _ in range(args.rounds)]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("variant", choices=("bf16", "mxgemm", "fused"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--llama", type=int, default=0, help="layers of the Llama through generate (0: the blocks)")
    parser.add_argument("--moe", action="store_true", help="the Qwen3-MoE through generate instead of the Llama")
    parser.add_argument("--rounds", type=int, default=5)
    tags = "turn on Dynamo's recursive dict-tag guard skipping (on by default in torch 2.11)"
    parser.add_argument("--dict-tags", action="store_true", help=tags)
    args = parser.parse_args()
    if args.dict_tags:
        torch._dynamo.config.use_recursive_dict_tags_for_guards = True
    times = llama(args) if args.llama else blocks(args)
    model = "Qwen3-MoE" if args.moe else "Llama"
    what = f"a decode step, {args.llama}-layer {model}" if args.llama else f"a call, {args.blocks} blocks of 3 layers"
    print(
        f"{args.variant:10s} guard time {statistics.median(times):.3f} ms ({what}, {args.device}, dict tags "
        f"{'on' if torch._dynamo.config.use_recursive_dict_tags_for_guards else 'off'}, rounds: "
        f"{[round(t, 3) for t in times]})"
    )


if __name__ == "__main__":
    main()
