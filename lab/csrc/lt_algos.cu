// The algorithms cuBLASLt's heuristic offers for one planned blockwise GEMM (the product's plan, blockwise.cu,
// included), so that lab/lt_algos.py can time each: the plan's own choice is the heuristic's first.
// The build cache keys this file alone: after blockwise.cu changes, clear $MXGEMM_CACHE_DIR/kernels.
#include "blockwise.cu"

extern "C" int lt_result_bytes() { return (int)sizeof(cublasLtMatmulHeuristicResult_t); }

// Up to `want` heuristic results for the plan's problem (at most `max_workspace` bytes of workspace) into
// `results`, their number into *found; 0 or 1000 + the cuBLAS status
extern "C" int lt_algos(BlockwisePlan* p, long long max_workspace, int want, void* results, int* found) {
  const Lt* f = lt();
  cublasLtMatmulPreference_t pref = nullptr;
  cublasStatus_t st = f->pref_create(&pref);
  const size_t ws = (size_t)max_workspace;
  if (st == CUBLAS_STATUS_SUCCESS) st = f->pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = f->heuristic(p->handle, p->desc, p->a, p->b, p->d, p->d, pref, want,
                      static_cast<cublasLtMatmulHeuristicResult_t*>(results), found);
  if (pref) f->pref_destroy(pref);
  return st == CUBLAS_STATUS_SUCCESS ? 0 : kCublas + (int)st;
}

// The plan runs result i from now on; returns the bytes a call's buffer must hold for it
extern "C" long long lt_use(BlockwisePlan* p, const void* results, int i) {
  const auto* r = static_cast<const cublasLtMatmulHeuristicResult_t*>(results) + i;
  p->algo = r->algo;
  p->lt_bytes = (long long)r->workspaceSize;
  return p->lt_offset + p->lt_bytes;
}
