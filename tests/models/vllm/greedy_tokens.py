"""Run inside an environment with vLLM (CPU build) and mxgemm installed.

`python greedy_tokens.py WORK_FOLDER`: write a tiny Llama, convert it with `mxgemm quantize` into WORK_FOLDER/mx,
then print as JSON the greedy tokens of vLLM (with mxgemm's plugin) and of Hugging Face + mxgemm, and each MXFP8
layer's kernel and backend. `python greedy_tokens.py WORK_FOLDER --tp 2`: vLLM's greedy tokens on that checkpoint
with tensor parallelism over 2 CPU workers (column-parallel layers split N, row-parallel ones K).
`python greedy_tokens.py WORK_FOLDER --modelopt`: the same tensors as a ModelOpt MXFP8 checkpoint (vLLM's
`modelopt_mxfp8` method, the quantization config in config.json), vLLM's greedy tokens.
`python greedy_tokens.py WORK_FOLDER --moe [--tp 2 [--ep] | --modelopt]`: each of the above for a tiny Qwen3-MoE
(8 experts, top-2) converted into WORK_FOLDER/moe-mx, with each MoE layer's method and backend; --ep: vLLM's expert
parallelism (4 whole experts a rank) instead of splitting each expert.
`python greedy_tokens.py WORK_FOLDER --mixtral`: the first for a tiny Mixtral (experts stored as w1 / w3 / w2).
`python greedy_tokens.py WORK_FOLDER --readme EXAMPLE.py`: run the README's vLLM example in a folder where
`my-model-mxfp8` is the tiny Qwen3-MoE's checkpoint with a word-level tokenizer (the tiny model has none)."""

import json
import subprocess
import sys
from pathlib import Path

import torch
import transformers

PROMPT = [1, 17, 42, 99, 7, 300, 12, 5]
NEW_TOKENS = 16


def write_checkpoint(work: Path, moe: bool = False, mixtral: bool = False) -> Path:
    common = dict(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    common.update(max_position_embeddings=256, tie_word_embeddings=False)
    if mixtral:  # experts stored as block_sparse_moe.experts.<e>.{w1,w3,w2}
        config = transformers.MixtralConfig(**common, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2)
        config.architectures = ["MixtralForCausalLM"]
    elif moe:  # an expert width of 128: 64 per rank under tensor parallelism, a multiple of 32
        config = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2)
        config.architectures = ["Qwen3MoeForCausalLM"]
    else:
        config = transformers.LlamaConfig(**common, intermediate_size=512)
        config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    # the MoE's weights wider (std 0.1): at 0.05 its 7th greedy token is a near tie that the order of tensor
    # parallelism's sums decides (each rank's partial rounded to bf16 before vLLM adds them; the bf16 model picks
    # the other token too); at 0.1 the tokens are clear of such ties. The tiny Mixtral at 0.1 has two such ties
    # (its 9th and 11th tokens lead the next by 0.002 in logit, where vLLM and transformers differ); at 0.2 its 16
    # tokens match
    for p in model.parameters():
        p.data.normal_(0, 0.2 if mixtral else 0.1 if moe else 0.05)
    prefix = "mixtral-" if mixtral else "moe-" if moe else ""
    model.save_pretrained(work / f"{prefix}bf16")
    cmd = [sys.executable, "-m", "mxgemm", "quantize", str(work / f"{prefix}bf16"), str(work / f"{prefix}mx")]
    subprocess.run([*cmd, "--scheme", "MXFP8", "--force"], check=True)
    return work / f"{prefix}mx"


def hf_tokens(folder: Path) -> list[int]:
    import mxgemm

    config = transformers.AutoConfig.from_pretrained(folder)
    # made in bf16 (not cast to it: the rotary frequencies stay fp32, as from_pretrained and vLLM keep them)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    mxgemm.load_checkpoint(model, folder)  # Mixtral's stored names (block_sparse_moe, w1 / w3 / w2) read as the model's
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(PROMPT) :].tolist()


def vllm_tokens(folder: Path, tp: int = 1, ep: bool = False) -> tuple[list[int], list[str]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(folder),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=128,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
        enable_expert_parallel=ep,
    )
    layers = []
    if tp == 1:  # vLLM's public hook into its model (its workers under tp > 1 take no functions)
        layers = llm.apply_model(_mxfp8_layers)[0] + llm.apply_model(_moe_layers)[0]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params)
    return list(out[0].outputs[0].token_ids), layers


def _mxfp8_layers(model) -> list[str]:
    """Each MXFP8 layer's kernel class and, where mxgemm prepared it, the backend and whether vLLM's copy of the
    checkpoint tensors is gone."""
    rows = []
    for module in model.modules():
        kernel = getattr(getattr(module, "scheme", None), "kernel", None)  # compressed-tensors layers keep their scheme
        if kernel is None:
            continue
        prepared = getattr(module, "mxgemm_weight", None)
        rows.append(f"{type(kernel).__name__}:{prepared.backend if prepared else None}:{hasattr(module, 'weight')}")
    return rows


def _moe_layers(model) -> list[str]:
    """Each MoE layer's method class and, where mxgemm prepared its experts, the backend and whether vLLM's copy of
    the checkpoint tensors is gone."""
    rows = []
    for module in model.modules():
        if hasattr(module, "w13_weight") or hasattr(module, "mxgemm_w13"):
            prepared = getattr(module, "mxgemm_w13", None)
            method = type(module.quant_method).__name__
            rows.append(f"{method}:{prepared.backend if prepared else None}:{hasattr(module, 'w13_weight')}")
    return rows


def as_modelopt(folder: Path, out: Path) -> Path:
    """``folder``'s compressed-tensors checkpoint rewritten as a ModelOpt MXFP8 one: the same tensors, the
    quantization config ModelOpt's (quant_algo MXFP8, excluding what compressed-tensors' config ignores)."""
    out.mkdir(exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    ignore = config["quantization_config"]["ignore"]
    config["quantization_config"] = {
        "quant_method": "modelopt_mxfp8",
        "quantization": {"quant_algo": "MXFP8", "kv_cache_quant_algo": None, "exclude_modules": ignore},
    }
    (out / "config.json").write_text(json.dumps(config))
    for f in folder.iterdir():
        if f.name != "config.json" and f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    return out


def readme_example(work: Path, example: Path) -> None:
    import os
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = work / "readme" / "my-model-mxfp8"
    shutil.copytree(write_checkpoint(work, moe=True), folder, dirs_exist_ok=True)
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, **{f"t{i}": i for i in range(3, 512)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(folder)
    os.chdir(folder.parent)
    exec(compile(example.read_text(), "README.md", "exec"), {"__name__": "__main__"})


def main() -> None:
    work, flags = Path(sys.argv[1]), sys.argv[2:]
    if flags[:1] == ["--readme"]:
        readme_example(work, Path(flags[1]))
        return
    moe, mixtral = "--moe" in flags, "--mixtral" in flags
    prefix = "mixtral-" if mixtral else "moe-" if moe else ""
    if "--tp" in flags:  # on the checkpoint a run without flags wrote
        tp = int(flags[flags.index("--tp") + 1])
        print(json.dumps({"vllm": vllm_tokens(work / f"{prefix}mx", tp=tp, ep="--ep" in flags)[0]}))
        return
    if "--modelopt" in flags:  # the same, in ModelOpt's layout
        tokens, layers = vllm_tokens(as_modelopt(work / f"{prefix}mx", work / f"{prefix}modelopt"))
        print(json.dumps({"vllm": tokens, "layers": layers}))
        return
    folder = write_checkpoint(work, moe=moe, mixtral=mixtral)
    hf = hf_tokens(folder)
    vllm, layers = vllm_tokens(folder)
    print(json.dumps({"hf": hf, "vllm": vllm, "layers": layers}))


if __name__ == "__main__":
    main()
