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

// ------------------------------------------------------------------- the replay guard's reads
// A frozen st.compile replay first checks that the modules and tensors its trace depended on are as
// they were (replay_guard.Guard: a module's mode, parameters, buffers, submodules and hooks; a
// tensor's requires_grad, hooks, .grad and storage cell). guard_fingerprint reads all of that in
// one pass into bytes: equal bytes, the same state. Objects are recorded by address (the guard holds
// a weak reference to each, and one dying fails it, so an address cannot be reused unseen), hook
// handles by their ids. It answers None for a module that keeps one of these elsewhere than in its
// __dict__, or in another form (the guard then reads it in Python). The modules and tensors may be given
// as weak references to them (the guard's own): one that died also answers None.
PyObject* guard_names[10] = {};  // "training", the 3 containers, the 4 module hook dicts; 2 tensor hook attrs
PyObject* name_requires_grad = nullptr;
PyObject* name_grad = nullptr;
PyObject* name_cell = nullptr;
constexpr uint64_t kNoDict = ~uint64_t{0};

struct Unusual {};  // the state is not in the expected form: answer None

void push_values(std::vector<uint64_t>& out, PyObject* d) {
  if (!PyDict_CheckExact(d)) throw Unusual();
  out.push_back(static_cast<uint64_t>(PyDict_GET_SIZE(d)));
  Py_ssize_t pos = 0;
  PyObject *key, *value;
  while (PyDict_Next(d, &pos, &key, &value)) out.push_back(reinterpret_cast<uintptr_t>(value));
}

void push_hook_ids(std::vector<uint64_t>& out, PyObject* d) {  // None or a dict of handle id -> hook
  if (d == Py_None) {
    out.push_back(0);
    return;
  }
  if (!PyDict_Check(d)) throw Unusual();
  out.push_back(static_cast<uint64_t>(PyDict_GET_SIZE(d)));
  Py_ssize_t pos = 0;
  PyObject *key, *value;
  while (PyDict_Next(d, &pos, &key, &value)) {
    if (!PyLong_CheckExact(key)) throw Unusual();
    long long id = PyLong_AsLongLong(key);
    if (id == -1 && PyErr_Occurred()) throw PythonErrorSet();
    out.push_back(static_cast<uint64_t>(id));
  }
}

struct OwnedRef {  // a new reference, released at the end of the scope
  PyObject* obj;
  explicit OwnedRef(PyObject* o) : obj(o) {
    if (obj == nullptr) throw PythonErrorSet();
  }
  ~OwnedRef() { Py_XDECREF(obj); }
};

void push_module(std::vector<uint64_t>& out, PyObject* module) {
  OwnedRef dict(PyObject_GenericGetDict(module, nullptr));
  if (!PyDict_Check(dict.obj)) throw Unusual();
  PyObject* fields[8];
  for (int i = 0; i < 8; ++i) {
    fields[i] = PyDict_GetItemWithError(dict.obj, guard_names[i]);  // borrowed
    if (fields[i] == nullptr) {
      if (PyErr_Occurred()) throw PythonErrorSet();
      throw Unusual();
    }
  }
  if (fields[0] != Py_True && fields[0] != Py_False) throw Unusual();
  out.push_back(fields[0] == Py_True);
  for (int i = 1; i < 4; ++i) push_values(out, fields[i]);
  for (int i = 4; i < 8; ++i) push_hook_ids(out, fields[i]);
}

// A tensor's requires_grad, hook dicts and .grad are read through torch's attribute getters (~50 ns
// each, most of a frozen replay's guard for a model's parameters), or, where the tensor's type takes
// them from torch's TensorBase, straight from the Python object: torch 2.13's THPVariable
// (torch/csrc/autograd/python_variable.h, whose pybind11 headers would triple the compile time) is
// mirrored here and its layout checked against the getters on the first tensor read. The two forms
// are recorded apart (a tag first): equal bytes still mean the same state.
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 13
struct TensorObject {  // THPVariable, as torch 2.13 lays it out
  PyObject_HEAD
  at::Tensor cdata;
  PyObject* backward_hooks;
  PyObject* post_accumulate_grad_hooks;
};
constexpr bool kMirrored = true;
#else
struct TensorObject {
  PyObject_HEAD
};
constexpr bool kMirrored = false;
#endif
int layout_checked = kMirrored ? 0 : -1;  // 1: the mirror matches torch's getters, -1: not used
PyObject* base_getters[4] = {};  // TensorBase's descriptors of requires_grad, the 2 hook dicts, grad
PyTypeObject* plain_types[4] = {};  // types last found to take all four from TensorBase,
unsigned int plain_tags[4] = {};    // while their attribute version tag is unchanged

void push_cell(std::vector<uint64_t>& out, PyObject* t);

bool layout_matches(PyObject* t) {  // the mirror's fields against the getters, on one tensor
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 13
  auto* object = reinterpret_cast<TensorObject*>(t);
  if (Py_TYPE(t)->tp_basicsize < static_cast<Py_ssize_t>(sizeof(TensorObject))) return false;
  OwnedRef address(PyObject_GetAttrString(t, "_cdata"));
  void* impl = PyLong_AsVoidPtr(address.obj);
  if (impl == nullptr && PyErr_Occurred()) throw PythonErrorSet();
  if (impl != object->cdata.unsafeGetTensorImpl()) return false;
  OwnedRef backward(PyObject_GetAttr(t, guard_names[8]));
  OwnedRef accumulate(PyObject_GetAttr(t, guard_names[9]));
  auto same = [](PyObject* field, PyObject* got) { return field == nullptr ? got == Py_None : field == got; };
  OwnedRef requires_grad(PyObject_GetAttr(t, name_requires_grad));
  return same(object->backward_hooks, backward.obj) && same(object->post_accumulate_grad_hooks, accumulate.obj) &&
         (requires_grad.obj == Py_True) == object->cdata.requires_grad();
#else
  (void)t;
  return false;
#endif
}

bool plain_type(PyTypeObject* type) {  // whether type's four attributes are TensorBase's getters
  if (base_getters[0] == nullptr) {
    PyTypeObject* base = reinterpret_cast<PyTypeObject*>(tensor_type)->tp_base;
    PyObject* names[4] = {name_requires_grad, guard_names[8], guard_names[9], name_grad};
    for (int i = 0; i < 4; ++i) {
      base_getters[i] = base == nullptr ? nullptr : _PyType_Lookup(base, names[i]);  // borrowed
      if (base_getters[i] == nullptr) return false;
      Py_INCREF(base_getters[i]);
    }
  }
  bool tagged = PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG);
  for (int i = 0; i < 4; ++i)
    if (tagged && plain_types[i] == type && plain_tags[i] == type->tp_version_tag) return true;
  PyObject* names[4] = {name_requires_grad, guard_names[8], guard_names[9], name_grad};
  for (int i = 0; i < 4; ++i)
    if (_PyType_Lookup(type, names[i]) != base_getters[i]) return false;
  if (PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG)) {  // (the lookups above assign one)
    static int next = 0;
    plain_types[next] = type;  // (compared by address only, with its tag: never dereferenced)
    plain_tags[next] = type->tp_version_tag;
    next = (next + 1) % 4;
  }
  return true;
}

bool reads_directly(PyObject* t) {
  if (layout_checked < 0 || !PyObject_TypeCheck(t, reinterpret_cast<PyTypeObject*>(tensor_type))) return false;
  if (!plain_type(Py_TYPE(t))) return false;
  if (layout_checked == 0) layout_checked = layout_matches(t) ? 1 : -1;
  return layout_checked > 0;
}

void push_tensor(std::vector<uint64_t>& out, PyObject* t) {
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 13
  if (reads_directly(t)) {
    auto* object = reinterpret_cast<TensorObject*>(t);
    c10::TensorImpl* impl = object->cdata.unsafeGetTensorImpl();
    out.push_back(1);  // (the direct form)
    out.push_back(impl->requires_grad());
    push_hook_ids(out, object->backward_hooks == nullptr ? Py_None : object->backward_hooks);
    push_hook_ids(out, object->post_accumulate_grad_hooks == nullptr ? Py_None : object->post_accumulate_grad_hooks);
    // .grad by its TensorImpl: one Python object per TensorImpl, so the same object (the guard holds
    // a weak reference to it: neither can be freed and its address reused unseen)
    out.push_back(reinterpret_cast<uintptr_t>(impl->grad().unsafeGetTensorImpl()));
    push_cell(out, t);
    return;
  }
#endif
  out.push_back(2);  // (through the getters)
  OwnedRef requires_grad(PyObject_GetAttr(t, name_requires_grad));
  out.push_back(requires_grad.obj == Py_True);
  for (int i = 8; i < 10; ++i) {
    OwnedRef hooks(PyObject_GetAttr(t, guard_names[i]));
    push_hook_ids(out, hooks.obj);
  }
  OwnedRef grad(PyObject_GetAttr(t, name_grad));
  out.push_back(reinterpret_cast<uintptr_t>(grad.obj));
  push_cell(out, t);
}

void push_cell(std::vector<uint64_t>& out, PyObject* t) {
  PyObject* cell = PyObject_GetAttr(t, name_cell);
  if (cell == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw PythonErrorSet();
    PyErr_Clear();
    out.push_back(kNoDict);
  } else {
    out.push_back(reinterpret_cast<uintptr_t>(cell));
    Py_DECREF(cell);
  }
}

// A call's tensor argument: as a tensor, less its storage cell (a new array each call is the usual
// case), and its .grad only if it is a leaf (a non-leaf's .grad warns; the Python reads None). Read
// directly only (Unusual otherwise: the guard then reads the arguments in Python).
void push_argument(std::vector<uint64_t>& out, PyObject* t) {
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 13
  if (reads_directly(t)) {
    auto* object = reinterpret_cast<TensorObject*>(t);
    c10::TensorImpl* impl = object->cdata.unsafeGetTensorImpl();
    out.push_back(impl->requires_grad());
    push_hook_ids(out, object->backward_hooks == nullptr ? Py_None : object->backward_hooks);
    push_hook_ids(out, object->post_accumulate_grad_hooks == nullptr ? Py_None : object->post_accumulate_grad_hooks);
    out.push_back(object->cdata.is_leaf() ? reinterpret_cast<uintptr_t>(impl->grad().unsafeGetTensorImpl()) : 0);
    return;
  }
#endif
  (void)t;
  throw Unusual();
}

// An optimizer's guarded state, as replay_guard.Guard._state reads it: its state dict (by identity,
// and its size), each parameter group's parameters (by identity) and other entries (plain values by
// value: None, bools, floats, ints and tuples of them; anything else by identity; a string: Unusual,
// read in Python), and its step hooks' ids.
PyObject* name_state = nullptr;
PyObject* name_param_groups = nullptr;
PyObject* name_params = nullptr;
PyObject* name_pre_hooks = nullptr;
PyObject* name_post_hooks = nullptr;

bool plain_value(PyObject* v) {
  PyTypeObject* type = Py_TYPE(v);
  return v == Py_None || type == &PyBool_Type || type == &PyFloat_Type || type == &PyLong_Type;
}

void push_plain(std::vector<uint64_t>& out, PyObject* v) {  // (tagged: 1 == 1.0 in Python, not here)
  if (v == Py_None) {
    out.push_back(1);
  } else if (Py_TYPE(v) == &PyBool_Type) {
    out.push_back(2);
    out.push_back(v == Py_True);
  } else if (Py_TYPE(v) == &PyFloat_Type) {
    double d = PyFloat_AS_DOUBLE(v);
    uint64_t bits;
    std::memcpy(&bits, &d, sizeof(bits));
    out.push_back(3);
    out.push_back(bits);
  } else {
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (x == -1 && PyErr_Occurred()) throw PythonErrorSet();
    if (overflow) throw Unusual();
    out.push_back(4);
    out.push_back(static_cast<uint64_t>(x));
  }
}

void push_optimizer(std::vector<uint64_t>& out, PyObject* opt) {
  OwnedRef state(PyObject_GetAttr(opt, name_state));
  Py_ssize_t size = PyObject_Length(state.obj);
  if (size < 0) throw PythonErrorSet();
  out.push_back(reinterpret_cast<uintptr_t>(state.obj));
  out.push_back(static_cast<uint64_t>(size));
  OwnedRef groups(PyObject_GetAttr(opt, name_param_groups));
  if (!PyList_CheckExact(groups.obj)) throw Unusual();
  out.push_back(static_cast<uint64_t>(PyList_GET_SIZE(groups.obj)));
  for (Py_ssize_t g = 0; g < PyList_GET_SIZE(groups.obj); ++g) {
    PyObject* group = PyList_GET_ITEM(groups.obj, g);
    if (!PyDict_CheckExact(group)) throw Unusual();
    PyObject* params = PyDict_GetItemWithError(group, name_params);  // borrowed
    if (params == nullptr) {
      if (PyErr_Occurred()) throw PythonErrorSet();
      throw Unusual();
    }
    if (!PyList_CheckExact(params)) throw Unusual();
    out.push_back(static_cast<uint64_t>(PyList_GET_SIZE(params)));
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(params); ++i)
      out.push_back(reinterpret_cast<uintptr_t>(PyList_GET_ITEM(params, i)));
    out.push_back(static_cast<uint64_t>(PyDict_GET_SIZE(group)));
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(group, &pos, &key, &value)) {
      if (!PyUnicode_CheckExact(key)) throw Unusual();
      if (key == name_params || PyUnicode_Compare(key, name_params) == 0) continue;
      if (plain_value(value)) {
        push_plain(out, value);
      } else if (PyTuple_CheckExact(value)) {
        bool plain = true;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(value) && plain; ++i) {
          if (PyUnicode_CheckExact(PyTuple_GET_ITEM(value, i))) throw Unusual();
          plain = plain_value(PyTuple_GET_ITEM(value, i));
        }
        out.push_back(plain ? 5 : 6);
        if (plain) {
          out.push_back(static_cast<uint64_t>(PyTuple_GET_SIZE(value)));
          for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(value); ++i) push_plain(out, PyTuple_GET_ITEM(value, i));
        } else {
          out.push_back(reinterpret_cast<uintptr_t>(value));
        }
      } else if (PyUnicode_CheckExact(value)) {
        throw Unusual();
      } else {
        out.push_back(6);
        out.push_back(reinterpret_cast<uintptr_t>(value));
      }
    }
  }
  OwnedRef pre(PyObject_GetAttr(opt, name_pre_hooks));
  OwnedRef post(PyObject_GetAttr(opt, name_post_hooks));
  push_hook_ids(out, pre.obj);
  push_hook_ids(out, post.obj);
}

PyObject* live(PyObject* obj) {  // a new reference to obj, or to the object of a weak reference obj
  if (!PyWeakref_CheckRef(obj)) {
    Py_INCREF(obj);
    return obj;
  }
  PyObject* target = PyWeakref_GetObject(obj);  // borrowed
  if (target == nullptr) throw PythonErrorSet();
  if (target == Py_None) throw Unusual();  // (it died: the guard no longer holds, said in Python)
  Py_INCREF(target);
  return target;
}

PyObject* py_guard_fingerprint(PyObject*, PyObject* args) {
  PyObject *modules, *tensors, *call_args = nullptr, *optimizers = nullptr;
  if (!PyArg_ParseTuple(args, "OO|O!O!:guard_fingerprint", &modules, &tensors, &PyList_Type, &call_args,
                        &PyTuple_Type, &optimizers))
    return nullptr;
  if (!PyTuple_CheckExact(modules) || !PyTuple_CheckExact(tensors)) {
    PyErr_SetString(PyExc_TypeError, "guard_fingerprint(modules, tensors[, args]) takes two tuples (and a list)");
    return nullptr;
  }
  std::vector<uint64_t> out;
  out.reserve(static_cast<size_t>(24 * PyTuple_GET_SIZE(modules) + 8 * PyTuple_GET_SIZE(tensors)));
  try {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(modules); ++i) {
      OwnedRef module(live(PyTuple_GET_ITEM(modules, i)));
      push_module(out, module.obj);
    }
    out.push_back(kNoDict);  // (where the tensors begin)
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tensors); ++i) {
      OwnedRef tensor(live(PyTuple_GET_ITEM(tensors, i)));
      push_tensor(out, tensor.obj);
    }
    if (call_args != nullptr) {
      out.push_back(kNoDict);  // (where the arguments begin)
      for (Py_ssize_t i = 0; i < PyList_GET_SIZE(call_args); ++i) push_argument(out, PyList_GET_ITEM(call_args, i));
    }
    if (optimizers != nullptr) {
      out.push_back(kNoDict);  // (where the optimizers begin)
      for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(optimizers); ++i) {
        OwnedRef opt(live(PyTuple_GET_ITEM(optimizers, i)));
        push_optimizer(out, opt.obj);
      }
    }
  } catch (const Unusual&) {
    Py_RETURN_NONE;
  } catch (const PythonErrorSet&) {
    return nullptr;
  }
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(out.data()),
                                   static_cast<Py_ssize_t>(out.size() * sizeof(uint64_t)));
}

// addresses(seq) -> bytes: the addresses of seq's items, packed (equal bytes: the same objects, in
// order; list(map(id, seq)) without an int made per item). The guard compares the objects it holds
// weak references to (an optimizer's parameters, gradients) this way.
PyObject* py_addresses(PyObject*, PyObject* seq) {
  PyObject* fast = PySequence_Fast(seq, "addresses(seq) takes a sequence");
  if (fast == nullptr) return nullptr;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  std::vector<uint64_t> out(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) out[i] = reinterpret_cast<uintptr_t>(PySequence_Fast_GET_ITEM(fast, i));
  Py_DECREF(fast);
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(out.data()),
                                   static_cast<Py_ssize_t>(out.size() * sizeof(uint64_t)));
}

// ------------------------------------------------------------------- a frozen replay's passes
// A frozen st.compile replay (frozen_replay.Frozen) reads each input's cell and array before it calls
// its program, and gives each output to its cell after: two loops over a few dozen objects on every
// call (a decode step's), done here in one C pass each. Both do exactly what the Python fallback in
// frozen_replay.py does; any unexpected form raises, and the caller then takes that fallback.
PyObject* name_value = nullptr;
PyObject* name_owned = nullptr;
PyObject* name_leaf = nullptr;
PyObject* name_version = nullptr;

// A cell's fields (graph/ir.py: Cell, a class with __slots__) are read and written straight in its
// slots: through PyObject_GetAttr each access walks the type's attribute cache and calls the slot's
// descriptor, and a replay makes about ten per input (300 inputs: a training step's parameters and
// optimizer state). The offsets come from the class's own member descriptors, taken again whenever
// the class changes (its version tag); a cell of another class, or a slot left unset, takes
// PyObject_GetAttr/SetAttr as before.
struct CellSlots {
  PyTypeObject* type = nullptr;  // (a strong reference once set)
  unsigned int version_tag = 0;
  Py_ssize_t value = -1, owned = -1, leaf = -1, version = -1;
} cell_slots;

Py_ssize_t slot_offset(PyTypeObject* type, PyObject* name) {  // -1: not a plain writable object slot
  PyObject* descr = PyObject_GetAttr(reinterpret_cast<PyObject*>(type), name);
  if (descr == nullptr) {
    PyErr_Clear();
    return -1;
  }
  Py_ssize_t offset = -1;
  if (Py_TYPE(descr) == &PyMemberDescr_Type) {
    PyMemberDef* member = reinterpret_cast<PyMemberDescrObject*>(descr)->d_member;
    if (member->type == T_OBJECT_EX && !(member->flags & READONLY)) offset = member->offset;
  }
  Py_DECREF(descr);
  return offset;
}

bool fast_cell(PyObject* cell) {  // whether cell's fields can be accessed through cell_slots
  PyTypeObject* type = Py_TYPE(cell);
  if (type == cell_slots.type && type->tp_version_tag == cell_slots.version_tag && cell_slots.version_tag != 0)
    return true;
  if (type == cell_slots.type && type->tp_version_tag == cell_slots.version_tag) return false;  // (no tag)
  CellSlots found;
  found.value = slot_offset(type, name_value);
  found.owned = slot_offset(type, name_owned);
  found.leaf = slot_offset(type, name_leaf);
  found.version = slot_offset(type, name_version);
  found.version_tag = type->tp_version_tag;  // (the look-ups above gave the class one, if it can have one)
  if (found.value < 0 || found.owned < 0 || found.leaf < 0 || found.version < 0) found.version_tag = 0;
  Py_INCREF(type);
  found.type = type;
  Py_XDECREF(cell_slots.type);
  cell_slots = found;
  return found.version_tag != 0;
}

PyObject** slot(PyObject* obj, Py_ssize_t offset) {
  return reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset);
}

// a new reference to the field (offset: its slot when fast, else -1) or nullptr with an error set
PyObject* get_field(PyObject* cell, Py_ssize_t offset, PyObject* name) {
  if (offset >= 0) {
    PyObject* value = *slot(cell, offset);
    if (value != nullptr) {
      Py_INCREF(value);
      return value;
    }
  }
  return PyObject_GetAttr(cell, name);  // (an unset slot raises AttributeError here, as in Python)
}

int set_field(PyObject* cell, Py_ssize_t offset, PyObject* name, PyObject* value) {
  if (offset < 0) return PyObject_SetAttr(cell, name, value);
  PyObject** at = slot(cell, offset);
  PyObject* old = *at;
  Py_INCREF(value);
  *at = value;
  Py_XDECREF(old);  // (last: freeing it may run Python)
  return 0;
}

PyObject* deref(PyObject* ref) {  // a new reference to a weak reference's object (None if it died)
  PyObject* obj = PyWeakref_GetObject(ref);  // borrowed
  if (obj == nullptr) throw PythonErrorSet();
  Py_INCREF(obj);
  return obj;
}

// a new list of items's entries at the positions packed in order (int64 each; see replay_gather)
PyObject* picked(PyObject* items, PyObject* order) {
  Py_ssize_t n = PyBytes_GET_SIZE(order) / static_cast<Py_ssize_t>(sizeof(int64_t));
  PyObject* list = PyList_New(n);
  if (list == nullptr) throw PythonErrorSet();
  const char* at = PyBytes_AS_STRING(order);
  for (Py_ssize_t i = 0; i < n; ++i) {
    int64_t k;
    std::memcpy(&k, at + i * sizeof(int64_t), sizeof(int64_t));
    if (k < 0 || k >= PyList_GET_SIZE(items)) {
      Py_DECREF(list);
      PyErr_SetString(PyExc_IndexError, "replay_gather: a call position outside the values read");
      throw PythonErrorSet();
    }
    PyObject* item = PyList_GET_ITEM(items, k);
    Py_INCREF(item);
    PyList_SET_ITEM(list, i, item);
  }
  return list;
}

// replay_gather(flat, arg_positions, old_refs, consts, passed, donated_reads[, call_donated, call_kept])
//   -> None when a closed-over cell died, else (cells, values, passed_ok, owned_ok[, donated, kept]):
// the cells read (the arguments' at arg_positions of flat, then the live old_refs'), their values then
// consts, whether every cell's value is the array that passed last (passed[r]: a weak reference to it,
// or a callable answering None) and whether every donated read (positions into cells) owns its array.
// With call_donated and call_kept (positions into values, packed as int64 bytes), also the
// program's donated and kept arguments, picked from values in its order.
PyObject* py_replay_gather(PyObject*, PyObject* args) {
  PyObject *flat, *positions, *old_refs, *consts, *passed, *donated, *call_donated = nullptr, *call_kept = nullptr;
  if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!|SS:replay_gather", &PyList_Type, &flat, &PyTuple_Type, &positions,
                        &PyTuple_Type, &old_refs, &PyTuple_Type, &consts, &PyList_Type, &passed, &PyTuple_Type,
                        &donated, &call_donated, &call_kept))
    return nullptr;
  Py_ssize_t n_args = PyTuple_GET_SIZE(positions), n_old = PyTuple_GET_SIZE(old_refs);
  Py_ssize_t n_cells = n_args + n_old, n_consts = PyTuple_GET_SIZE(consts);
  if (PyList_GET_SIZE(passed) != n_cells) {
    PyErr_SetString(PyExc_ValueError, "replay_gather: one passed entry per cell read");
    return nullptr;
  }
  try {
    OwnedRef cells(PyList_New(n_cells));
    OwnedRef values(PyList_New(n_cells + n_consts));
    for (Py_ssize_t r = 0; r < n_args; ++r) {
      Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(positions, r));
      if (at == -1 && PyErr_Occurred()) throw PythonErrorSet();
      if (at < 0 || at >= PyList_GET_SIZE(flat)) {
        PyErr_SetString(PyExc_IndexError, "replay_gather: an argument position outside the call's arguments");
        throw PythonErrorSet();
      }
      PyObject* cell = PyObject_GetAttr(PyList_GET_ITEM(flat, at), name_cell);
      if (cell == nullptr) throw PythonErrorSet();
      PyList_SET_ITEM(cells.obj, r, cell);
    }
    for (Py_ssize_t k = 0; k < n_old; ++k) {
      PyObject* ref = PyTuple_GET_ITEM(old_refs, k);
      if (!PyWeakref_CheckRef(ref)) {
        PyErr_SetString(PyExc_TypeError, "replay_gather: old cells are weak references");
        throw PythonErrorSet();
      }
      PyObject* cell = deref(ref);
      if (cell == Py_None) {  // (a closed-over cell died: the replay cannot run)
        Py_DECREF(cell);
        Py_RETURN_NONE;
      }
      PyList_SET_ITEM(cells.obj, n_args + k, cell);
    }
    bool passed_ok = true;
    for (Py_ssize_t r = 0; r < n_cells; ++r) {
      PyObject* cell = PyList_GET_ITEM(cells.obj, r);
      PyObject* value = get_field(cell, fast_cell(cell) ? cell_slots.value : -1, name_value);
      if (value == nullptr) throw PythonErrorSet();
      PyList_SET_ITEM(values.obj, r, value);
      if (passed_ok) {
        PyObject* p = PyList_GET_ITEM(passed, r);
        OwnedRef last(PyWeakref_CheckRef(p) ? deref(p) : PyObject_CallNoArgs(p));
        passed_ok = last.obj == value;
      }
    }
    for (Py_ssize_t k = 0; k < n_consts; ++k) {
      PyObject* c = PyTuple_GET_ITEM(consts, k);
      Py_INCREF(c);
      PyList_SET_ITEM(values.obj, n_cells + k, c);
    }
    bool owned_ok = true;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(donated) && owned_ok; ++k) {
      Py_ssize_t r = PyLong_AsSsize_t(PyTuple_GET_ITEM(donated, k));
      if (r == -1 && PyErr_Occurred()) throw PythonErrorSet();
      if (r < 0 || r >= n_cells) {
        PyErr_SetString(PyExc_IndexError, "replay_gather: a donated read outside the cells read");
        throw PythonErrorSet();
      }
      PyObject* cell = PyList_GET_ITEM(cells.obj, r);
      OwnedRef owned(get_field(cell, fast_cell(cell) ? cell_slots.owned : -1, name_owned));
      int truth = PyObject_IsTrue(owned.obj);
      if (truth < 0) throw PythonErrorSet();
      owned_ok = truth == 1;
    }
    if (call_kept == nullptr)
      return PyTuple_Pack(4, cells.obj, values.obj, passed_ok ? Py_True : Py_False, owned_ok ? Py_True : Py_False);
    OwnedRef donated_values(picked(values.obj, call_donated));
    OwnedRef kept_values(picked(values.obj, call_kept));
    return PyTuple_Pack(6, cells.obj, values.obj, passed_ok ? Py_True : Py_False, owned_ok ? Py_True : Py_False,
                        donated_values.obj, kept_values.obj);
  } catch (const PythonErrorSet&) {
    return nullptr;
  }
}

// replay_store(plan, flat, outs, made[, passed]) -> (cells, refs, befores, owned): give output j to its cell as
// frozen_replay.Frozen._store does. plan[j] = (kind, index, weak reference or None, owned, keep[, read]):
// kind 0, the cell of argument flat[index]; 1, the next of the new cells ``made`` (a returned tensor's);
// 2, the cell behind the weak reference (a closed-over or made cell; skipped, None in cells, if it
// died). Each stored cell gets value=out, _leaf=None, owned, version+1; the lists give, by target, the
// cell, a weak reference to it, its value before if keep else None, and its owned before (None for
// each of the four where it died: the columns of inflight.Entries, without a tuple per target). With
// ``passed`` (replay_gather's list), a target whose read is r >= 0 also sets passed[r] to a weak
// reference to out (what the replay wrote into an input passes as that input next time).
PyObject* py_replay_store(PyObject*, PyObject* args) {
  PyObject *plan, *flat, *outs, *made, *passed = nullptr;
  if (!PyArg_ParseTuple(args, "O!O!OO!|O!:replay_store", &PyTuple_Type, &plan, &PyList_Type, &flat, &outs,
                        &PyList_Type, &made, &PyList_Type, &passed))
    return nullptr;
  try {
    OwnedRef out_seq(PySequence_Fast(outs, "replay_store: the outputs are a sequence"));
    Py_ssize_t n = PyTuple_GET_SIZE(plan);
    if (PySequence_Fast_GET_SIZE(out_seq.obj) != n) {
      PyErr_SetString(PyExc_ValueError, "replay_store: one output per target");
      return nullptr;
    }
    OwnedRef cells(PyList_New(n));
    OwnedRef refs(PyList_New(n));
    OwnedRef befores(PyList_New(n));
    OwnedRef owned_befores(PyList_New(n));
    Py_ssize_t next_made = 0;
    for (Py_ssize_t j = 0; j < n; ++j) {
      PyObject* target = PyTuple_GET_ITEM(plan, j);
      if (!PyTuple_CheckExact(target) || PyTuple_GET_SIZE(target) < 5 || PyTuple_GET_SIZE(target) > 6) {
        PyErr_SetString(PyExc_TypeError, "replay_store: a target is (kind, index, ref, owned, keep[, read])");
        throw PythonErrorSet();
      }
      long kind = PyLong_AsLong(PyTuple_GET_ITEM(target, 0));
      if (kind == -1 && PyErr_Occurred()) throw PythonErrorSet();
      PyObject* cell = nullptr;  // a new reference
      PyObject* ref = nullptr;   // a new reference
      if (kind == 0) {
        Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(target, 1));
        if (at == -1 && PyErr_Occurred()) throw PythonErrorSet();
        if (at < 0 || at >= PyList_GET_SIZE(flat)) {
          PyErr_SetString(PyExc_IndexError, "replay_store: an argument position outside the call's arguments");
          throw PythonErrorSet();
        }
        cell = PyObject_GetAttr(PyList_GET_ITEM(flat, at), name_cell);
      } else if (kind == 1) {
        if (next_made >= PyList_GET_SIZE(made)) {
          PyErr_SetString(PyExc_IndexError, "replay_store: fewer new cells than returned tensors");
          throw PythonErrorSet();
        }
        cell = PyList_GET_ITEM(made, next_made++);
        Py_INCREF(cell);
      } else {
        ref = PyTuple_GET_ITEM(target, 2);
        if (!PyWeakref_CheckRef(ref)) {
          PyErr_SetString(PyExc_TypeError, "replay_store: a closed-over target is a weak reference");
          throw PythonErrorSet();
        }
        Py_INCREF(ref);
        cell = deref(ref);
        if (cell == Py_None) {  // (it died: nothing to store, as in Python)
          Py_DECREF(cell);
          Py_DECREF(ref);
          for (PyObject* column : {cells.obj, refs.obj, befores.obj, owned_befores.obj}) {
            Py_INCREF(Py_None);
            PyList_SET_ITEM(column, j, Py_None);
          }
          continue;
        }
      }
      if (cell == nullptr) {
        Py_XDECREF(ref);
        throw PythonErrorSet();
      }
      OwnedRef held_cell(cell);
      if (ref == nullptr) ref = PyWeakref_NewRef(cell, nullptr);
      OwnedRef held_ref(ref);
      PyObject* out = PySequence_Fast_GET_ITEM(out_seq.obj, j);
      int keep = PyObject_IsTrue(PyTuple_GET_ITEM(target, 4));
      if (keep < 0) throw PythonErrorSet();
      bool fast = fast_cell(cell);
      Py_ssize_t at_value = fast ? cell_slots.value : -1, at_owned = fast ? cell_slots.owned : -1;
      Py_ssize_t at_leaf = fast ? cell_slots.leaf : -1, at_version = fast ? cell_slots.version : -1;
      OwnedRef before(keep ? get_field(cell, at_value, name_value) : (Py_INCREF(Py_None), Py_None));
      OwnedRef owned_before(get_field(cell, at_owned, name_owned));
      Py_INCREF(ref);
      PyList_SET_ITEM(refs.obj, j, ref);
      Py_INCREF(before.obj);
      PyList_SET_ITEM(befores.obj, j, before.obj);
      Py_INCREF(owned_before.obj);
      PyList_SET_ITEM(owned_befores.obj, j, owned_before.obj);
      OwnedRef version(get_field(cell, at_version, name_version));
      OwnedRef one(PyLong_FromLong(1));
      OwnedRef next_version(PyNumber_Add(version.obj, one.obj));
      if (set_field(cell, at_value, name_value, out) < 0 || set_field(cell, at_leaf, name_leaf, Py_None) < 0 ||
          set_field(cell, at_owned, name_owned, PyTuple_GET_ITEM(target, 3)) < 0 ||
          set_field(cell, at_version, name_version, next_version.obj) < 0)
        throw PythonErrorSet();
      if (passed != nullptr && PyTuple_GET_SIZE(target) == 6) {
        Py_ssize_t r = PyLong_AsSsize_t(PyTuple_GET_ITEM(target, 5));
        if (r == -1 && PyErr_Occurred()) throw PythonErrorSet();
        if (r >= PyList_GET_SIZE(passed)) {
          PyErr_SetString(PyExc_IndexError, "replay_store: a read outside the passed list");
          throw PythonErrorSet();
        }
        if (r >= 0) {
          PyObject* passed_ref = PyWeakref_NewRef(out, nullptr);
          if (passed_ref == nullptr) throw PythonErrorSet();
          if (PyList_SetItem(passed, r, passed_ref) < 0) throw PythonErrorSet();  // (steals it)
        }
      }
      Py_INCREF(cell);
      PyList_SET_ITEM(cells.obj, j, cell);
    }
    return PyTuple_Pack(4, cells.obj, refs.obj, befores.obj, owned_befores.obj);
  } catch (const PythonErrorSet&) {
    return nullptr;
  }
}

bool intern_guard_names() {
  const char* names[10] = {"training",           "_parameters",     "_buffers",           "_modules",
                           "_forward_pre_hooks", "_forward_hooks",  "_backward_pre_hooks", "_backward_hooks",
                           "_backward_hooks",    "_post_accumulate_grad_hooks"};
  for (int i = 0; i < 10; ++i) {
    guard_names[i] = PyUnicode_InternFromString(names[i]);
    if (guard_names[i] == nullptr) return false;
  }
  name_requires_grad = PyUnicode_InternFromString("requires_grad");
  name_grad = PyUnicode_InternFromString("grad");
  name_cell = PyUnicode_InternFromString("_cell");
  name_value = PyUnicode_InternFromString("value");
  name_owned = PyUnicode_InternFromString("owned");
  name_leaf = PyUnicode_InternFromString("_leaf");
  name_version = PyUnicode_InternFromString("version");
  name_state = PyUnicode_InternFromString("state");
  name_param_groups = PyUnicode_InternFromString("param_groups");
  name_params = PyUnicode_InternFromString("params");
  name_pre_hooks = PyUnicode_InternFromString("_optimizer_step_pre_hooks");
  name_post_hooks = PyUnicode_InternFromString("_optimizer_step_post_hooks");
  if (name_state == nullptr || name_param_groups == nullptr || name_params == nullptr || name_pre_hooks == nullptr ||
      name_post_hooks == nullptr)
    return false;
  return name_requires_grad != nullptr && name_grad != nullptr && name_cell != nullptr && name_value != nullptr &&
         name_owned != nullptr && name_leaf != nullptr && name_version != nullptr;
}

PyMethodDef methods[] = {
    {"set_geometry", py_set_geometry, METH_VARARGS, "set_geometry(t, sizes, strides, storage_offset)"},
    {"share_storage", py_share_storage, METH_VARARGS, "share_storage(t, src): t uses src's storage"},
    {"fresh_storage", py_fresh_storage, METH_VARARGS, "fresh_storage(t, nbytes): t gets a storage of its own"},
    {"forget_view_replay", py_forget_view_replay, METH_O, "forget_view_replay(t): autograd rebuilds t with as_strided"},
    {"register_backend", py_register_backend, METH_NOARGS, "register the device guard and hooks (once)"},
    {"guard_fingerprint", py_guard_fingerprint, METH_VARARGS,
     "guard_fingerprint(modules, tensors[, args[, optimizers]]): bytes of their guarded state, or None "
     "(see replay_guard)"},
    {"addresses", py_addresses, METH_O, "addresses(seq): bytes of the addresses of seq's items (see replay_guard)"},
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
