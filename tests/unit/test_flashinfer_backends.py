"""FlashInfer / cuBLAS MX backends on CPU: selection by FlashInfer's own answer, reasons, weight preparation, with the
real FlashInfer and spies on what it is asked (the GEMMs themselves run in test_flashinfer_real.py)."""

import sys
import types
from pathlib import Path

import pytest
import torch
from helpers import hide_package, random_mx_weight

import mxgemm
from mxgemm import layouts
from mxgemm.device import DeviceInfo

B200 = DeviceInfo(type="cuda", name="B200", capability=(10, 0), index=0)
SM107 = DeviceInfo(type="cuda", name="pretend", capability=(10, 7), index=0)
H200 = DeviceInfo(type="cuda", name="NVIDIA H200", capability=(9, 0), index=0)

# trtllm-gen's row order within 32-row blocks for epilogue tile 128 (its srcToDstBlk32RowMap)
ROW_MAP_32 = [
    0,
    8,
    16,
    24,
    1,
    9,
    17,
    25,
    2,
    10,
    18,
    26,
    3,
    11,
    19,
    27,
    4,
    12,
    20,
    28,
    5,
    13,
    21,
    29,
    6,
    14,
    22,
    30,
    7,
    15,
    23,
    31,
]


def reference_shuffle_rows(t: torch.Tensor) -> torch.Tensor:
    """Plain-torch shuffleMatrixA for epilogue tile 128: source row r goes to (r // 32) * 32 + ROW_MAP_32[r % 32]."""
    m = t.shape[0]
    dst = torch.empty(m, dtype=torch.long)
    for r in range(m):
        dst[(r // 32) * 32 + ROW_MAP_32[r % 32]] = r
    return t[dst]


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """The real FlashInfer (pinned in the dev extras) with spies: what ``is_backend_supported`` is asked, and the
    trtllm shuffles' calls. Its scale shuffle ends in a CUDA-only 128x4 re-interleave: the documented layout
    (``layouts.to_128x4``) stands in for that step alone."""
    fi = pytest.importorskip("flashinfer")
    quantization = sys.modules[fi.shuffle_matrix_sf_a.__module__]
    monkeypatch.setattr(quantization, "block_scale_interleave", lambda t: layouts.to_128x4(t.view(torch.uint8)))
    asked, shuffle_calls = [], []
    supported = fi.mm_mxfp8.is_backend_supported

    def is_backend_supported(backend, cc):
        asked.append((backend, cc))
        return supported(backend, cc)

    monkeypatch.setattr(fi.mm_mxfp8, "is_backend_supported", is_backend_supported)
    shuffle_a, shuffle_sf = fi.shuffle_matrix_a, fi.shuffle_matrix_sf_a

    def shuffle_matrix_a(t, tile):
        shuffle_calls.append(("a", tuple(t.shape), tile))
        return shuffle_a(t, tile)

    def shuffle_matrix_sf_a(t, tile, num_elts_per_sf=16):
        shuffle_calls.append(("sf", tuple(t.shape), tile, num_elts_per_sf))
        return shuffle_sf(t, tile, num_elts_per_sf)

    monkeypatch.setattr(fi, "shuffle_matrix_a", shuffle_matrix_a)
    monkeypatch.setattr(fi, "shuffle_matrix_sf_a", shuffle_matrix_sf_a)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return types.SimpleNamespace(module=fi, asked=asked, shuffle_calls=shuffle_calls)


def test_sm100_picks_cutedsl(fake_flashinfer):
    assert mxgemm.resolve_backend("auto", device=B200).name == "flashinfer_cutedsl"
    assert ("cute-dsl", 100) in fake_flashinfer.asked


def test_sm107_is_asked_with_107(fake_flashinfer):
    assert mxgemm.resolve_backend("auto", device=SM107).name == "flashinfer_cutedsl"
    assert ("cute-dsl", 107) in fake_flashinfer.asked


def test_sm120_gets_cutlass_where_only_it_is_supported(fake_flashinfer):
    sm120 = DeviceInfo(type="cuda", name="RTX PRO 6000", capability=(12, 0), index=0)
    res = mxgemm.explain_auto(sm120)
    assert res.backend.name == "flashinfer_cutlass"
    assert "does not support compute capability 120" in dict(res.skipped)["flashinfer_cutedsl"]


def test_an_unsupported_sm_falls_back_with_reasons(fake_flashinfer):
    sm89 = DeviceInfo(type="cuda", name="L40S", capability=(8, 9), index=0)
    res = mxgemm.explain_auto(sm89)
    assert res.backend.name == "triton"
    skipped = dict(res.skipped)
    assert "does not support compute capability 89" in skipped["flashinfer_cutedsl"]
    assert "cannot probe cuBLAS" in skipped["cublas_mx"] and "Hopper" in skipped["hybrid_sm90"]


def test_explicit_trtllm_on_hopper_raises_with_reason(fake_flashinfer):
    with pytest.raises(mxgemm.BackendUnavailableError, match="'trtllm' does not support compute capability 90"):
        mxgemm.resolve_backend("flashinfer_trtllm", device=H200)


def test_trtllm_shape_constraints(fake_flashinfer):
    with pytest.raises(mxgemm.BackendUnavailableError, match="K % 256 == 0, got K=4160"):
        mxgemm.resolve_backend("flashinfer_trtllm", device=B200, shape=(4096, 4160))
    with pytest.raises(mxgemm.BackendUnavailableError, match="N >= 128 and K >= 128, got N=64"):
        mxgemm.resolve_backend("flashinfer_cutlass", device=B200, shape=(64, 4096))
    res = mxgemm.explain_auto(B200, shape=(64, 4096))  # too small for FlashInfer: auto moves on
    assert res.backend.name == "triton"


def test_missing_flashinfer_names_the_package(monkeypatch):
    hide_package(monkeypatch, "flashinfer")
    with pytest.raises(mxgemm.BackendUnavailableError, match="'flashinfer-python' package is not installed"):
        mxgemm.resolve_backend("flashinfer_cutedsl", device=B200)


def test_flashinfer_answer_errors_become_reasons(fake_flashinfer, monkeypatch):
    def broken(backend, cc):
        raise RuntimeError("no such backend")

    monkeypatch.setattr(fake_flashinfer.module.mm_mxfp8, "is_backend_supported", broken)
    answer = mxgemm.backends.get_backend("flashinfer_cutlass").check_device(B200)
    assert not answer and "FlashInfer could not answer for 'cutlass': no such backend" in answer.reason


def test_cutlass_preparation_swizzles_scales(fake_flashinfer):
    q, s = random_mx_weight(256, 512)
    w = mxgemm.backends.get_backend("flashinfer_cutlass").prepare(q, s, "w8a8-mx")
    assert torch.equal(w.tensors["scale"], layouts.to_128x4(s))
    assert torch.equal(w.tensors["qdata"].view(torch.uint8), q.view(torch.uint8))


def test_trtllm_preparation_pads_shuffles_and_remembers_n(fake_flashinfer):
    q, s = random_mx_weight(130, 512)
    backend = mxgemm.backends.get_backend("flashinfer_trtllm")
    w = backend.prepare(q, s, "w8a8-mx")
    assert w.out_features == 130 and w.tensors["qdata"].shape == (256, 512)
    assert fake_flashinfer.shuffle_calls == [("a", (256, 512), 128), ("sf", (256, 16), 128, 32)]
    qp = torch.nn.functional.pad(q.view(torch.uint8), (0, 0, 0, 126))
    assert torch.equal(w.tensors["qdata"].view(torch.uint8), reference_shuffle_rows(qp))
    assert torch.equal(
        w.tensors["scale"], layouts.to_128x4(reference_shuffle_rows(torch.nn.functional.pad(s, (0, 0, 0, 126))))
    )
    again = backend.prepare(q, s, "w8a8-mx")  # re-preparing (a weight refit) gives the same bytes
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(w.op_tensors, again.op_tensors, strict=True)
    )


def test_reference_shuffle_is_a_permutation_within_blocks():
    rows = torch.arange(64).unsqueeze(1)
    out = reference_shuffle_rows(rows).squeeze(1)
    assert sorted(out.tolist()) == list(range(64))
    assert out[:4].tolist() == [0, 4, 8, 12] and out[32:36].tolist() == [32, 36, 40, 44]


def test_tuning_a_flashinfer_backend_runs_flashinfers_autotuner(fake_flashinfer, monkeypatch, tmp_path):
    import contextlib
    import os

    from mxgemm.autotune import Autotuner
    from mxgemm.tuning import TuningCache

    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the activation quantizer runs under the interpreter here
    state = {"tuning": False, "runs_while_tuning": 0}

    @contextlib.contextmanager
    def autotune(on, cache=None):
        state["tuning"], state["cache"] = on, cache
        yield
        state["tuning"] = False

    def mm_mxfp8(a, b, a_scale, b_scale, out_dtype, backend, **kw):
        state["runs_while_tuning"] += state["tuning"]
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype)

    backend = mxgemm.backends.get_backend("flashinfer_cutlass")
    assert backend.tunable
    fi = types.SimpleNamespace(autotuner=types.SimpleNamespace(autotune=autotune), mm_mxfp8=mm_mxfp8)
    monkeypatch.setattr("mxgemm.backends.flashinfer_mx._flashinfer", lambda: fi)
    q, s = random_mx_weight(256, 256)
    w = backend.prepare(q, s, "w8a8-mx")
    tuner = Autotuner(TuningCache(tmp_path / "t.json", {"test": 1}), timer=lambda fn: (fn(), 1.0)[1])
    result = tuner.tune(backend, w, 8, torch.bfloat16)
    assert result is not None and state["runs_while_tuning"] == 1 and not state["tuning"]
    assert Path(state["cache"]).name.startswith("flashinfer-tuning-cpu-")


def test_cublas_mx_preparation(fake_flashinfer):
    q, s = random_mx_weight(130, 256)
    w = mxgemm.backends.get_backend("cublas_mx").prepare(q, s, "w8a8-mx")
    assert w.tensors["qdata"].shape == (144, 256) and w.out_features == 130
    assert torch.equal(w.tensors["scale"], layouts.to_128x4(torch.nn.functional.pad(s, (0, 0, 0, 14))))


@pytest.mark.parametrize("name", ["flashinfer_cutlass", "flashinfer_cutedsl", "flashinfer_trtllm", "cublas_mx"])
def test_w8a8_mx_backends_keep_one_copy_and_give_the_checkpoint_tensors_back(fake_flashinfer, name):
    """A prepared weight is the layer's only copy (<= 1.07 bytes per parameter with trtllm's padding), and the MX
    pair rebuilt from it (swizzles and FlashInfer's shuffles undone) is the checkpoint's, byte for byte."""
    n, k = 250, 512
    q, s = random_mx_weight(n, k)
    backend = mxgemm.backends.get_backend(name)
    w = backend.prepare(q, s, "w8a8-mx")
    assert w.nbytes <= 1.07 * 256 * k  # N padded to 256 by trtllm and cublas_mx
    wq, ws = backend.export_mx(w)
    assert torch.equal(wq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(ws, s)
