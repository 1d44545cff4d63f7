// Eager calls of a prepared weight's launch plans with no Python between the call and the launch (mxgemm/fastcall.py).
//
// A Table belongs to one prepared weight [n, k] on one device. For each M a plan was made for it holds the plan's C
// entry point, the plan's address, the shape of the bf16 buffer a call writes (its first M x n elements the output)
// and the Python launcher, kept alive while the entry is (it owns the plan). A call checks the activations as that
// launcher takes them, allocates the buffer, calls the entry on the device's current stream and answers the output
// shaped after the activations; it answers None wherever the Python path must run instead: an M without an entry, an
// entry of an older tuning generation, activations that are not bf16 or not plain tensors, rows the kernel cannot
// read in place, a bias it does not add, gradients asked for, a Python dispatch mode, or a launch that failed (the
// Python path then launches again and raises with its own message).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

// How an entry point is called (mxgemm.kernels.LaunchEntry's kinds)
enum Kind : int {
  kRowsBias = 0,  // int (plan, x, ldx, bias, y, stream): rows of x evenly strided, a bias added in the epilogue
  kSmallM = 1,    // int (plan, x, bias, y, stream): x contiguous and 16-byte aligned
  kNoBias = 2,    // int (plan, x, ldx, y, stream): no bias
  kGated = 3,     // int (plan, gate, ldg, up, ldu, bias, y, stream): the product silu(gate) * up
};

using RowsBias = int (*)(void*, const void*, int, const void*, void*, void*);
using SmallM = int (*)(void*, const void*, const void*, void*, void*);
using NoBias = int (*)(void*, const void*, int, void*, void*);
using Gated = int (*)(void*, const void*, int, const void*, int, const void*, void*, void*);

// The tuning generation of the process (mxgemm.tuning.generation()): entries of another one are stale
int64_t g_generation = 0;

struct Entry {
  int kind;
  void* fn;
  void* plan;
  int64_t rows, cols;  // the buffer a call writes, bf16
  int64_t generation;
  py::object keep;  // the Python launcher that owns the plan
};

// A plain tensor (not a subclass, not a Parameter): what the Python path runs its plans on
const at::Tensor* plain(py::handle obj) {
  if (Py_TYPE(obj.ptr()) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) return nullptr;
  return &THPVariable_Unpack(obj.ptr());
}

// The row stride at which a kernel reads x's rows in place: x's own where 2-D with unit stride along K, K where x is
// contiguous; 0 where the rows need a copy (the Python path makes it)
int64_t row_stride(const at::Tensor& x, int64_t k) {
  if (x.dim() == 2 && x.stride(1) == 1) return x.stride(0);
  return x.is_contiguous() ? k : 0;
}

class Table {
 public:
  Table(c10::Device device, int64_t k, int64_t n)
      : device_(device), k_(k), n_(n),
        options_(at::TensorOptions().dtype(at::kBFloat16).device(device)),
        guard_(device.is_cuda() ? c10::impl::getDeviceGuardImpl(device.type()) : nullptr) {}

  void add(int64_t m, int kind, int64_t fn, int64_t plan, int64_t rows, int64_t cols, int64_t generation,
           py::object keep) {
    TORCH_CHECK(kind >= kRowsBias && kind <= kGated, "unknown entry kind ", kind);
    auto& entries = kind == kGated ? gated_ : plans_;
    entries[m] = Entry{kind, reinterpret_cast<void*>(fn), reinterpret_cast<void*>(plan), rows, cols, generation,
                       std::move(keep)};
  }

  void clear() {
    plans_.clear();
    gated_.clear();
  }

  size_t size() const { return plans_.size() + gated_.size(); }

  // y = x @ W^T (+ bias) through M's plan, or None
  py::object call(py::handle x_obj, py::handle bias_obj) {
    const at::Tensor* x = plain(x_obj);
    if (!x || !usable(*x)) return py::none();
    const Entry* e = find(plans_, x->numel() / k_);
    const at::Tensor* bias = nullptr;
    if (!e || !bias_fits(bias_obj, e->kind != kNoBias, bias)) return py::none();
    if (c10::GradMode::is_enabled() && (x->requires_grad() || (bias && bias->requires_grad()))) return py::none();
    const int64_t ldx = row_stride(*x, k_);
    if (!ldx || (e->kind == kSmallM && (!x->is_contiguous() || reinterpret_cast<uintptr_t>(x->data_ptr()) % 16)))
      return py::none();
    at::Tensor y = at::empty({e->rows, e->cols}, options_);
    const void* b = bias ? bias->data_ptr() : nullptr;
    void* stream = current_stream();
    int err;
    if (e->kind == kRowsBias)
      err = reinterpret_cast<RowsBias>(e->fn)(e->plan, x->data_ptr(), (int)ldx, b, y.data_ptr(), stream);
    else if (e->kind == kSmallM)
      err = reinterpret_cast<SmallM>(e->fn)(e->plan, x->data_ptr(), b, y.data_ptr(), stream);
    else
      err = reinterpret_cast<NoBias>(e->fn)(e->plan, x->data_ptr(), (int)ldx, y.data_ptr(), stream);
    return err ? py::none() : shaped(std::move(y), *x);
  }

  // y = silu(gate) * up @ W^T (+ bias) through M's gated plan, or None
  py::object gated(py::handle gate_obj, py::handle up_obj, py::handle bias_obj) {
    const at::Tensor* gate = plain(gate_obj);
    const at::Tensor* up = plain(up_obj);
    if (!gate || !up || !usable(*gate) || up->scalar_type() != at::kBFloat16 || up->sizes() != gate->sizes() ||
        up->device() != device_)
      return py::none();
    const Entry* e = find(gated_, gate->numel() / k_);
    const at::Tensor* bias = nullptr;
    if (!e || !bias_fits(bias_obj, true, bias)) return py::none();
    if (c10::GradMode::is_enabled() &&
        (gate->requires_grad() || up->requires_grad() || (bias && bias->requires_grad())))
      return py::none();
    const int64_t ldg = row_stride(*gate, k_), ldu = row_stride(*up, k_);
    if (!ldg || !ldu) return py::none();
    at::Tensor y = at::empty({e->rows, e->cols}, options_);
    const int err = reinterpret_cast<Gated>(e->fn)(e->plan, gate->data_ptr(), (int)ldg, up->data_ptr(), (int)ldu,
                                                   bias ? bias->data_ptr() : nullptr, y.data_ptr(), current_stream());
    return err ? py::none() : shaped(std::move(y), *gate);
  }

 private:
  // bf16 activations [..., k] with rows, on the table's device, outside Python dispatch modes
  bool usable(const at::Tensor& x) const {
    return x.scalar_type() == at::kBFloat16 && x.dim() >= 1 && x.size(-1) == k_ && x.numel() > 0 &&
           x.device() == device_ && !c10::impl::TorchDispatchModeTLS::any_modes_set();
  }

  const Entry* find(const std::unordered_map<int64_t, Entry>& entries, int64_t m) const {
    auto it = entries.find(m);
    return it == entries.end() || it->second.generation != g_generation ? nullptr : &it->second;
  }

  // None, or (where the entry adds one) a plain contiguous bf16 [n] tensor on the device
  bool bias_fits(py::handle obj, bool takes_bias, const at::Tensor*& bias) const {
    if (obj.is_none()) return true;
    bias = plain(obj);
    return takes_bias && bias && bias->scalar_type() == at::kBFloat16 && bias->dim() == 1 && bias->size(0) == n_ &&
           bias->is_contiguous() && bias->device() == device_;
  }

  void* current_stream() const { return guard_ ? guard_->getStream(device_).native_handle() : nullptr; }

  // The buffer's first M x n elements as [..., n] after x's leading dimensions (its storage stays)
  py::object shaped(at::Tensor y, const at::Tensor& x) const {
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = n_;
    y.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(y)));
  }

  c10::Device device_;
  int64_t k_, n_;
  at::TensorOptions options_;
  const c10::impl::DeviceGuardImplInterface* guard_;
  std::unordered_map<int64_t, Entry> plans_, gated_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Table>(m, "Table")
      .def(py::init<c10::Device, int64_t, int64_t>(), py::arg("device"), py::arg("k"), py::arg("n"))
      .def("add", &Table::add)
      .def("clear", &Table::clear)
      .def("__len__", &Table::size)
      .def("__call__", &Table::call)
      .def("gated", &Table::gated);
  m.def("set_generation", [](int64_t generation) { g_generation = generation; });
}
