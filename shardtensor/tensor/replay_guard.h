// Part of device_guard.cpp, compiled as one unit with it (included inside its anonymous
// namespace; setup.py and device.py hash the three files together): the replay guard's reads.
#pragma once

// ------------------------------------------------------------------- a tensor's guarded state
// A frozen st.compile replay checks that the tensors its trace depended on are as they were: their
// requires_grad, hooks and .grad (and a call's tensor arguments the same, by position). push_tensor
// reads that into words (equal words: the same state); replay_state.h's plans use it for tensors it
// cannot read straight from torch's object. Objects are recorded by address (the guard holds a weak
// reference to each, and one dying fails it, so an address cannot be reused unseen), hook handles by
// their ids. arguments_state answers None for an argument whose state is not in torch's form (the
// guard then reads it in Python).
PyObject* guard_names[10] = {};  // (8, 9: the 2 tensor hook attributes)
PyObject* name_requires_grad = nullptr;
PyObject* name_grad = nullptr;
PyObject* name_cell = nullptr;
constexpr uint64_t kNoDict = ~uint64_t{0};

struct Unusual {};  // the state is not in the expected form: answer None

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

// arguments_state(args) -> bytes, or None: a call's tensor arguments' requires_grad, hooks and (a
// leaf's) .grad, read directly (None if one cannot be)
PyObject* py_arguments_state(PyObject*, PyObject* args) {
  if (!PyList_Check(args)) {
    PyErr_SetString(PyExc_TypeError, "arguments_state(args) takes a list of tensors");
    return nullptr;
  }
  std::vector<uint64_t> out;
  out.reserve(static_cast<size_t>(8 * PyList_GET_SIZE(args)));
  try {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(args); ++i) push_argument(out, PyList_GET_ITEM(args, i));
  } catch (const Unusual&) {
    Py_RETURN_NONE;
  } catch (const PythonErrorSet&) {
    return nullptr;
  }
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(out.data()),
                                   static_cast<Py_ssize_t>(out.size() * sizeof(uint64_t)));
}
