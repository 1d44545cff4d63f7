#!/usr/bin/env bash
# The H200 runs, in stages; several stages may run in one device call.
# Usage on the device: bash lab/h200_pending.sh STAGE [STAGE ...]   (outputs under $OUT, or ./out when OUT is unset)
#   tune    `mxgemm tune` of the shape sets (llama3-8b, llama3-70b, hidden-7168, llama3-8b-hf), timed; the tuning file
#   gate    the GPU tests of the small-M kernel, hybrid, graphs, autotuning; stops the run when one fails
#   ship    copy the tuning file just made into src/mxgemm/tuned/ (of this copy of the tree) before benchmarks
#   tests   GPU test suite (incl. CUDA graphs, the MX quantizer's bit-exactness) and `mxgemm info`
#   crossover  bench/crossover.py: the exact regime against cuBLASLt and the FP8 kernel at M = 1-128
#   fp8-ncu  Nsight Compute on the swap-AB FP8 kernel (lab/profile_kernel.py --kernel swap-ab): throughput,
#           warp states, stalls
#   small-m-ncu  Nsight Compute on the small-M kernel (lab/profile_kernel.py --kernel small-m; SM_N/SM_K/SM_M
#           pick the shape, default 8B gate_up at M = 1): DRAM throughput, memory workload, warp states
#   eager   bench/eager_calls.py: one eager call against bf16's, Llama-3-8B and Qwen2.5-7B projections
#   e2e     bench/model_e2e.py: a 32-layer Llama at 8B dimensions through generate, bf16 vs mxgemm (E2E_MODES)
#   load    bench/load_gpu.py: an 8B-dimension MXFP8 checkpoint loaded to the GPU (peak against final footprint)
#   quant   lab/quantizers.py: the CUDA and Triton 1x128 quantizers under graph replay, alone and with cuBLASLt
#   ulp     lab/ulp_margins.py: each hybrid_sm90 path's worst error against its exact product
#   op      lab/op_overhead.py: host time of an eager call against the same call through mxgemm::linear
#   profile lab/e2e_profile.py (PROFILE_ARGS, default --layers 4 --graphs): where generate's time goes,
#           bf16 vs mxgemm, eager and graphs
#   prefill lab/prefill_anatomy.py (PREFILL_ARGS, default --max-rows 1024): the eager 2048-token prefill's
#           wall and GPU time by kernel kind, bf16 vs mxgemm
#   anatomy lab/decode_anatomy.py (ANATOMY_ARGS, default --layers 32 --batch 1): a graphed decode step's
#           wall time, GPU busy time, kernels by kind and the projections alone, bf16 vs mxgemm; the MoE model's with
#           ANATOMY_ARGS="--moe --layers 24 --batch 1"
#   ttft    lab/ttft_probe.py (TTFT_ARGS, default --modes eager --batches 1 --repeats 9): every generate call
#           with its time, its garbage-collector time and the CUDA allocator's segments and retries
#   mechanisms  lab/eager_mechanisms.py --device cuda: host time of an eager layer call by mechanism (Python,
#           pybind11, torch.ops), the kernel a C function that returns at once
#   split   lab/eager_split.py: each eager call's host time and back-to-back GPU time
#   launch  lab/launch_cost.py: host time of one and two launches, and of a graph of them replayed
#   lt-algos  lab/lt_algos.py: each cuBLASLt blockwise algorithm of the planned call against _scaled_mm
#   large-m  lab/large_m_fp8.py: our FP8 kernel's 128-token configs against cuBLASLt at M = 512-4096
#   tokm-lab  lab/tokm_lab.py: variants of the tokens-as-M kernel against it and cuBLASLt, GEMM alone
#   large-m-ncu  Nsight Compute on the tokens-as-M kernel and cuBLASLt's, 8B o at M = 2048 (profile_kernel.py)
#   new-lengths  lab/new_lengths.py: eager prefills of prompt lengths not seen before (plans made) and again
#   prefill-host  lab/prefill_host.py: the eager prefill's host time by route above fusion.MAX_ROWS
#   bench-hf  the llama3-8b-hf set (Hugging Face's unfused projections, lm_head included)
#   moe-apart  the MoE e2e's prefill and eager batch 16 with no tuning file: this tree under inference_mode and
#           no_grad, and f0b8c98's tree (git worktree), three runs of one machine (~3 x 60 s at 24 layers)
#   moe-kernels  lab/moe_prefill_kernels.py: the MoE prefill's GPU time by kernel, this tree and f0b8c98's, each with
#           its shipped tuning file and with none
#   moe-host  the routed block's host time by step (lab/moe_experts_host.py), the 24-layer MoE prefill taken apart
#           (lab/moe_prefill_kernels.py), bf16 and mxgemm
#   moe-gate / moe-bench / moe-tune / moe-e2e / moe-graphs  the experts: their GPU tests, mxgemm bench --moe (DeepGEMM
#           beside where .anchors/deepgemm was carried), mxgemm tune --moe merged into the shipped tuning file, the
#           MoE e2e (48 layers where they fit), eager decode with MXFP8Experts' graphs against without
#   reship  the tuning file that moe-tune merged on this warm machine (kept in /tmp) back into this call's tree
#   grad-modes  lab/grad_modes.py (GRAD_ARGS, default --layers 16): eager generate under no_grad against under
#           inference_mode, where the q/k/v groups run apart, bf16 and mxgemm
#   dense-variants  lab/dense_variants.py: the dense FP8 kernel's tokens-as-M configs from the tree's sources beside
#           DENSE_PATCHES' (lab/patches), timed and compared bit for bit; then the FP8 kernel's GPU tests patched
#   block-variants  lab/block_variants.py: the routed block's one C call built from the tree's grouped sources
#           beside BLOCK_PATCHES' (lab/patches), timed and compared bit for bit (BLOCK_ARGS); then the routed
#           block's GPU tests with the last patch applied
#   grouped-ncu  Nsight Compute on the grouped wgmma kernel and DeepGEMM's contiguous kernel (lab/grouped_ncu.py),
#           Qwen3 and Mixtral gate/up at 4096 tokens by default (NCU_PROBLEMS)
#   grouped-large  the tree's grouped wgmma kernel beside lab/patches' LARGE_PATCHES (default grouped-regs,
#           grouped-vstore, grouped-xscale and grouped-regs-xscale: lab/results/grouped-xscale-h100.txt) at the LARGE
#           prefill sizes of lab/grouped_variants.py, then the grouped GPU tests with the last patch applied
#   grouped-variants  lab/grouped_variants.py: the tree's grouped wgmma kernel beside the kernel before the persistent
#           grid (f0b8c98~1) and the tree's with each of VARIANT_PATCHES (default lab/patches/grouped-*.patch; one
#           that does not apply is left out) applied
#   rows-quant  lab/rows_quant.py: the routed rows' 1x128 quantizer (kernels/grouped/quant.py) by rows a program and
#           warps at prefill sizes of Qwen3, Mixtral and DeepSeek-V3, bits compared, with the copy floor
#   block-tactics  lab/block_tactics.py: Qwen3's routed block with each of gate/up's tactics beside gate/up alone
#           at 1, 4 and 16 tokens; then lab/read_floor.py --one-token
#   eager-gap  lab/moe_eager_gap.py (GAP_ARGS, default --layers 24): the MoE model's eager one-token decode, bf16 vs
#           mxgemm, under inference_mode and no_grad: layer 0's parts back to back, generate's ms and kernels a token,
#           each part's host ms inside generate
#   gemv-default  mxgemm bench --moe at 1 and 4 tokens with the shipped tuning file, with its grouped entries left out
#           (the defaults, the GEMV among them) and with the GEMV default off as well
#   gemv    lab/gemv_decode.py: the grouped GEMV on CUDA cores beside the grouped kernel and the read floor at 1 and 4
#           tokens, plain and block forms (GEMV_ARGS, e.g. --stages 1); then the grouped GPU tests that run it
#   bench-8b / bench-more / bench-all  benchmark sets (llama3-8b / llama3-70b and hidden-7168 / all three in one
#           run, h200.*) with an empty user cache: only the tuning file shipped in the package applies
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
out="${OUT:-$PWD/out}"
mkdir -p "$out"
variant() {  # variant PATCH: the kernels' folder copied to /tmp/variants/NAME with PATCH's hunks of it applied;
  # prints the copy's grouped csrc folder, or says on stderr that PATCH does not apply to this tree and returns 1
  local name v; name=$(basename "$1" .patch); v=/tmp/variants/$name
  rm -rf "$v"; mkdir -p "$v/src/mxgemm"; cp -r src/mxgemm/kernels "$v/src/mxgemm/"
  if ! (cd "$v" && git apply --include='src/mxgemm/kernels/*' "$OLDPWD/$1") >&2; then
    echo "$name: does not apply to this tree, left out" >&2; return 1; fi
  echo "$v/src/mxgemm/kernels/grouped/csrc"
}
patched_specs() {  # patched_specs PREFIX NAME ...: `specs`, the tree's grouped sources as "tree" and, for each
  # lab/patches/NAME.patch that applies, a patched copy named NAME less PREFIX; `patch`, the last NAME's patch
  local prefix=$1 name dir; shift
  specs="tree=src/mxgemm/kernels/grouped/csrc"; patch=""
  for name in "$@"; do
    patch=lab/patches/$name.patch; dir=$(variant "$patch") || continue
    specs="$specs ${name#"$prefix"}=$dir"
  done
}
patched_tests() {  # patched_tests PATCH LIMIT FILE [PYTEST ARGS]: TESTS (default tests/gpu/test_gpu_grouped.py) with
  # PATCH applied to this copy of the tree (undone after), its last lines into $out/FILE
  local patch=$1 limit=$2 file=$3; shift 3
  [ -n "$patch" ] && git apply "$patch" || return 0
  timeout "$limit" python3 -m pytest ${TESTS:-tests/gpu/test_gpu_grouped.py} -q -p no:warnings -x "$@" > "$out/$file" 2>&1
  tail -3 "$out/$file"; git apply -R "$patch"
}
bench() {  # bench NAME TIMEOUT SET [SET ...]: NAME.{json,md,png} under $out
  local name="$1" limit="$2"; shift 2
  ( cd "$out" && MXGEMM_CACHE_DIR="$out/empty-cache" timeout "$limit" python3 -m mxgemm bench --model "$@" \
      --json "$name.json" --markdown "$name.md" --plot "$name.png" > "/tmp/bench-$name.log" 2>&1
    tail -3 "/tmp/bench-$name.log" )
}
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case "$stage" in
    tune)
      ( time MXGEMM_CACHE_DIR="$out/cache" timeout "${TUNE_S:-400}" python3 -m mxgemm tune \
          --model llama3-8b llama3-70b hidden-7168 llama3-8b-hf ) > "$out/tune.txt" 2>&1
      grep -A3 "^real" "$out/tune.txt" ;;
    gate)  # the GPU tests of what changed; stop here if any fails
      timeout 240 python3 -m pytest tests -q -p no:warnings -m gpu --tb=short -x \
        -k "small_m or hybrid or graphs or autotune or block128 or fp8" > /tmp/gate.log 2>&1
      rc=$?; tail -15 /tmp/gate.log > "$out/pytest_gate.txt"; cat "$out/pytest_gate.txt"
      [ "$rc" -eq 0 ] || { echo "gate failed (rc $rc)"; exit 1; } ;;
    ship)  # the tuning file just made replaces the package's copy here, for the benchmarks that follow
      mkdir -p src/mxgemm/tuned
      for f in "$out"/cache/tuning-*.json "$out"/tuning-*.json; do
        [ -e "$f" ] || continue; b=$(basename "$f"); cp "$f" "src/mxgemm/tuned/${b%-*}.json"; echo "shipped $b"
      done ;;
    tests)
      python3 -m mxgemm info > "$out/info.txt" 2>&1
      # to a file, not through tail: a run stopped by its timeout keeps what it wrote (the suite took 375 s on an H100)
      timeout "${TESTS_S:-480}" python3 -m pytest tests -q -p no:warnings -m gpu --tb=short --durations=5 \
        > "$out/pytest_gpu.txt" 2>&1
      timeout 60 python3 -m pytest tests/unit/test_mx_quant_kernel.py -q -p no:warnings 2>&1 | tail -3 >> "$out/pytest_gpu.txt"
      tail -12 "$out/pytest_gpu.txt" ;;
    load)
      timeout 500 python3 bench/load_gpu.py --json "$out/load-gpu-h200.json" 2>&1 | tail -14 ;;
    e2e)  # E2E_MODES: eager (default), graphs, or "eager graphs" (about 8 min at model_e2e's defaults: 9 eager
          # rounds, 5 with graphs);
          # E2E_ARGS: more arguments of model_e2e.py (e.g. --no-fuse, --batches 1)
      modes="${E2E_MODES:-eager}"; name="e2e-${modes// /-}"
      timeout 570 python3 bench/model_e2e.py --modes $modes ${E2E_ARGS:-} --json "$out/$name.json" \
        --markdown "$out/$name.md" > /tmp/e2e.log 2>&1
      tail -12 /tmp/e2e.log ;;
    fp8-ncu)  # Nsight Compute on the swap-AB FP8 kernel (NCU_N/NCU_K/NCU_M pick the shape; default 8B o at M = 32)
      timeout 150 ncu --section SpeedOfLight --section WarpStateStats --section SourceCounters --section Occupancy \
        -k regex:fp8_gemm -s 2 -c 1 -o "$out/fp8" -f python3 lab/profile_kernel.py --kernel swap-ab \
        --n "${NCU_N:-4096}" --k "${NCU_K:-4096}" --m "${NCU_M:-32}" > "$out/ncu.log" 2>&1
      ncu --import "$out/fp8.ncu-rep" --section SpeedOfLight --section WarpStateStats --section Occupancy \
        > "$out/ncu-fp8.txt" 2>&1
      ncu --import "$out/fp8.ncu-rep" --page source --csv --print-source sass > "$out/ncu-sass.csv" 2>&1
      grep -E "Duration|DRAM Throughput|Compute \(SM\)|Warp Cycles Per Issued|Achieved Occupancy" "$out/ncu-fp8.txt"
      python3 lab/top_stalls.py "$out/ncu-sass.csv" 30
      rm -f "$out/fp8.ncu-rep" ;;
    small-m-ncu)
      timeout 150 ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section Occupancy -k regex:small_m -s 2 -c 1 -o "$out/small-m" -f python3 lab/profile_kernel.py \
        --kernel small-m --n "${SM_N:-28672}" --k "${SM_K:-4096}" --m "${SM_M:-1}" > "$out/ncu-small-m.log" 2>&1
      ncu --import "$out/small-m.ncu-rep" --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section Occupancy > "$out/ncu-small-m.txt" 2>&1
      grep -E "Duration|DRAM Throughput|Memory Throughput|L2 Hit|Warp Cycles Per Issued|Achieved Occupancy" \
        "$out/ncu-small-m.txt"
      rm -f "$out/small-m.ncu-rep" ;;
    quant)
      timeout 240 python3 lab/quantizers.py --json "$out/quantizers-h200.json" 2>&1 | tail -32 ;;
    ulp)
      timeout 120 python3 lab/ulp_margins.py --json "$out/ulp-margins-h200.json" 2>&1 | tail -6 ;;
    op)
      timeout 120 python3 lab/op_overhead.py --json "$out/op-overhead-h200.json" 2>&1 | tail -9 ;;
    profile)
      timeout 400 python3 lab/e2e_profile.py ${PROFILE_ARGS:---layers 4 --graphs} > "$out/e2e-profile.txt" 2>&1
      grep -E "^(bf16|mxgemm) M=|^==" "$out/e2e-profile.txt" ;;
    anatomy)
      timeout 500 python3 lab/decode_anatomy.py ${ANATOMY_ARGS:---layers 32 --batch 1} \
        --json "$out/decode-anatomy.json" > "$out/decode-anatomy.txt" 2>&1
      tail -5 "$out/decode-anatomy.txt" ;;
    prefill)
      timeout 300 python3 lab/prefill_anatomy.py ${PREFILL_ARGS:---max-rows 1024} \
        --json "$out/prefill-anatomy.json" > "$out/prefill-anatomy.txt" 2>&1
      tail -6 "$out/prefill-anatomy.txt" ;;
    new-lengths)
      timeout 400 python3 lab/new_lengths.py --json "$out/new-lengths-h200.json" > "$out/new-lengths.txt" 2>&1
      tail -6 "$out/new-lengths.txt" ;;
    prefill-host)
      timeout 300 python3 lab/prefill_host.py --json "$out/prefill-host-h200.json" > "$out/prefill-host.txt" 2>&1
      tail -12 "$out/prefill-host.txt" ;;
    lt-algos)
      timeout 400 python3 lab/lt_algos.py --json "$out/lt-algos-h200.json" > /tmp/lt.log 2>&1
      tail -20 /tmp/lt.log ;;
    large-m)
      timeout 400 python3 lab/large_m_fp8.py --json "$out/large-m-fp8-h200.json" > /tmp/large-m.log 2>&1
      tail -20 /tmp/large-m.log ;;
    tokm-lab)
      timeout 400 python3 lab/tokm_lab.py --json "$out/tokm-lab-h200.json" > /tmp/tokm-lab.log 2>&1
      tail -8 /tmp/tokm-lab.log ;;
    large-m-ncu)
      for k in tokm cublas; do
        re=$([ $k = tokm ] && echo fp8_gemm_tokm || echo nvjet)
        timeout 240 ncu --set full -k regex:$re -s 2 -c 1 -o "$out/$k" -f python3 lab/profile_kernel.py \
          --kernel $k --n 4096 --k 4096 --m 2048 > "$out/ncu-$k.log" 2>&1
        ncu --import "$out/$k.ncu-rep" --page details > "$out/ncu-$k-o-m2048-h200.txt" 2>&1
        grep -E "Duration|SM Frequency|Compute \(SM\) Throughput|Issue Slots Busy|Registers Per|Grid Size" \
          "$out/ncu-$k-o-m2048-h200.txt"
      done
      ncu --import "$out/tokm.ncu-rep" --page source --csv --print-source sass > "$out/tokm-sass.csv" 2>&1
      python3 lab/top_stalls.py "$out/tokm-sass.csv" 30
      rm -f "$out"/*.ncu-rep ;;
    ttft)
      timeout 400 python3 lab/ttft_probe.py ${TTFT_ARGS:---modes eager --batches 1 --repeats 9} \
        > "$out/ttft-probe.txt" 2>&1
      grep -E "^model" "$out/ttft-probe.txt" | tail -40 ;;
    mechanisms)
      timeout 400 python3 lab/eager_mechanisms.py --device cuda > "$out/eager-mechanisms.txt" 2>&1
      tail -8 "$out/eager-mechanisms.txt" ;;
    split)
      timeout 300 python3 lab/eager_split.py --json "$out/eager-split-h200.json" > "$out/split.log" 2>&1
      tail -18 "$out/split.log" ;;
    launch)
      timeout 120 python3 lab/launch_cost.py --json "$out/launch-cost-h200.json" 2>&1 | tail -10 ;;
    eager)
      timeout "${EAGER_S:-300}" python3 bench/eager_calls.py --json "$out/eager-h200.json" \
        --markdown "$out/eager-h200.md" > /tmp/eager.log 2>&1
      tail -40 /tmp/eager.log ;;
    crossover)  # the exact regime against cuBLASLt and the FP8 kernel, M = 1-128, the three sets
      ( OUT="$out" timeout 400 python3 bench/crossover.py ) > "$out/crossover.log" 2>&1
      tail -16 "$out/crossover.log" ;;
    bench-8b) bench h200-llama3-8b 300 llama3-8b ;;
    bench-hf) bench h200-llama3-8b-hf 300 llama3-8b-hf ;;
    bench-more) bench h200-llama3-70b 280 llama3-70b; bench h200-hidden-7168 280 hidden-7168 ;;
    bench-all) bench h200 560 llama3-8b llama3-70b hidden-7168 ;;
    moe-gate)  # the GPU tests of the grouped kernels, the routed block and MXFP8Experts' eager graphs; whether the
      # shipped tuning file is used (its record this Python's kernels' digest)
      python3 -m mxgemm info 2>&1 | grep -i "tuning" | cut -c1-200
      timeout "${MOE_GATE_S:-300}" python3 -m pytest tests -q -p no:warnings -m gpu --tb=short -k "grouped or moe or wgmma or routing" \
        > "$out/moe-gate.txt" 2>&1; tail -3 "$out/moe-gate.txt" ;;
    moe-bench)  # mxgemm bench --moe; DeepGEMM's columns where the anchors' copy was carried to .anchors/deepgemm
      ( dg="$PWD/.anchors/deepgemm/DeepGEMM"; cd "$out" && PYTHONPATH="$PYTHONPATH:$dg" \
          DG_CACHE_DIR="${DG_CACHE_DIR:-$dg/../../dg_cache}" timeout "${MOE_BENCH_S:-420}" python3 -m mxgemm bench \
          --moe --json "moe-${GPU_TAG:-h200}.json" --markdown "moe-${GPU_TAG:-h200}.md" > moe-bench.log 2>&1
        tail -4 moe-bench.log ) ;;
    eager-gap)
      timeout "${GAP_S:-400}" python3 lab/moe_eager_gap.py ${GAP_ARGS:---layers 24} --json "$out/eager-gap.json" \
        > "$out/eager-gap.txt" 2>&1; tail -22 "$out/eager-gap.txt" ;;
    gemv-default)  # mxgemm bench --moe at 1 and 4 tokens (GEMV_DEFAULT_ARGS), bf16 beside, three ways: the shipped
      # tuning file; no grouped entries in it (the defaults: the GEMV at about one row an active expert); no grouped
      # entries and the GEMV default off (the default before it); a table of the three last
      args="--moe --m 1 4 --baselines bf16 ${GEMV_DEFAULT_ARGS:-}"
      timeout 150 python3 -m mxgemm bench $args --json "$out/gemv-default-tuned.json" \
        > "$out/gemv-default-tuned.txt" 2>&1
      mkdir -p /tmp/tuned-full && cp src/mxgemm/tuned/*.json /tmp/tuned-full/
      python3 - <<'PY'
import glob, json
for f in glob.glob("src/mxgemm/tuned/*.json"):
    d = json.load(open(f))
    d["entries"] = {k: v for k, v in d["entries"].items() if not k.startswith(("grouped|", "experts|"))}
    open(f, "w").write(json.dumps(d, indent=1, sort_keys=True) + "\n")
PY
      timeout 150 python3 -m mxgemm bench $args --json "$out/gemv-default-gemv.json" > "$out/gemv-default-gemv.txt" 2>&1
      timeout 150 python3 - $args --json "$out/gemv-default-before.json" > "$out/gemv-default-before.txt" 2>&1 <<'PY'
import sys
from mxgemm import cli
from mxgemm.backends import triton_w8a16
triton_w8a16._default_gemv = lambda rows, experts, device: None  # the default as before the GEMV took it
sys.exit(cli.main(["bench", *sys.argv[1:]]))
PY
      cp /tmp/tuned-full/*.json src/mxgemm/tuned/
      python3 - "$out" <<'PY' | tee "$out/gemv-default.md"
import json, sys
runs = {w: json.load(open(f"{sys.argv[1]}/gemv-default-{w}.json"))["rows"] for w in ("tuned", "gemv", "before")}
t = {w: {(r["model"], r["proj"], r["tokens"]): r["us"]["mxgemm"] for r in rows} for w, rows in runs.items()}
print("| model | proj | tokens | tuned µs | GEMV default µs | default before µs | before / GEMV default |")
print("|---|---|---|---|---|---|---|")
for (model, proj, tokens), us in t["tuned"].items():
    gemv, before = t["gemv"][model, proj, tokens], t["before"][model, proj, tokens]
    print(f"| {model} | {proj} | {tokens} | {us:.1f} | {gemv:.1f} | {before:.1f} | {before / gemv:.2f} |")
PY
      ;;
    gemv)  # lab/gemv_decode.py: the GEMV beside the grouped kernel and the read floor; then the grouped GPU tests
      ( cd lab && timeout "${GEMV_S:-400}" python3 gemv_decode.py ${GEMV_ARGS:-} --json "$out/gemv-decode.json" ) \
        > "$out/gemv-decode.txt" 2>&1; tail -16 "$out/gemv-decode.txt"
      timeout "${GEMV_TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -x tests/gpu/test_gpu_grouped.py \
        tests/gpu/test_gpu_autotune.py -k "every_config or blocks_gate_up or fused_block" > "$out/gemv-tests.txt" 2>&1
      tail -4 "$out/gemv-tests.txt" ;;
    rows-quant)  # lab/rows_quant.py: the routed rows' 1x128 quantizer by rows a program and warps, at prefill sizes
      timeout 240 python3 lab/rows_quant.py --json "$out/rows-quant.json" > "$out/rows-quant.txt" 2>&1
      tail -32 "$out/rows-quant.txt" ;;
    block-tactics)
      timeout 240 python3 lab/block_tactics.py --json "$out/block-tactics.json" > "$out/block-tactics.txt" 2>&1
      tail -40 "$out/block-tactics.txt"
      timeout 200 python3 lab/read_floor.py --one-token --json "$out/read-floor-one-token.json" \
        > "$out/read-floor-one-token.txt" 2>&1; tail -6 "$out/read-floor-one-token.txt" ;;
    moe-tune)  # mxgemm tune --moe (MOE_TUNE_ARGS, e.g. --m 1 4 16), its entries merged into the package's tuning file
      # of this GPU where its environment record is this one's (else written as that file)
      ( time MXGEMM_CACHE_DIR="$out/cache" timeout "${MOE_TUNE_S:-420}" python3 -m mxgemm tune --moe ${MOE_TUNE_ARGS:-} ) \
        > "$out/tune-moe.txt" 2>&1
      python3 - "$out"/cache/tuning-*.json <<'PY'
import json, re, sys
from pathlib import Path
made = Path(sys.argv[1])
shipped = Path("src/mxgemm/tuned") / (re.sub(r"-[0-9a-f]{12}\.json$", ".json", made.name))
new = json.loads(made.read_text())
old = json.loads(shipped.read_text()) if shipped.exists() else {"metadata": new["metadata"], "entries": {}}
if old["metadata"] != new["metadata"]:
    sys.exit(f"{shipped} was made for {old['metadata']}, not {new['metadata']}: not merged")
old["entries"].update(new["entries"])
shipped.write_text(json.dumps(old, indent=1, sort_keys=True) + "\n")
print(f"{shipped}: {len(new['entries'])} grouped entries merged, {len(old['entries'])} in all")
PY
      cp src/mxgemm/tuned/tuning-*.json "$out/"; mkdir -p /tmp/tuned-merged; cp src/mxgemm/tuned/tuning-*.json /tmp/tuned-merged/
      tail -3 "$out/tune-moe.txt" ;;
    reship)  # a later call on the same warm machine: the tuning file that moe-tune merged replaces this copy's
      for f in /tmp/tuned-merged/tuning-*.json; do [ -e "$f" ] && cp "$f" src/mxgemm/tuned/ && echo "reshipped $f"; done ;;
    moe-e2e)  # the Qwen3-30B-A3B-shaped model through generate: 48 layers where 2 x 61 GB fit, else 24;
      # MOE_E2E_MODES (default "eager graphs"): one mode a call where both do not fit one call's time (the JSON is
      # written after each row, the file named by the mode); MOE_E2E_BATCHES (default "1 16") likewise
      layers=$(python3 -c "import torch; print(48 if torch.cuda.get_device_properties(0).total_memory > 120e9 else 24)")
      modes="${MOE_E2E_MODES:-eager graphs}"; name="e2e-moe-${GPU_TAG:-h200}${MOE_E2E_MODES:+-${modes// /-}}${MOE_E2E_BATCHES:+-b${MOE_E2E_BATCHES// /-}}"
      timeout "${MOE_E2E_S:-560}" python3 bench/model_e2e.py --moe --layers "$layers" --modes $modes --batches ${MOE_E2E_BATCHES:-1 16} \
        --new 64 --repeats 2 --eager-repeats 3 --json "$out/$name.json" --markdown "$out/$name.md" \
        > "$out/$name.log" 2>&1; tail -12 "$out/$name.log" ;;
    moe-apart)  # the MoE e2e's prefill and eager batch 16 taken apart, no tuning file in any: this tree under
      # inference_mode and under no_grad, and f0b8c98's tree (the run before the q/k/v and eager-graph changes)
      args="--moe --layers ${MOE_APART_LAYERS:-24} --modes eager --batches 16 --new 8 --repeats 1 --eager-repeats 3"
      git worktree add -f /tmp/f0b8c98 f0b8c98 > /dev/null 2>&1; rm -f /tmp/f0b8c98/src/mxgemm/tuned/*.json
      mkdir -p /tmp/tuned-off && mv src/mxgemm/tuned/*.json /tmp/tuned-off/
      for run in tree:inference tree:no_grad f0b8c98:inference; do
        tree=${run%:*} grad=${run#*:} root=$PWD; [ "$tree" = tree ] || root=/tmp/$tree
        extra=""; [ "$tree" = tree ] && extra="--grad-mode $grad"
        PYTHONPATH="$root/src" timeout 170 python3 "$root/bench/model_e2e.py" $args $extra \
          --json "$out/moe-apart-$tree-$grad.json" > "$out/moe-apart-$tree-$grad.log" 2>&1
        echo "== $run"; grep -E "^\| eager|prefill over" "$out/moe-apart-$tree-$grad.log" | cut -c1-300
      done
      mv /tmp/tuned-off/*.json src/mxgemm/tuned/ ;;
    moe-kernels)  # the MoE prefill taken apart (lab/moe_prefill_kernels.py), runs of TREE:FILES:WHO (MOE_KERNEL_RUNS):
      # this tree or f0b8c98's, its shipped tuning file or none, bf16 or mxgemm; MOE_KERNEL_ARGS="--generate 32" adds
      # an eager decode token's host time by part
      git worktree add -f /tmp/f0b8c98 f0b8c98 > /dev/null 2>&1
      for run in ${MOE_KERNEL_RUNS:-tree:tuned:mxgemm f0b8c98:tuned:mxgemm tree:none:mxgemm f0b8c98:none:mxgemm}; do
        IFS=: read -r tree files who <<< "$run"; root=$PWD; [ "$tree" = tree ] || root=/tmp/$tree
        [ "$files" = none ] && mkdir -p "/tmp/off-$tree" && mv "$root"/src/mxgemm/tuned/*.json "/tmp/off-$tree/"
        name="moe-kernels-$tree-$files-$who"
        PYTHONPATH="$root/src" timeout 150 python3 lab/moe_prefill_kernels.py --layers ${MOE_APART_LAYERS:-24} \
          --who "$who" ${MOE_KERNEL_ARGS:-} --json "$out/$name.json" > "$out/$name.txt" 2>&1
        [ "$files" = none ] && mv "/tmp/off-$tree"/*.json "$root/src/mxgemm/tuned/"
        echo "== $run"; grep -A10 "wall" "$out/$name.txt" | cut -c1-300; grep "a decode token" "$out/$name.txt"
      done ;;
    moe-host)  # the routed block's host time by step (lab/moe_experts_host.py) and the 24-layer MoE prefill taken
      # apart (lab/moe_prefill_kernels.py), bf16 and mxgemm
      timeout 90 python3 lab/moe_experts_host.py --tokens 2048 256 > "$out/moe-host.txt" 2>&1; tail -18 "$out/moe-host.txt"
      for who in mxgemm bf16; do
        timeout 120 python3 lab/moe_prefill_kernels.py --layers ${MOE_APART_LAYERS:-24} --top 10 --who $who \
          --json "$out/moe-host-prefill-$who.json" > "$out/moe-host-prefill-$who.txt" 2>&1
        grep -A2 "wall" "$out/moe-host-prefill-$who.txt" | cut -c1-300
      done ;;
    moe-graphs)  # eager decode with MXFP8Experts' graphs against without (MXGEMM_EAGER_GRAPHS), 4 layers
      for g in 0 1; do MXGEMM_EAGER_GRAPHS=$g timeout 200 python3 lab/moe_layer_host.py --layers 4 \
        --tokens 1 > "$out/moe-layer-host-graphs$g.txt" 2>&1; tail -8 "$out/moe-layer-host-graphs$g.txt"; done ;;
    grad-modes)
      timeout 400 python3 lab/grad_modes.py ${GRAD_ARGS:---layers 16} --json "$out/grad-modes.json" \
        > "$out/grad-modes.txt" 2>&1; tail -5 "$out/grad-modes.txt" ;;
    grouped-variants)
      csrc=src/mxgemm/kernels/grouped/csrc; specs="tree=$csrc"; vdir=/tmp/grouped-variants
      mkdir -p "$vdir/pre" && for f in grouped_fp8.cu sm90.cuh; do git show "f0b8c98~1:$csrc/$f" > "$vdir/pre/$f"; done \
        && specs="$specs pre=$vdir/pre"
      for p in ${VARIANT_PATCHES:-lab/patches/grouped-*.patch}; do
        grep -q ABLATION "$p" && continue  # timing-only ablations run in grouped-large
        dir=$(variant "$p") || continue
        cmp -s "$dir/grouped_fp8.cu" "$csrc/grouped_fp8.cu" || specs="$specs $(basename "$p" .patch)=$dir"
      done
      timeout 240 python3 lab/grouped_variants.py $specs --json "$out/grouped-variants.json" \
        > "$out/grouped-variants.txt" 2>&1; tail -22 "$out/grouped-variants.txt" ;;
    grouped-ncu)  # Nsight Compute on the grouped wgmma kernel and DeepGEMM's contiguous kernel (where .anchors/deepgemm
      # was carried), one problem of `mxgemm bench --moe` each (NCU_PROBLEMS: model:proj:tokens ...); the details of all
      # in grouped-ncu.txt, the wgmma kernel's top stall sites in grouped-ncu-stalls.txt
      dg="$PWD/.anchors/deepgemm/DeepGEMM"; export DG_CACHE_DIR="${DG_CACHE_DIR:-$dg/../../dg_cache}"
      sections="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis"
      sections="$sections --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats"
      for p in ${NCU_PROBLEMS:-qwen3-30b-a3b:gate_up:4096 mixtral-8x7b:gate_up:4096}; do
        IFS=: read -r model proj tokens <<< "$p"
        for who in mxgemm deepgemm; do
          if [ $who = mxgemm ]; then re=grouped_kernel; flag=""; src="--section SourceCounters"
          else re=fp8_gemm; flag=--deepgemm; src=""; [ -d "$dg" ] || continue; fi
          rep="$out/ncu-$who-$model-$proj-$tokens"
          [ $who = deepgemm ] && PYTHONPATH="$PYTHONPATH:$dg" timeout 240 python3 lab/grouped_ncu.py --deepgemm \
            --model "$model" --proj "$proj" --tokens "$tokens" > /dev/null 2>&1  # DeepGEMM's JIT builds outside ncu
          PYTHONPATH="$PYTHONPATH:$dg" timeout 240 ncu $sections $src -k regex:$re -s 2 -c 1 -o "$rep" -f python3 \
            lab/grouped_ncu.py $flag --model "$model" --proj "$proj" --tokens "$tokens" > "$rep.log" 2>&1
          { echo "=== $who $model $proj $tokens"; grep -E "tokens:" "$rep.log"; ncu --import "$rep.ncu-rep" --page details --print-details all; } \
            >> "$out/grouped-ncu.txt" 2>&1
          if [ $who = mxgemm ]; then
            ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > /tmp/sass.csv 2>&1
            { echo "=== $model $proj $tokens"; python3 lab/top_stalls.py /tmp/sass.csv 25; } >> "$out/grouped-ncu-stalls.txt" 2>&1
          fi
          rm -f "$rep.ncu-rep" "$rep.log"
        done
      done
      grep -E "^===|Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|L2 Hit|Shared Memory|Registers Per|Grid Size|Block Size|Warp Cycles Per Issued|Issue Slots Busy|Achieved Occupancy" \
        "$out/grouped-ncu.txt" | cut -c1-140 ;;
    dense-variants)  # lab/dense_variants.py: the dense FP8 kernel's tokens-as-M configs from the tree's sources beside
      # each of DENSE_PATCHES' (names of lab/patches; tokm-overlap: two block accumulators, the next block's wgmma
      # issued before the last is promoted) at M = 64-512 (DENSE_ARGS); then the last patch applied to this copy of
      # the tree and the FP8 kernel's GPU tests
      patched_specs dense- ${DENSE_PATCHES:?DENSE_PATCHES names the lab/patches to time}
      ( cd lab && timeout "${DENSE_S:-300}" python3 dense_variants.py $(for s in $specs; do d=${s#*=}; \
          case $d in /*) ;; *) d=../$d ;; esac; echo "${s%%=*}=${d%/grouped/csrc}/csrc"; done) ${DENSE_ARGS:-} \
          --json "$out/dense-variants.json" ) > "$out/dense-variants.txt" 2>&1; tail -24 "$out/dense-variants.txt"
      TESTS=tests/gpu/test_gpu_fp8_gemm.py patched_tests "$patch" "${DENSE_TESTS_S:-240}" dense-tests.txt ;;
    block-variants)  # lab/block_variants.py: the routed block's one C call from the tree's grouped sources beside each
      # of BLOCK_PATCHES' (names of lab/patches, none by default) with BLOCK_ARGS (e.g. --tokens 16 4096); then the last
      # patch applied to this copy of the tree and the routed block's GPU tests (BLOCK_TESTS: pytest's -k)
      patched_specs block- ${BLOCK_PATCHES:?BLOCK_PATCHES names the lab/patches to time}
      timeout "${BLOCK_S:-300}" python3 lab/block_variants.py $specs ${BLOCK_ARGS:-} --json "$out/block-variants.json" \
        > "$out/block-variants.txt" 2>&1; tail -20 "$out/block-variants.txt"
      patched_tests "$patch" "${BLOCK_TESTS_S:-240}" block-tests.txt -k "${BLOCK_TESTS:-block or c_launch or moe}" ;;
    grouped-large)  # the wgmma kernel's tree beside each of LARGE_PATCHES (grouped-mc, CTA pairs that multicast the
      # 128-row token tile; grouped-wide, 128 x 160 tiles with a producer warpgroup; grouped-regs, that warpgroup's
      # registers given to 128 x 128 tiles' consumers; grouped-vstore, the output in 16-byte stores after an exchange
      # in each quad of lanes; grouped-xscale, the rows' scales bulk-copied into each stage by the producer;
      # grouped-overlap-plain, the 128-row tiles' overlapped loop without its predicated release and lane-0 reads;
      # LARGE_ARGS="--no-wide --persistent" times both grids; the
      # ablations grouped-noscale, grouped-nopromote, grouped-nostore time the kernel without a part; default:
      # grouped-regs, grouped-vstore, grouped-xscale and grouped-regs-xscale) at the LARGE prefill
      # sizes (lab/grouped_variants.py --large LARGE_ARGS); then the last patch applied to this copy of the tree and
      # the grouped GPU tests of LARGE_TESTS (default: all; none: no tests) run on it
      patched_specs grouped- ${LARGE_PATCHES:-grouped-regs grouped-vstore grouped-xscale grouped-regs-xscale}
      timeout 300 python3 lab/grouped_variants.py $specs --large ${LARGE_ARGS:-} --json "$out/grouped-large.json" \
        > "$out/grouped-large.txt" 2>&1; tail -30 "$out/grouped-large.txt"
      [ "${LARGE_TESTS:-}" = none ] && continue  # the ablations' patches (timing only) fail the tests by design
      patched_tests "$patch" 330 grouped-large-tests.txt ${LARGE_TESTS:+-k "$LARGE_TESTS"} ;;
    *) echo "usage: $0 tune|gate|ship|tests|crossover|fp8-ncu|small-m-ncu|prefill|quant|ulp|eager|e2e|load|lt-algos|bench-8b|bench-more|bench-all ..." >&2
       exit 2 ;;
  esac
done
# at most 8 files come back: the tuning file moves up, the cache folders (lock files) go
mv "$out"/cache/tuning-*.json "$out/" 2>/dev/null; rm -rf "$out/cache" "$out/empty-cache"; ls "$out"
