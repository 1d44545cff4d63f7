// Eager calls launched as a CUDA graph: a call's kernels are captured once into a graph of its plan's (on a stream
// of their own, never run there); every later call runs the same launch code with a Recorder set, which takes each
// kernel's configuration and arguments instead of launching it, sets them into the graph's kernel nodes (those whose
// launch differs from the one they hold) and launches the graph. On the hosts measured a replayed graph costs a
// fraction of a kernel launch's host time (the H200 machine: 5.1 us for a graph of one or two launches, about 7.5 us
// a launch).
//
// A kernel is launched through launch_or_record; a plan keeps a void* for its graph, freed by free_plan_graph.
#pragma once

#include <cuda_runtime.h>

#include <cstring>
#include <mutex>
#include <type_traits>
#include <utility>

namespace graph_launch {

constexpr int kMaxLaunches = 2;
// what run_as_graph returns when the call must launch directly: a capturing stream, a call whose launches are not
// those of the graph, a graph that could not be made
constexpr int kNotGraphed = -10;

// A launch recorded instead of made: the kernel, its configuration and a copy of its arguments
struct Recorded {
  const void* func;
  dim3 grid, block;
  size_t smem;
  alignas(64) unsigned char args[512];  // the arguments, each at its alignment (a CUtensorMap at 64 bytes)
  void* params[12];
  int count;
  size_t size;  // bytes of args in use
};

// Whether two records launch the same kernel with the same configuration and argument bytes
inline bool same_launch(const Recorded& a, const Recorded& b) {
  return a.func == b.func && a.grid.x == b.grid.x && a.grid.y == b.grid.y && a.grid.z == b.grid.z &&
         a.block.x == b.block.x && a.block.y == b.block.y && a.block.z == b.block.z && a.smem == b.smem &&
         a.size == b.size && memcmp(a.args, b.args, a.size) == 0;
}

struct Recorder {
  Recorded launches[kMaxLaunches];
  int count = 0;
  bool overflow = false;
};

inline thread_local Recorder* recorder = nullptr;

template <typename T>
void record_arg(Recorded& r, size_t& offset, const T& value) {
  offset = (offset + alignof(T) - 1) / alignof(T) * alignof(T);
  if (offset + sizeof(T) <= sizeof(r.args)) memcpy(r.args + offset, &value, sizeof(T));
  r.params[r.count++] = r.args + offset;
  offset += sizeof(T);
}

// cudaLaunchKernelEx, or (a Recorder set on this thread) a record of the launch
template <typename... Params, typename... Actual>
cudaError_t launch_or_record(void (*kernel)(Params...), const cudaLaunchConfig_t& config, Actual&&... actual) {
  if (!recorder) return cudaLaunchKernelEx(&config, kernel, std::forward<Actual>(actual)...);
  static_assert(sizeof...(Params) <= 12, "more kernel parameters than a record holds");
  if (recorder->count == kMaxLaunches) {
    recorder->overflow = true;
    return cudaSuccess;
  }
  Recorded& r = recorder->launches[recorder->count++];
  r.func = reinterpret_cast<const void*>(kernel);
  r.grid = config.gridDim, r.block = config.blockDim, r.smem = config.dynamicSmemBytes;
  r.count = 0;
  size_t offset = 0;
  (record_arg(r, offset, static_cast<std::decay_t<Params>>(actual)), ...);
  r.size = offset;
  if (offset > sizeof(r.args)) recorder->overflow = true;
  return cudaSuccess;
}

// Instantiations of a plan's graph kept at once: calls whose buffers alternate between a few addresses (a model's
// layers called step after step, activations rotating through the allocator's blocks) each find one whose nodes hold
// their launch, and launch it without setting a node
constexpr int kExecs = 4;

// One instantiation, and what each of its nodes was last set to, where known
struct Exec {
  cudaGraphExec_t exec = nullptr;
  Recorded last[kMaxLaunches];
  bool known[kMaxLaunches] = {};
  unsigned long long used = 0;  // the plan's call count at its last launch
};

struct PlanGraph {
  std::mutex mutex;
  cudaGraph_t graph = nullptr;
  cudaGraphNode_t nodes[kMaxLaunches] = {};  // in launch order
  int count = 0;
  Exec execs[kExecs];
  unsigned long long calls = 0;
  bool broken = false;  // capture or instantiation failed: launch directly
};

// Whether an instantiation's nodes all hold the recorded launches
inline bool holds(const Exec& e, const Recorder& rec) {
  if (!e.exec) return false;
  for (int i = 0; i < rec.count; ++i)
    if (!e.known[i] || !same_launch(rec.launches[i], e.last[i])) return false;
  return true;
}

// The instantiation a call launches: one holding its launches, else an empty slot, else the least recently launched
inline Exec& exec_for(PlanGraph& g, const Recorder& rec) {
  Exec* pick = &g.execs[0];
  for (Exec& e : g.execs) {
    if (holds(e, rec)) return e;
    if (pick->exec && (!e.exec || e.used < pick->used)) pick = &e;
  }
  return *pick;
}

inline cudaStream_t capture_stream(int device) {
  static std::mutex mutex;
  static cudaStream_t streams[64] = {};
  if (device < 0 || device >= 64) return nullptr;
  std::lock_guard<std::mutex> lock(mutex);
  if (!streams[device]) cudaStreamCreateWithFlags(&streams[device], cudaStreamNonBlocking);
  return streams[device];
}

// Capture launch(stream) into g, its kernel nodes matched to the recorded launches by function
template <class Launch>
bool build(PlanGraph& g, const Recorder& rec, Launch& launch) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  cudaStream_t cs = capture_stream(device);
  if (!cs || cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal) != cudaSuccess) return false;
  const int err = launch(cs);
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(cs, &graph);
  bool ok = !err && end == cudaSuccess && graph;
  cudaGraphNode_t found[kMaxLaunches + 2];
  size_t n = kMaxLaunches + 2;
  ok = ok && cudaGraphGetNodes(graph, found, &n) == cudaSuccess && n == (size_t)rec.count;
  for (int i = 0; ok && i < rec.count; ++i) {
    g.nodes[i] = nullptr;
    for (size_t j = 0; j < n; ++j) {
      cudaKernelNodeParams kp = {};
      if (cudaGraphKernelNodeGetParams(found[j], &kp) == cudaSuccess && kp.func == rec.launches[i].func)
        g.nodes[i] = found[j];
    }
    ok = g.nodes[i] != nullptr;
  }
  ok = ok && cudaGraphInstantiate(&g.execs[0].exec, graph, 0) == cudaSuccess;
  if (!ok) {
    if (graph) cudaGraphDestroy(graph);
    g.execs[0].exec = nullptr;
    cudaGetLastError();
    return false;
  }
  g.graph = graph;
  g.count = rec.count;
  return true;
}

// The call launch(stream) as a launch of the graph in *slot (made on the first call), or kNotGraphed
template <class Launch>
int run_as_graph(void** slot, Launch launch, cudaStream_t st) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(st, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) {
    cudaGetLastError();
    return kNotGraphed;
  }
  static std::mutex create;
  PlanGraph* g;
  {
    std::lock_guard<std::mutex> lock(create);
    if (!*slot) *slot = new PlanGraph();
    g = static_cast<PlanGraph*>(*slot);
  }
  std::lock_guard<std::mutex> lock(g->mutex);
  if (g->broken) return kNotGraphed;
  Recorder rec;
  recorder = &rec;
  const int err = launch(st);
  recorder = nullptr;
  if (err) return err;
  if (rec.overflow || rec.count == 0) return kNotGraphed;
  if (!g->graph && !build(*g, rec, launch)) {
    g->broken = true;
    return kNotGraphed;
  }
  if (rec.count != g->count) return kNotGraphed;
  Exec& e = exec_for(*g, rec);
  if (!e.exec && cudaGraphInstantiate(&e.exec, g->graph, 0) != cudaSuccess) {
    e.exec = nullptr;
    cudaGetLastError();
    return kNotGraphed;
  }
  for (int i = 0; i < rec.count; ++i) {
    const Recorded& r = rec.launches[i];
    if (e.known[i] && same_launch(r, e.last[i])) continue;
    cudaKernelNodeParams kp = {};
    kp.func = const_cast<void*>(r.func);
    kp.gridDim = r.grid;
    kp.blockDim = r.block;
    kp.sharedMemBytes = (unsigned)r.smem;
    kp.kernelParams = const_cast<void**>(r.params);
    if (cudaGraphExecKernelNodeSetParams(e.exec, g->nodes[i], &kp) != cudaSuccess) {  // a launch it cannot take
      e.known[i] = false;
      cudaGetLastError();
      return kNotGraphed;
    }
    e.last[i] = r;  // its params point into rec, which is gone after the call: only the bytes are compared
    e.known[i] = true;
  }
  e.used = ++g->calls;
  return (int)cudaGraphLaunch(e.exec, st);
}

inline void free_plan_graph(void** slot) {
  PlanGraph* g = static_cast<PlanGraph*>(*slot);
  if (!g) return;
  for (Exec& e : g->execs)
    if (e.exec) cudaGraphExecDestroy(e.exec);
  if (g->graph) cudaGraphDestroy(g->graph);
  delete g;
  *slot = nullptr;
}

}  // namespace graph_launch
