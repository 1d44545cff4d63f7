"""bench/model_e2e.py runs end to end (a few-MB Llama on the CPU: a smoke test of the script, not a measurement) and
writes the rows the e2e results are read from."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location("model_e2e", Path(__file__).parents[2] / "bench" / "model_e2e.py")
model_e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(model_e2e)


def test_rows_for_both_models_each_mode_and_batch(tmp_path):
    out = tmp_path / "e2e.json"
    # 24 new tokens: the decode time (all of generate's but the first token's) stands well clear of timing noise; three
    # eager rounds: a median of two is their mean, which one stalled call on a busy 2-core host can turn negative
    model_e2e.main(
        [
            "--tiny",
            "--device",
            "cpu",
            "--layers",
            "1",
            "--batches",
            "1",
            "2",
            "--modes",
            "eager",
            "--repeats",
            "2",
            "--eager-repeats",
            "3",
            "--prompt",
            "8",
            "--new",
            "24",
            "--prefill",
            "16",
            "--json",
            str(out),
            "--markdown",
            str(tmp_path / "e2e.md"),
        ]
    )
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["who"], r["batch"]) for r in rows] == [("bf16", 1), ("mxgemm", 1), ("bf16", 2), ("mxgemm", 2)]
    keys = {"who", "mode", "batch", "decode_tok_s", "prefill_2048_ms", "ttft_ms", "weights_bytes"}
    assert all(keys <= r.keys() and r["decode_tok_s"] > 0 and r["ttft_ms"] > 0 for r in rows)
    by = {r["who"]: r["weights_bytes"] for r in rows}
    assert by["mxgemm"] < 0.7 * by["bf16"]  # every linear layer, lm_head included, at about a byte a parameter
    assert "replaced 8 of 8 linear layers" in result["quantize_report"]["mxgemm"]
    table = (tmp_path / "e2e.md").read_text()
    assert "| eager | 2 |" in table
    pairs = [model_e2e.paired_speedups(rows[i], rows[i + 1]) for i in (0, 2)]
    assert all(len(p) == 3 for p in pairs)  # a ratio a round
    assert f"eager at batch 2: {min(pairs[1]):.2f}-{max(pairs[1]):.2f}x" in table
    assert "-token prefill over all 6 rounds of each model" in table


def test_paired_speedups_divide_each_rounds_decode_times():
    bf16 = {"rounds_s": {"full": [3.0, 5.0], "ttft": [1.0, 1.0]}}
    mx = {"rounds_s": {"full": [2.0, 3.0], "ttft": [1.0, 1.0]}}
    assert model_e2e.paired_speedups(bf16, mx) == [2.0, 2.0]


def test_pooled_prefill_takes_every_rows_rounds():
    rows = [
        {"who": who, "mode": "eager", "batch": b, "rounds_s": {"prefill": times}}
        for who, b, times in [
            ("bf16", 1, [6.0, 9.0]),
            ("mxgemm", 1, [3.0, 3.0]),
            ("bf16", 16, [8.0, 4.0]),
            ("mxgemm", 16, [4.0, 2.0]),
        ]
    ]
    bf16, mx, ratios = model_e2e.pooled_prefill(rows)
    assert (bf16, mx, ratios) == (7.0, 3.0, [2.0, 3.0, 2.0, 2.0])


def test_moe_rows_quantize_the_experts(tmp_path):
    out = tmp_path / "e2e.json"
    args = ["--moe", "--tiny", "--device", "cpu", "--layers", "1", "--batches", "1", "--modes", "eager"]
    args += ["--repeats", "1", "--eager-repeats", "1", "--prompt", "8", "--new", "4", "--prefill", "16"]
    model_e2e.main([*args, "--json", str(out), "--markdown", str(tmp_path / "e2e.md")])
    result = json.loads(out.read_text())
    assert result["model"] == "Qwen3-MoE at tiny dimensions"
    report = result["quantize_report"]["mxgemm"]
    assert report.startswith("replaced 5 of 5 linear layers, 1 of 1 experts modules")
    by = {r["who"]: r["weights_bytes"] for r in result["rows"]}
    assert by["mxgemm"] < 0.7 * by["bf16"]  # the experts' bytes counted at about a byte a parameter
    assert (tmp_path / "e2e.md").read_text().startswith("Qwen3-MoE at tiny dimensions, 1 layers")


@pytest.mark.parametrize("grad_mode", ["inference", "no_grad"])
def test_the_calls_run_in_the_grad_mode_asked_for(tmp_path, monkeypatch, grad_mode):
    """``--grad-mode``: every generate call under torch.inference_mode (the default) or torch.no_grad, and the JSON
    and the table's heading say which."""
    modes = []
    timed = model_e2e.Timer.generate

    def generate(self, *args, **kwargs):
        modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        return timed(self, *args, **kwargs)

    monkeypatch.setattr(model_e2e.Timer, "generate", generate)
    out, md = tmp_path / "e2e.json", tmp_path / "e2e.md"
    args = ["--tiny", "--device", "cpu", "--layers", "1", "--batches", "1", "--modes", "eager", "--repeats", "1"]
    args += ["--eager-repeats", "1", "--prompt", "8", "--new", "2", "--prefill", "8", "--grad-mode", grad_mode]
    model_e2e.main([*args, "--json", str(out), "--markdown", str(md)])
    assert modes and set(modes) == {(grad_mode == "inference", False)}
    assert json.loads(out.read_text())["grad_mode"] == grad_mode
    assert f"`torch.{'inference_mode' if grad_mode == 'inference' else 'no_grad'}`" in md.read_text()
