// shardtensor's C++ half: the PrivateUse1 device guard, and the tensor-metadata setters behind
// in-place view ops (squeeze_, t_, as_strided_, resize_, set_ ...).
//
// torch's Python device guard is called while autograd unwinds an exception raised in backward();
// with the Python error still set, that call aborts the process ("terminate called without an
// active exception"). This guard never calls Python. shardtensor has one logical device and no
// streams or events, so every method is trivial.
//
// A ShardedTensor's sizes live in its C++ TensorImpl (made by _make_wrapper_subclass) and Python
// cannot change them; set_geometry/share_storage/fresh_storage do, for the dispatcher. Its storage
// holds no data (the values are in JAX): only its byte size and identity matter.
//
// Built with the package (setup.py) or, failing that, on first import (device.py). It is a plain
// CPython module that includes only the c10/ATen/autograd headers it uses, not torch/extension.h
// and pybind11: that takes the compile from ~30 s to ~10 s (nearly all of it autograd/variable.h,
// needed for forget_view_replay). Loading it registers nothing: register_backend() does, once the
// Python side has checked TORCH_VERSION and SOURCE_ID, so a module built for another torch, or from
// an older version of this file (an editable install), is never used.
//
// It also picks F.scaled_dot_product_attention's backend for the device: torch asks a C++ stub
// (not a dispatcher op), and without an answer it decomposes SDPA into matmul/reshape/bmm before
// __torch_dispatch__ sees it. "overrideable" makes SDPA reach shardtensor as one op
// (_scaled_dot_product_fused_attention_overrideable, lowered in ops/attention.py).
#include <Python.h>
#include <structmember.h>  // (T_OBJECT_EX, READONLY: a Cell's slots, read and written directly)

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/transformers/attention.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceType.h>
#include <c10/core/Storage.h>
#include <c10/core/Stream.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/headeronly/version.h>

#include <cstdint>
#include <cstring>
#include <vector>

#ifndef TORCH_EXTENSION_NAME
#error "TORCH_EXTENSION_NAME (the module's name) is set by torch.utils.cpp_extension"
#endif
#ifndef SHARDTENSOR_SOURCE_ID
#error "SHARDTENSOR_SOURCE_ID (a hash of this file, 0x...ULL) is set by setup.py and device.py"
#endif
#define SHARDTENSOR_CONCAT2(a, b) a##b
#define SHARDTENSOR_CONCAT(a, b) SHARDTENSOR_CONCAT2(a, b)
#define SHARDTENSOR_STR2(a) #a
#define SHARDTENSOR_STR(a) SHARDTENSOR_STR2(a)

namespace {
struct ShardtensorGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  static thread_local c10::DeviceIndex current_device;
  static thread_local c10::StreamId current_stream;
  c10::DeviceType type() const override { return c10::DeviceType::PrivateUse1; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice(); current_device = d.index(); return old; }
  c10::Device getDevice() const override { return c10::Device(c10::DeviceType::PrivateUse1, current_device); }
  void setDevice(c10::Device d) const override { current_device = d.index(); }
  void uncheckedSetDevice(c10::Device d) const noexcept override { current_device = d.index(); }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, d, current_stream); }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream exchangeStream(c10::Stream s) const override {
    auto old = getStream(s.device()); current_stream = s.id(); return old; }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
};
thread_local c10::DeviceIndex ShardtensorGuardImpl::current_device = 0;
thread_local c10::StreamId ShardtensorGuardImpl::current_stream = 0;

// What torch asks of the accelerator behind torch.accelerator (registering the backend makes it one):
// a DataLoader with pin_memory=True pins for it. shardtensor's device reads host memory through JAX,
// which needs no page-locked buffers, so "pinned" memory is ordinary host memory.
struct ShardtensorHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  at::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  bool isPinnedPtr(const void*) const override { return false; }
  at::Device getDeviceFromPtr(void*) const override { return at::Device(c10::DeviceType::PrivateUse1, 0); }
};

// torch allocates storage on the device in a few places: torch.UntypedStorage(n, device=...), and a
// DataLoader worker's collate, which moves a batch's tensors into shared storage of their device.
// shardtensor's tensors hold JAX arrays, not torch storage: refuse with a clear error (without an
// allocator, torch dereferences a null one and the process dies).
struct RefusingAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    TORCH_CHECK(nbytes == 0, "shardtensor: cannot allocate ", nbytes, " bytes of torch storage on the shardtensor "
                "device: its tensors hold JAX arrays, not torch storage. Create them with torch's factory functions "
                "(device='shardtensor'), st.shard or .to('shardtensor'); in a DataLoader, return CPU tensors from the "
                "dataset and upload the batches in the main process (st.MpDeviceLoader does).");
    return c10::DataPtr(nullptr, c10::Device(c10::DeviceType::PrivateUse1, 0));
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    TORCH_CHECK(count == 0, "shardtensor: the shardtensor device has no torch storage to copy");
  }
};

c10::TensorImpl* data_less_impl(const at::Tensor& t) {
  TORCH_CHECK(t.defined() && t.device().type() == c10::DeviceType::PrivateUse1,
              "shardtensor: expected a tensor on the shardtensor device");
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  TORCH_CHECK(impl->has_storage() && impl->storage().data_ptr().get() == nullptr,
              "shardtensor: expected a ShardedTensor (a tensor whose storage holds no data)");
  return impl;
}

// Give t these sizes, strides and storage offset (its storage grows to cover them).
void set_geometry(const at::Tensor& t, std::vector<int64_t> sizes, std::vector<int64_t> strides,
                  int64_t storage_offset) {
  c10::TensorImpl* impl = data_less_impl(t);
  TORCH_CHECK(sizes.size() == strides.size(), "shardtensor: sizes and strides differ in length");
  int64_t extent = storage_offset;  // one past the last element, in elements
  bool empty = false;
  for (size_t i = 0; i < sizes.size(); ++i) {
    TORCH_CHECK(sizes[i] >= 0 && strides[i] >= 0 && storage_offset >= 0, "shardtensor: negative size, stride or offset");
    empty = empty || sizes[i] == 0;
    extent += (sizes[i] - 1) * strides[i];
  }
  extent = empty ? storage_offset : extent + 1;
  impl->set_sizes_and_strides(sizes, strides, storage_offset);
  size_t nbytes = static_cast<size_t>(extent) * impl->dtype().itemsize();
  auto* storage = impl->storage().unsafeGetStorageImpl();
  if (storage->nbytes() < nbytes) storage->set_nbytes(nbytes);
}

// Make t share src's storage (torch's set_(src)).
void share_storage(const at::Tensor& t, const at::Tensor& src) {
  c10::TensorImpl* impl = data_less_impl(t);
  impl->set_storage_keep_dtype(data_less_impl(src)->storage());
}

// Give t a storage of its own of nbytes bytes (a resize_ that had to reallocate).
void fresh_storage(const at::Tensor& t, int64_t nbytes) {
  c10::TensorImpl* impl = data_less_impl(t);
  impl->set_storage_keep_dtype(c10::Storage(c10::Storage::use_byte_size_t(), static_cast<size_t>(nbytes),
                                            at::DataPtr(nullptr, t.device()), nullptr, false));
}

// An in-place view op changed the geometry of t, an autograd view: make autograd rebuild t from its
// base with as_strided (exact on shardtensor) rather than by replaying the view ops that made it,
// which knows nothing of in-place view ops (pytorch/pytorch#49825; plain CPU tensors use as_strided).
void forget_view_replay(const at::Tensor& t) {
  auto* meta = torch::autograd::impl::get_view_autograd_meta(t);
  if (meta == nullptr) return;
  for (bool forward : {false, true}) {
    if (forward ? !meta->has_fw_view() : !meta->has_bw_view()) continue;
    auto& info = const_cast<torch::autograd::ViewInfo&>(forward ? meta->get_forward_view() : meta->get_backward_view());
    info.view_fn_.reset();
    info.rev_view_fn_ = nullptr;
  }
}

// F.scaled_dot_product_attention's backend on this device: the one fused op (no dropout: its mask
// would have to be replayed in backward, so dropout keeps torch's math path and its random ops),
// unless torch.nn.attention.sdpa_kernel / torch.backends.cuda.enable_*_sdp turned it off.
int64_t choose_sdpa_backend(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            double dropout_p, bool, std::optional<double>, bool) {
  const auto& ctx = at::globalContext();
  if (dropout_p == 0.0 && ctx.userEnabledOverrideableSDP()) return static_cast<int64_t>(at::SDPBackend::overrideable);
  if (ctx.userEnabledMathSDP()) return static_cast<int64_t>(at::SDPBackend::math);
  return static_cast<int64_t>(at::SDPBackend::error);  // torch then says no backend is enabled
}

// Register the guard and the hooks above (once per process; torch keeps the pointers).
void register_backend() {
  static const bool registered = [] {
    static c10::impl::DeviceGuardImplRegistrar guard(c10::DeviceType::PrivateUse1, new ShardtensorGuardImpl());
    static ShardtensorHooks hooks;
    at::RegisterPrivateUse1HooksInterface(&hooks);
    static RefusingAllocator allocator;
    c10::SetAllocator(c10::DeviceType::PrivateUse1, &allocator);
    at::native::_fused_sdp_choice_stub.set_privateuse1_dispatch_ptr(&choose_sdpa_backend);
    return true;
  }();
  (void)registered;
}

// ------------------------------------------------------------------------------ the Python module
PyObject* tensor_type = nullptr;  // torch.Tensor

struct PythonErrorSet {};  // thrown when a Python exception is already set

at::Tensor unpack_tensor(PyObject* obj) {
  int is_tensor = PyObject_IsInstance(obj, tensor_type);
  if (is_tensor < 0) throw PythonErrorSet();
  if (!is_tensor) {
    PyErr_Format(PyExc_TypeError, "shardtensor: expected a torch.Tensor, got %s", Py_TYPE(obj)->tp_name);
    throw PythonErrorSet();
  }
  // Tensor._cdata is the address of the tensor's TensorImpl; obj keeps it alive during the call.
  PyObject* address = PyObject_GetAttrString(obj, "_cdata");
  if (address == nullptr) throw PythonErrorSet();
  void* impl = PyLong_AsVoidPtr(address);
  Py_DECREF(address);
  if (impl == nullptr) throw PythonErrorSet();
  return at::Tensor(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim_copy(
      static_cast<c10::TensorImpl*>(impl)));
}

std::vector<int64_t> unpack_ints(PyObject* obj, const char* what) {
  PyObject* seq = PySequence_Fast(obj, what);
  if (seq == nullptr) throw PythonErrorSet();
  std::vector<int64_t> out(PySequence_Fast_GET_SIZE(seq));
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
    if (out[i] == -1 && PyErr_Occurred()) {
      Py_DECREF(seq);
      throw PythonErrorSet();
    }
  }
  Py_DECREF(seq);
  return out;
}

// Runs body, turning a C++ exception into a Python one (torch's checks raise RuntimeError, as in torch).
template <typename Body>
PyObject* call(Body body) {
  try {
    body();
    Py_RETURN_NONE;
  } catch (const PythonErrorSet&) {
    return nullptr;
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

PyObject* py_set_geometry(PyObject*, PyObject* args) {
  PyObject *t, *sizes, *strides;
  long long offset;
  if (!PyArg_ParseTuple(args, "OOOL:set_geometry", &t, &sizes, &strides, &offset)) return nullptr;
  return call([&] {
    set_geometry(unpack_tensor(t), unpack_ints(sizes, "sizes must be a sequence of ints"),
                 unpack_ints(strides, "strides must be a sequence of ints"), offset);
  });
}

PyObject* py_share_storage(PyObject*, PyObject* args) {
  PyObject *t, *src;
  if (!PyArg_ParseTuple(args, "OO:share_storage", &t, &src)) return nullptr;
  return call([&] { share_storage(unpack_tensor(t), unpack_tensor(src)); });
}

PyObject* py_fresh_storage(PyObject*, PyObject* args) {
  PyObject* t;
  long long nbytes;
  if (!PyArg_ParseTuple(args, "OL:fresh_storage", &t, &nbytes)) return nullptr;
  return call([&] { fresh_storage(unpack_tensor(t), nbytes); });
}

PyObject* py_forget_view_replay(PyObject*, PyObject* t) {
  return call([&] { forget_view_replay(unpack_tensor(t)); });
}

PyObject* py_register_backend(PyObject*, PyObject*) {
  return call([] { register_backend(); });
}

// (the frozen replay's parts: its guard's reads, then its gather and store passes)
#include "replay_guard.h"
#include "replay_passes.h"
#include "replay_state.h"

bool intern_guard_names() {
  guard_names[8] = PyUnicode_InternFromString("_backward_hooks");
  guard_names[9] = PyUnicode_InternFromString("_post_accumulate_grad_hooks");
  name_requires_grad = PyUnicode_InternFromString("requires_grad");
  name_grad = PyUnicode_InternFromString("grad");
  name_cell = PyUnicode_InternFromString("_cell");
  name_value = PyUnicode_InternFromString("value");
  name_owned = PyUnicode_InternFromString("owned");
  name_leaf = PyUnicode_InternFromString("_leaf");
  name_version = PyUnicode_InternFromString("version");
  return guard_names[8] != nullptr && guard_names[9] != nullptr && name_requires_grad != nullptr &&
         name_grad != nullptr && name_cell != nullptr && name_value != nullptr && name_owned != nullptr &&
         name_leaf != nullptr && name_version != nullptr;
}
PyMethodDef methods[] = {
    {"set_geometry", py_set_geometry, METH_VARARGS, "set_geometry(t, sizes, strides, storage_offset)"},
    {"share_storage", py_share_storage, METH_VARARGS, "share_storage(t, src): t uses src's storage"},
    {"fresh_storage", py_fresh_storage, METH_VARARGS, "fresh_storage(t, nbytes): t gets a storage of its own"},
    {"forget_view_replay", py_forget_view_replay, METH_O, "forget_view_replay(t): autograd rebuilds t with as_strided"},
    {"register_backend", py_register_backend, METH_NOARGS, "register the device guard and hooks (once)"},
    {"arguments_state", py_arguments_state, METH_O,
     "arguments_state(args): bytes of a call's tensor arguments' guarded state, or None (see replay_guard)"},
    {"dict_version", py_dict_version, METH_O, "dict_version(d): its version tag (None: not kept by this Python)"},
    {"type_version", py_type_version, METH_O, "type_version(cls): its version tag (0: none)"},
    {"reads_begin", py_reads_begin, METH_VARARGS,
     "reads_begin(owner, classify, classify_c): record the code a trace runs (see replay_guard)"},
    {"reads_end", py_reads_end, METH_NOARGS, "reads_end() -> (codes, reason, resumed): what reads_begin recorded"},
    {"state_plan", py_state_plan, METH_O, "state_plan(entries) -> a plan for state_holds (see replay_guard)"},
    {"state_holds", py_state_holds, METH_O, "state_holds(plan) -> whether every entry holds"},
    {"state_failing", py_state_failing, METH_O, "state_failing(plan) -> the first entry that fails, or -1"},
    {"tensor_state", py_tensor_state, METH_O, "tensor_state(t) -> bytes a plan's tensor entry compares"},
    {"tensor_fast", py_tensor_fast, METH_O, "tensor_fast(t) -> whether a plan's fast tensor entry can watch t"},
    {"replay_gather", py_replay_gather, METH_VARARGS,
     "replay_gather(flat, arg_positions, old_refs, consts, passed, donated_reads[, call_donated, call_kept]): "
     "a frozen replay's inputs"},
    {"replay_store", py_replay_store, METH_VARARGS,
     "replay_store(plan, flat, outs, made[, passed]) -> (cells, refs, befores, owned): a frozen replay's outputs given to their cells"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, SHARDTENSOR_STR(TORCH_EXTENSION_NAME),
                          "shardtensor's PrivateUse1 device guard and tensor-metadata setters", -1, methods};
}  // namespace

PyMODINIT_FUNC SHARDTENSOR_CONCAT(PyInit_, TORCH_EXTENSION_NAME)() {
  PyObject* torch = PyImport_ImportModule("torch");
  if (torch == nullptr) return nullptr;
  tensor_type = PyObject_GetAttrString(torch, "Tensor");
  Py_DECREF(torch);
  if (tensor_type == nullptr || !intern_guard_names()) return nullptr;
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  // what it was built from: torch's headers and this file (device.py compares both before using it)
  PyObject* source_id = PyLong_FromUnsignedLongLong(SHARDTENSOR_SOURCE_ID);
  if (PyModule_AddStringConstant(module, "TORCH_VERSION", TORCH_VERSION) < 0 || source_id == nullptr ||
      PyModule_AddObject(module, "SOURCE_ID", source_id) < 0) {
    Py_XDECREF(source_id);
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
