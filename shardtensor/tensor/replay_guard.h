// Part of device_guard.cpp, compiled as one unit with it (included inside its anonymous
// namespace; setup.py and device.py hash the three files together): the replay guard's reads.
#pragma once

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
