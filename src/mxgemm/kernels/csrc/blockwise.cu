// cuBLASLt's blockwise FP8 GEMM (1x128 activation scales, 128x128 weight scales; Hopper) with everything fixed for
// one weight and M worked out once: the matmul descriptor, the matrix layouts and the algorithm cuBLASLt's heuristic
// picks. A call then quantizes the activations (the 1x128 quantizer of fp8_gemm.cu, through the pointer the plan
// holds) and runs cublasLtMatmul: no descriptor, layout or heuristic work per call, one ctypes call in all.
//
// cuBLASLt is the one the process has loaded (torch's): its functions are looked up with dlsym, so nothing links
// against it here; cublasLt.h gives the types and attribute values.
//
// In column-major cuBLASLt terms the GEMM is D [Np, Mp] = W^T(A: e4m3 [Kp, Np], transposed) x XQ (B: e4m3 [Kp, Mp]),
// which in row-major terms is Y [Mp, Np] = XQ [Mp, Kp] x W [Np, Kp]^T, the operands torch._scaled_mm hands cuBLASLt
// for the same call. A's scales: fp32 [Np/128, Kp/128] row-major (BLK128x128_32F); B's: fp32 [Kp/128, Mp]
// (VEC128_32F), as the quantizer writes them.

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstdint>
#include <mutex>
#include <type_traits>

namespace {

struct Lt {
  decltype(&cublasLtCreate) create;
  decltype(&cublasLtMatmulDescCreate) desc_create;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set;
  decltype(&cublasLtMatrixLayoutCreate) layout_create;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic;
  decltype(&cublasLtMatmul) matmul;
};

// error codes of this file (cuBLAS statuses are returned as 1000 + status)
constexpr int kNoCublasLt = -2;  // no libcublasLt loaded in the process, or a function missing from it
constexpr int kNoAlgorithm = -3;  // the heuristic offers no algorithm for this problem
constexpr int kCublas = 1000;

const Lt* lt() {
  static Lt table{};
  static bool ok = [] {
    void* lib = nullptr;
    for (const char* name : {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"}) {
      lib = dlopen(name, RTLD_NOW | RTLD_NOLOAD);
      if (!lib) lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (lib) break;
    }
    if (!lib) return false;
    bool found = true;
    auto get = [&](auto& fn, const char* symbol) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, symbol));
      found = found && fn != nullptr;
    };
    get(table.create, "cublasLtCreate");
    get(table.desc_create, "cublasLtMatmulDescCreate");
    get(table.desc_destroy, "cublasLtMatmulDescDestroy");
    get(table.desc_set, "cublasLtMatmulDescSetAttribute");
    get(table.layout_create, "cublasLtMatrixLayoutCreate");
    get(table.layout_destroy, "cublasLtMatrixLayoutDestroy");
    get(table.pref_create, "cublasLtMatmulPreferenceCreate");
    get(table.pref_destroy, "cublasLtMatmulPreferenceDestroy");
    get(table.pref_set, "cublasLtMatmulPreferenceSetAttribute");
    get(table.heuristic, "cublasLtMatmulAlgoGetHeuristic");
    get(table.matmul, "cublasLtMatmul");
    return found;
  }();
  return ok ? &table : nullptr;
}

// one handle per device, made on first use (cuBLASLt handles hold no stream and may be shared by threads)
int handle_for(int device, cublasLtHandle_t* handle) {
  static std::mutex mutex;
  static cublasLtHandle_t handles[64] = {};
  if (device < 0 || device >= 64) return (int)cudaErrorInvalidDevice;
  std::lock_guard<std::mutex> lock(mutex);
  if (!handles[device]) {
    const cublasStatus_t st = lt()->create(&handles[device]);
    if (st != CUBLAS_STATUS_SUCCESS) return kCublas + (int)st;
  }
  *handle = handles[device];
  return 0;
}

using Quantizer = int (*)(const void* X, int ldx, int x_fp16, int M, int K, void* XQ, void* XS, int Mp, int Kp,
                          void* stream);

}  // namespace

// A call's fixed part. The output buffer of a call holds Y [Mp, Np] bf16, then (256-byte aligned) the quantized
// activations (Mp * Kp bytes at ws_offset), their scales (q_bytes after them) and cuBLASLt's workspace
// (lt_offset, lt_bytes).
struct BlockwisePlan {
  Quantizer quantize;
  cublasLtHandle_t handle;
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t a, b, d;
  cublasLtMatmulAlgo_t algo;
  const void* W;
  int K, M, Mp, Np, Kp, x_fp16;
  long long ws_offset, q_bytes, lt_offset, lt_bytes;
  std::mutex mutex;  // the descriptor's B scale pointer is set per call
};

extern "C" void mxgemm_blockwise_plan_destroy(BlockwisePlan* p) {
  if (!p) return;
  const Lt* f = lt();
  if (f) {
    if (p->desc) f->desc_destroy(p->desc);
    for (cublasLtMatrixLayout_t layout : {p->a, p->b, p->d})
      if (layout) f->layout_destroy(layout);
  }
  delete p;
}

// Builds the plan for M rows of a padded weight W e4m3 [Np, Kp] with block scales S fp32 [Np/128, Kp/128] (row
// stride Kp/128), on the current device, with at most `max_workspace` bytes of cuBLASLt workspace. `ws_offset` and
// `q_bytes` place the quantizer's output as for the FP8 kernel's plan. Returns 0 and the plan, with the workspace the
// chosen algorithm needs in (*out)->lt_bytes and where it lies in the output buffer in (*out)->lt_offset, or an error.
extern "C" int mxgemm_blockwise_plan_create(void* quantize, const void* W, const void* S, int K, int M, int Mp, int Np,
                                            int Kp, int x_fp16, long long ws_offset, long long q_bytes,
                                            long long max_workspace, BlockwisePlan** out) {
  *out = nullptr;
  const Lt* f = lt();
  if (!f) return kNoCublasLt;
  int device = 0;
  const cudaError_t cerr = cudaGetDevice(&device);
  if (cerr != cudaSuccess) return (int)cerr;
  BlockwisePlan* p = new BlockwisePlan{};
  p->quantize = reinterpret_cast<Quantizer>(quantize);
  p->W = W;
  p->K = K, p->M = M, p->Mp = Mp, p->Np = Np, p->Kp = Kp, p->x_fp16 = x_fp16;
  p->ws_offset = ws_offset, p->q_bytes = q_bytes;
  int err = handle_for(device, &p->handle);
  auto check = [&](cublasStatus_t st) {
    if (!err && st != CUBLAS_STATUS_SUCCESS) err = kCublas + (int)st;
  };
  cublasLtMatmulPreference_t pref = nullptr;
  if (!err) {
    const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
    const cublasLtMatmulMatrixScale_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                                      b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    check(f->desc_create(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    if (!err) check(f->desc_set(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof(transa)));
    if (!err) check(f->desc_set(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof(transb)));
    if (!err) check(f->desc_set(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof(a_mode)));
    if (!err) check(f->desc_set(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof(b_mode)));
    if (!err) check(f->desc_set(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &S, sizeof(S)));
    // the heuristic sees a B scale pointer of the alignment every call's has (the quantizer's scales lie 256-byte
    // aligned in the output buffer)
    const void* b_scale = reinterpret_cast<const void*>(static_cast<uintptr_t>(256));
    if (!err) check(f->desc_set(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof(b_scale)));
    if (!err) check(f->layout_create(&p->a, CUDA_R_8F_E4M3, Kp, Np, Kp));
    if (!err) check(f->layout_create(&p->b, CUDA_R_8F_E4M3, Kp, Mp, Kp));
    if (!err) check(f->layout_create(&p->d, CUDA_R_16BF, Np, Mp, Np));
    if (!err) check(f->pref_create(&pref));
    const size_t workspace = (size_t)max_workspace;
    if (!err) check(f->pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace)));
  }
  if (!err) {
    cublasLtMatmulHeuristicResult_t result = {};
    int found = 0;
    check(f->heuristic(p->handle, p->desc, p->a, p->b, p->d, p->d, pref, 1, &result, &found));
    if (!err && found == 0) err = kNoAlgorithm;
    if (!err) {
      p->algo = result.algo;
      p->lt_bytes = (long long)result.workspaceSize;
      const long long scales_end = ws_offset + q_bytes + 4LL * Mp * (Kp / 128);
      p->lt_offset = (scales_end + 255) / 256 * 256;
    }
  }
  if (pref) f->pref_destroy(pref);
  if (err) {
    mxgemm_blockwise_plan_destroy(p);
    return err;
  }
  *out = p;
  return 0;
}

// Where a plan's output buffer ends (bytes): Y, the quantized activations and their scales, cuBLASLt's workspace.
extern "C" long long mxgemm_blockwise_plan_bytes(const BlockwisePlan* p) { return p->lt_offset + p->lt_bytes; }

// Y [Mp, Np] = XQ x W^T with the plan's algorithm on `stream`, for activations quantized already as the plan's
// quantizer writes them (XQ e4m3 [Mp, Kp], XS fp32 [Kp/128, Mp], each 256-byte aligned); `workspace`: the
// mxgemm_blockwise_plan_workspace bytes cuBLASLt's algorithm needs, 256-byte aligned (null when none).
extern "C" int mxgemm_blockwise_gemm(BlockwisePlan* p, const void* XQ, const void* XS, void* Y, void* workspace,
                                     void* stream) {
  const Lt* f = lt();
  const float alpha = 1.0f, beta = 0.0f;
  std::lock_guard<std::mutex> lock(p->mutex);
  cublasStatus_t st = f->desc_set(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &XS, sizeof(XS));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = f->matmul(p->handle, p->desc, &alpha, p->W, p->a, XQ, p->b, &beta, Y, p->d, Y, p->d, &p->algo, workspace,
                   (size_t)p->lt_bytes, (cudaStream_t)stream);
  return st == CUBLAS_STATUS_SUCCESS ? 0 : kCublas + (int)st;
}

// The workspace (bytes) the plan's algorithm needs.
extern "C" long long mxgemm_blockwise_plan_workspace(const BlockwisePlan* p) { return p->lt_bytes; }

// One call: quantize X [M, K] (row stride ldx) into the buffer, then Y [Mp, Np] = XQ x W^T with the plan's algorithm
// on `stream`. Y (the buffer's start) must hold mxgemm_blockwise_plan_bytes bytes, 256-byte aligned.
extern "C" int mxgemm_blockwise_run(BlockwisePlan* p, const void* X, int ldx, void* Y, void* stream) {
  uint8_t* xq = static_cast<uint8_t*>(Y) + p->ws_offset;
  void* xs = xq + p->q_bytes;
  const int err = p->quantize(X, ldx, p->x_fp16, p->M, p->K, xq, xs, p->Mp, p->Kp, stream);
  if (err) return err;
  return mxgemm_blockwise_gemm(p, xq, xs, Y, p->lt_bytes ? static_cast<uint8_t*>(Y) + p->lt_offset : nullptr, stream);
}
