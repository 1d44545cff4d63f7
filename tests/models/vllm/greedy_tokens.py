"""Run inside an environment with vLLM (CPU build) and mxgemm installed.

`python greedy_tokens.py WORK_FOLDER`: write a tiny Llama, convert it with `mxgemm quantize` into WORK_FOLDER/mx,
then print as JSON the greedy tokens of vLLM (with mxgemm's plugin) and of Hugging Face + mxgemm, and each MXFP8
layer's kernel and backend. `python greedy_tokens.py WORK_FOLDER --tp 2`: vLLM's greedy tokens on that checkpoint
with tensor parallelism over 2 CPU workers (column-parallel layers split N, row-parallel ones K).
`python greedy_tokens.py WORK_FOLDER --modelopt`: the same tensors as a ModelOpt MXFP8 checkpoint (vLLM's
`modelopt_mxfp8` method, the quantization config in config.json), vLLM's greedy tokens.
`python greedy_tokens.py WORK_FOLDER --readme EXAMPLE.py`: run the README's vLLM example in a folder where
`my-model-mxfp8` is that checkpoint with a word-level tokenizer (the tiny model has none)."""

import json
import subprocess
import sys
from pathlib import Path

import torch
import transformers

PROMPT = [1, 17, 42, 99, 7, 300, 12, 5]
NEW_TOKENS = 16


def write_checkpoint(work: Path) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    model.save_pretrained(work / "bf16")
    cmd = [sys.executable, "-m", "mxgemm", "quantize", str(work / "bf16"), str(work / "mx"), "--scheme", "MXFP8"]
    subprocess.run([*cmd, "--force"], check=True)
    return work / "mx"


def hf_tokens(folder: Path) -> list[int]:
    import mxgemm

    model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(folder)).to(torch.bfloat16)
    mxgemm.load_checkpoint(model, folder)
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(PROMPT) :].tolist()


def vllm_tokens(folder: Path, tp: int = 1) -> tuple[list[int], list[str]]:
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
    )
    layers = llm.apply_model(_mxfp8_layers)[0] if tp == 1 else []  # vLLM's public hook into its model
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


def as_modelopt(folder: Path, out: Path) -> Path:
    """``folder``'s compressed-tensors checkpoint rewritten as a ModelOpt MXFP8 one: the same tensors, the
    quantization config ModelOpt's (quant_algo MXFP8, lm_head excluded)."""
    out.mkdir(exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "modelopt_mxfp8",
        "quantization": {"quant_algo": "MXFP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]},
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
    shutil.copytree(work / "mx", folder, dirs_exist_ok=True)
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, **{f"t{i}": i for i in range(3, 512)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(folder)
    os.chdir(folder.parent)
    exec(compile(example.read_text(), "README.md", "exec"), {"__name__": "__main__"})


def main() -> None:
    work = Path(sys.argv[1])
    if sys.argv[2:3] == ["--readme"]:
        readme_example(work, Path(sys.argv[3]))
        return
    if sys.argv[2:4] == ["--tp", "2"]:
        print(json.dumps({"vllm": vllm_tokens(work / "mx", tp=2)[0]}))
        return
    if sys.argv[2:3] == ["--modelopt"]:
        tokens, layers = vllm_tokens(as_modelopt(work / "mx", work / "modelopt"))
        print(json.dumps({"vllm": tokens, "layers": layers}))
        return
    folder = write_checkpoint(work)
    hf = hf_tokens(folder)
    vllm, layers = vllm_tokens(folder)
    print(json.dumps({"hf": hf, "vllm": vllm, "layers": layers}))


if __name__ == "__main__":
    main()
