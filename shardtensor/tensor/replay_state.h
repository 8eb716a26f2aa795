// Part of device_guard.cpp, compiled as one unit with it (included inside its anonymous
// namespace; setup.py and device.py hash the files together): what an st.compile trace read of the
// Python world, and the check that it is unchanged (shardtensor/replay_guard.py).
#pragma once

#include <frameobject.h>

#include <unordered_map>

// ------------------------------------------------------------------------- version tags
// CPython 3.11 gives every dict a version tag that changes with each modification (PEP 509:
// ma_version_tag, from one process-wide counter, so two tags are equal only if the dict did not
// change), and every class one that is cleared when it or a base changes (tp_version_tag). A guard
// compares them instead of the contents. 3.12 deprecates the dict's tag: without it the functions
// answer None, and st.compile then never freezes (it runs the function's Python on every call).
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
#define SHARDTENSOR_DICT_TAGS 1
uint64_t dict_tag(PyObject* d) { return reinterpret_cast<PyDictObject*>(d)->ma_version_tag; }
#else
#define SHARDTENSOR_DICT_TAGS 0
uint64_t dict_tag(PyObject*) { return 0; }
#endif

PyObject* py_dict_version(PyObject*, PyObject* d) {  // dict_version(d) -> int, or None
  if (!PyDict_Check(d)) {
    PyErr_SetString(PyExc_TypeError, "dict_version(d) takes a dict");
    return nullptr;
  }
  if (!SHARDTENSOR_DICT_TAGS) Py_RETURN_NONE;
  return PyLong_FromUnsignedLongLong(dict_tag(d));
}

unsigned int type_tag(PyTypeObject* type) {  // 0: none now (the type changed since its last lookup)
  return PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG) ? type->tp_version_tag : 0;
}

PyObject* py_type_version(PyObject*, PyObject* t) {  // type_version(cls) -> int (0: cannot be tagged)
  if (!PyType_Check(t)) {
    PyErr_SetString(PyExc_TypeError, "type_version(cls) takes a class");
    return nullptr;
  }
  auto* type = reinterpret_cast<PyTypeObject*>(t);
  if (!PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG)) {
    static PyObject* probe = PyUnicode_InternFromString("__shardtensor_version_probe__");
    (void)_PyType_Lookup(type, probe);  // (a lookup assigns the tag when the class can have one)
  }
  return PyLong_FromUnsignedLong(type_tag(type));
}

// ------------------------------------------------------------------- what a trace runs
// reads_begin(owner, classify, classify_c) installs a profile function on this thread until
// reads_end(): for each Python
// frame run it keeps its code and globals (the guard then reads the names that code loads as
// globals), and for each C function called it asks state.classify_c once per method definition
// whether a replay could repeat it (a clock, a random source, output: a reason string, else None),
// keeping the first reason. classify(code) says whose code it is (low 4 bits: 0 the user's, 1
// shardtensor's, 2 a library's; above them, for a generator's code, the offset of its first RESUME
// + 1). Frames of shardtensor's own code, and library code run under them, are skipped, as are C
// calls under them; a user's code run under them (a backward hook) is kept. A profile function already set (a
// profiler) is called first, as before, and put back at the end.
struct ReadsState {
  PyObject* owner = nullptr;  // the Python object holding classify, classify_c and the results
  PyObject* classify = nullptr;
  PyObject* classify_c = nullptr;
  Py_tracefunc previous = nullptr;
  PyObject* previous_obj = nullptr;
  int internal_depth = 0;
  std::unordered_map<PyObject*, int> code_kind;  // code -> 0 user, 1 shardtensor, 2 library (strong keys)
  std::unordered_map<const void*, PyObject*> c_kind;  // method def -> reason or Py_None (strong values)
  std::unordered_map<PyObject*, PyObject*> codes;  // code -> globals, each run (strong both)
  PyObject* reason = nullptr;  // the first C call a replay could not repeat (strong)
  PyObject* resumed = nullptr;  // the code of the first generator resumed that began before the trace (strong)
  std::unordered_map<PyObject*, int> started;  // generators started in the trace (strong keys)
  bool failed = false;
};
thread_local ReadsState* reads = nullptr;  // (profile functions are per thread, as traces are)

void reads_clear(ReadsState* s) {
  for (auto& kv : s->code_kind) Py_DECREF(kv.first);
  for (auto& kv : s->c_kind) Py_DECREF(kv.second);
  for (auto& kv : s->codes) {
    Py_DECREF(kv.first);
    Py_DECREF(kv.second);
  }
  for (auto& kv : s->started) Py_DECREF(kv.first);
  Py_XDECREF(s->reason);
  Py_XDECREF(s->resumed);
  Py_XDECREF(s->owner);
  Py_XDECREF(s->classify);
  Py_XDECREF(s->classify_c);
  Py_XDECREF(s->previous_obj);
  delete s;
}

int code_kind_of(ReadsState* s, PyObject* code) {
  auto found = s->code_kind.find(code);
  if (found != s->code_kind.end()) return found->second;
  PyObject* kind = PyObject_CallOneArg(s->classify, code);
  if (kind == nullptr) return -1;
  long k = PyLong_AsLong(kind);
  Py_DECREF(kind);
  if (k == -1 && PyErr_Occurred()) return -1;
  Py_INCREF(code);
  s->code_kind.emplace(code, static_cast<int>(k));
  return static_cast<int>(k);
}

int note_frame(ReadsState* s, PyFrameObject* frame, int kind_bits) {
  PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
  PyObject* key = reinterpret_cast<PyObject*>(code);
  if (s->codes.find(key) == s->codes.end()) {
    PyObject* globals = PyFrame_GetGlobals(frame);  // new reference
    if (globals == nullptr) {
      Py_DECREF(code);
      return -1;
    }
    s->codes.emplace(key, globals);  // (keeps both references)
  } else {
    Py_DECREF(code);
  }
  // a generator (or coroutine) resumed past its start that was not started in this trace began
  // before it: a replay would not advance it (classify gives the offset of its first RESUME + 1)
  int start = kind_bits >> 4;
  if (start > 0 && s->resumed == nullptr) {
    PyObject* gen = PyFrame_GetGenerator(frame);  // new reference (or NULL)
    if (gen != nullptr) {
      if (PyFrame_GetLasti(frame) == start - 1) {
        if (!s->started.emplace(gen, 0).second) Py_DECREF(gen);  // (the map keeps the reference)
      } else {
        if (s->started.find(gen) == s->started.end()) {
          s->resumed = reinterpret_cast<PyObject*>(PyFrame_GetCode(frame));
        }
        Py_DECREF(gen);
      }
    }
  }
  return 0;
}

int reads_profile(PyObject* obj, PyFrameObject* frame, int what, PyObject* arg) {
  ReadsState* s = reads;
  if (s != nullptr && s->previous != nullptr) {
    if (s->previous(s->previous_obj, frame, what, arg) < 0) return -1;
  }
  if (s == nullptr || s->failed || obj != s->owner) return 0;
  if (what == PyTrace_CALL || what == PyTrace_RETURN) {
    PyCodeObject* code = PyFrame_GetCode(frame);
    int bits = code_kind_of(s, reinterpret_cast<PyObject*>(code));
    Py_DECREF(code);
    int kind = bits & 15;
    if (bits < 0) {
      s->failed = true;  // (the error is reported by reads_end)
      return -1;
    }
    if (kind == 1) {
      s->internal_depth += what == PyTrace_CALL ? 1 : -1;
      if (s->internal_depth < 0) s->internal_depth = 0;  // (a frame that began before the trace returned)
      return 0;
    }
    if (what == PyTrace_CALL && (s->internal_depth == 0 || kind == 0)) {
      if (note_frame(s, frame, bits) < 0) {
        s->failed = true;
        return -1;
      }
    }
    return 0;
  }
  if (what == PyTrace_C_CALL && s->internal_depth == 0 && s->reason == nullptr && PyCFunction_Check(arg)) {
    // (keyed by the method definition and whether the caller is the user's code: classify_c is told)
    PyCodeObject* code = PyFrame_GetCode(frame);
    int bits = code_kind_of(s, reinterpret_cast<PyObject*>(code));
    Py_DECREF(code);
    if (bits < 0) {
      s->failed = true;
      return -1;
    }
    const void* def = reinterpret_cast<const char*>(reinterpret_cast<PyCFunctionObject*>(arg)->m_ml) +
                      ((bits & 15) == 0 ? 0 : 1);
    auto found = s->c_kind.find(def);
    PyObject* reason;
    if (found != s->c_kind.end()) {
      reason = found->second;
    } else {
      PyObject* user = (reinterpret_cast<uintptr_t>(def) & 1) ? Py_False : Py_True;
      reason = PyObject_CallFunctionObjArgs(s->classify_c, arg, user, nullptr);
      if (reason == nullptr) {
        s->failed = true;
        return -1;
      }
      s->c_kind.emplace(def, reason);  // (keeps the reference)
    }
    if (reason != Py_None) {
      Py_INCREF(reason);
      s->reason = reason;
    }
  }
  return 0;
}

PyObject* py_reads_begin(PyObject*, PyObject* args) {  // reads_begin(owner, classify, classify_c)
  PyObject *owner, *classify, *classify_c;
  if (!PyArg_ParseTuple(args, "OOO:reads_begin", &owner, &classify, &classify_c)) return nullptr;
  if (reads != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "reads_begin: a recording is already running on this thread");
    return nullptr;
  }
  auto* s = new ReadsState();
  PyThreadState* tstate = PyThreadState_Get();
  s->previous = tstate->c_profilefunc;
  s->previous_obj = tstate->c_profileobj;
  Py_XINCREF(s->previous_obj);
  s->owner = owner;
  s->classify = classify;
  s->classify_c = classify_c;
  Py_INCREF(owner);
  Py_INCREF(classify);
  Py_INCREF(classify_c);
  reads = s;
  PyEval_SetProfile(reads_profile, owner);
  Py_RETURN_NONE;
}

// reads_end() -> (codes: list of (code, globals), reason or None, resumed generator's code or None):
// the profile function set before is put back; an error raised by a classifier is raised here.
PyObject* py_reads_end(PyObject*, PyObject*) {
  ReadsState* s = reads;
  if (s == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "reads_end: no recording is running");
    return nullptr;
  }
  reads = nullptr;
  PyEval_SetProfile(s->previous, s->previous_obj);
  PyObject* codes = PyList_New(0);
  PyObject* result = nullptr;
  if (codes != nullptr && !s->failed) {
    bool ok = true;
    for (auto& kv : s->codes) {
      PyObject* pair = PyTuple_Pack(2, kv.first, kv.second);
      if (pair == nullptr || PyList_Append(codes, pair) < 0) ok = false;
      Py_XDECREF(pair);
      if (!ok) break;
    }
    if (ok)
      result = PyTuple_Pack(3, codes, s->reason != nullptr ? s->reason : Py_None,
                            s->resumed != nullptr ? s->resumed : Py_None);
  }
  Py_XDECREF(codes);
  bool failed = s->failed;
  reads_clear(s);
  if (failed && !PyErr_Occurred())
    PyErr_SetString(PyExc_RuntimeError, "reads_end: classifying the code a trace ran failed");
  return result;
}

// ------------------------------------------------------------------------------ the check
// A plan is a list of entries in the order the guard's walk found them, parents before what they
// hold. Each names its object by address: a root the guard keeps alive or watches with a weak
// reference (its death fails the guard before any entry is read), or something held by an earlier
// entry's object, alive as long as that entry passed (so the check stops at the first failure).
// Objects an entry compares by identity are kept alive by the guard, or are dicts that carry a tag
// of their own. state_holds(plan) -> bool. Entries (tuples of ints, the first the kind):
enum EntryKind {
  kDict = 0,      // (0, dict, tag): unchanged
  kObject = 1,    // (1, obj, type, dict or 0, tag): its class and its __dict__ (the same dict, unchanged)
  kType = 2,      // (2, class, version tag): unchanged
  kList = 3,      // (3, list, bytes of its items' addresses): the same items
  kCell = 4,      // (4, cell, content or 0): the same content
  kFunction = 5,  // (5, function, code, defaults, kwdefaults, __dict__): the same (0: none)
  kGlobals = 6,   // (6, dict, tag, names, bytes of their values' addresses (0: absent)); the tag is updated
  kTensor = 7,    // (7, tensor, bytes of its state as tensor_state reads it)
  kUnique = 8,    // (8, tensor, cell): no other Python reference to the tensor (its .grad) nor to its cell
  kSet = 9,       // (9, set, tuple of its items): the same items
  kBytes = 10,    // (10, obj, bytes): a buffer (bytearray, small numpy array) holding these bytes
  kFastTensor = 11,  // (11, tensor): as kTensor, read straight from torch's object (state_plan reads it now)
};

struct Entry {
  int kind;
  PyObject* obj;
  uint64_t a = 0, b = 0, c = 0, d = 0;
  uint64_t f[6] = {};  // (kFastTensor's fields)
  PyObject* extra = nullptr;  // (strong) bytes, names tuple or items tuple
  PyObject* extra2 = nullptr;
};

// A tensor's guarded state in six words, read from torch 2.13's object without a call: requires_grad,
// its .grad's TensorImpl, its two hook dicts (address and version tag: a hook added or removed
// changes the tag) and its __dict__ (address and tag: shardtensor's storage cell and the user's
// attributes). Only for a tensor reads_directly accepts (its type takes these from TensorBase).
bool fast_tensor_state(PyObject* t, uint64_t out[6]) {
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 13
  if (!reads_directly(t)) return false;
  auto* object = reinterpret_cast<TensorObject*>(t);
  c10::TensorImpl* impl = object->cdata.unsafeGetTensorImpl();
  if (impl->device_type() == c10::DeviceType::CPU) return false;  // (its values: the slow form has them)
  PyObject** slot = _PyObject_GetDictPtr(t);
  PyObject* d = slot == nullptr ? nullptr : *slot;
  PyObject* hooks[2] = {object->backward_hooks, object->post_accumulate_grad_hooks};
  out[0] = impl->requires_grad();
  out[1] = reinterpret_cast<uintptr_t>(impl->grad().unsafeGetTensorImpl());
  for (int i = 0; i < 2; ++i) {
    PyObject* h = hooks[i];
    out[2 + i] = h == nullptr ? 0 : (reinterpret_cast<uintptr_t>(h) ^ (PyDict_Check(h) ? dict_tag(h) << 1 : 1));
  }
  out[4] = reinterpret_cast<uintptr_t>(d);
  out[5] = d == nullptr ? 0 : dict_tag(d);
  return true;
#else
  (void)t;
  (void)out;
  return false;
#endif
}

struct Plan {
  std::vector<Entry> entries;
  ~Plan() {
    for (auto& e : entries) {
      Py_XDECREF(e.extra);
      Py_XDECREF(e.extra2);
    }
  }
};

void tensor_state(std::vector<uint64_t>& out, PyObject* t);

PyObject* object_dict(PyObject* obj) {  // borrowed __dict__ of obj, made if it has none yet; nullptr: no dict
  PyObject** slot = _PyObject_GetDictPtr(obj);
  if (slot == nullptr) return nullptr;
  if (*slot == nullptr) {
    PyObject* d = PyObject_GenericGetDict(obj, nullptr);
    if (d == nullptr) {
      PyErr_Clear();
      return nullptr;
    }
    Py_DECREF(d);  // (the object holds it)
  }
  return *slot;
}

bool entry_holds(Entry& e) {
  switch (e.kind) {
    case kDict:
      return dict_tag(e.obj) == e.a;
    case kObject: {
      if (reinterpret_cast<uint64_t>(Py_TYPE(e.obj)) != e.a) return false;
      if (e.b == 0) return true;
      PyObject** slot = _PyObject_GetDictPtr(e.obj);
      return slot != nullptr && reinterpret_cast<uint64_t>(*slot) == e.b && dict_tag(*slot) == e.c;
    }
    case kType:
      return type_tag(reinterpret_cast<PyTypeObject*>(e.obj)) == e.a && e.a != 0;
    case kList: {
      Py_ssize_t n = PyList_GET_SIZE(e.obj);
      if (static_cast<size_t>(n) * sizeof(PyObject*) != static_cast<size_t>(PyBytes_GET_SIZE(e.extra))) return false;
      return n == 0 || std::memcmp(reinterpret_cast<PyListObject*>(e.obj)->ob_item, PyBytes_AS_STRING(e.extra),
                                   static_cast<size_t>(n) * sizeof(PyObject*)) == 0;
    }
    case kCell:
      return reinterpret_cast<uint64_t>(PyCell_GET(e.obj)) == e.a;
    case kFunction: {
      auto* f = reinterpret_cast<PyFunctionObject*>(e.obj);
      return reinterpret_cast<uint64_t>(f->func_code) == e.a && reinterpret_cast<uint64_t>(f->func_defaults) == e.b &&
             reinterpret_cast<uint64_t>(f->func_kwdefaults) == e.c && reinterpret_cast<uint64_t>(f->func_dict) == e.d;
    }
    case kGlobals: {
      if (dict_tag(e.obj) == e.a) return true;
      const uint64_t* expected = reinterpret_cast<const uint64_t*>(PyBytes_AS_STRING(e.extra2));
      for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(e.extra); ++i) {
        PyObject* now = PyDict_GetItemWithError(e.obj, PyTuple_GET_ITEM(e.extra, i));  // borrowed
        if (now == nullptr && PyErr_Occurred()) throw PythonErrorSet();
        if (reinterpret_cast<uint64_t>(now) != expected[i]) return false;
      }
      e.a = dict_tag(e.obj);  // (the names read are as they were: later changes are compared from here)
      return true;
    }
    case kFastTensor: {
      uint64_t now[6];
      return fast_tensor_state(e.obj, now) && std::memcmp(now, e.f, sizeof(now)) == 0;
    }
    case kTensor: {
      std::vector<uint64_t> now;
      now.reserve(16);
      tensor_state(now, e.obj);
      return static_cast<size_t>(PyBytes_GET_SIZE(e.extra)) == now.size() * sizeof(uint64_t) &&
             std::memcmp(PyBytes_AS_STRING(e.extra), now.data(), now.size() * sizeof(uint64_t)) == 0;
    }
    case kUnique: {
      // the tensor is held by its C++ owner (a .grad) and the guard's check only: its one Python
      // reference belongs to torch's TensorImpl; its cell is held by its __dict__ alone
      return Py_REFCNT(e.obj) == static_cast<Py_ssize_t>(e.a) && Py_REFCNT(reinterpret_cast<PyObject*>(e.b)) == 1;
    }
    case kSet: {
      if (PySet_GET_SIZE(e.obj) != PyTuple_GET_SIZE(e.extra)) return false;
      for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(e.extra); ++i) {
        int has = PySet_Contains(e.obj, PyTuple_GET_ITEM(e.extra, i));
        if (has < 0) throw PythonErrorSet();
        if (!has) return false;
      }
      return true;
    }
    case kBytes: {
      Py_buffer view;
      if (PyObject_GetBuffer(e.obj, &view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        return false;
      }
      bool same = view.len == PyBytes_GET_SIZE(e.extra) &&
                  std::memcmp(view.buf, PyBytes_AS_STRING(e.extra), static_cast<size_t>(view.len)) == 0;
      PyBuffer_Release(&view);
      return same;
    }
    default:
      return false;
  }
}

void plan_free(PyObject* capsule) { delete static_cast<Plan*>(PyCapsule_GetPointer(capsule, "shardtensor.plan")); }

uint64_t as_address(PyObject* v) {
  uint64_t x = PyLong_AsUnsignedLongLong(v);
  if (x == static_cast<uint64_t>(-1) && PyErr_Occurred()) throw PythonErrorSet();
  return x;
}

// state_plan(entries) -> capsule: the entries (see EntryKind) packed for state_holds
PyObject* py_state_plan(PyObject*, PyObject* entries) {
  if (!PyList_Check(entries)) {
    PyErr_SetString(PyExc_TypeError, "state_plan(entries) takes a list of tuples");
    return nullptr;
  }
  auto* plan = new Plan();
  try {
    plan->entries.reserve(static_cast<size_t>(PyList_GET_SIZE(entries)));
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(entries); ++i) {
      PyObject* t = PyList_GET_ITEM(entries, i);
      if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 2) {
        PyErr_SetString(PyExc_TypeError, "state_plan: each entry is a tuple (kind, address, ...)");
        throw PythonErrorSet();
      }
      Entry e;
      e.kind = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(t, 0)));
      e.obj = reinterpret_cast<PyObject*>(as_address(PyTuple_GET_ITEM(t, 1)));
      Py_ssize_t n = PyTuple_GET_SIZE(t);
      auto field = [&](Py_ssize_t k) { return PyTuple_GET_ITEM(t, k); };
      auto number = [&](Py_ssize_t k) { return k < n ? as_address(field(k)) : 0; };
      auto object = [&](Py_ssize_t k, bool bytes) {
        PyObject* o = field(k);
        if (bytes ? !PyBytes_Check(o) : !PyTuple_Check(o)) {
          PyErr_SetString(PyExc_TypeError, "state_plan: an entry's bytes or tuple field has another type");
          throw PythonErrorSet();
        }
        Py_INCREF(o);
        return o;
      };
      switch (e.kind) {
        case kList:
        case kTensor:
        case kBytes:
          e.extra = object(2, true);
          break;
        case kSet:
          e.extra = object(2, false);
          break;
        case kFastTensor:
          if (!fast_tensor_state(e.obj, e.f)) {
            PyErr_SetString(PyExc_ValueError, "state_plan: a tensor entry that cannot be read directly");
            throw PythonErrorSet();
          }
          break;
        case kGlobals:
          e.a = number(2);
          e.extra = object(3, false);
          e.extra2 = object(4, true);
          break;
        default:
          e.a = number(2);
          e.b = number(3);
          e.c = number(4);
          e.d = number(5);
      }
      plan->entries.push_back(e);
    }
  } catch (const PythonErrorSet&) {
    delete plan;
    return nullptr;
  }
  return PyCapsule_New(plan, "shardtensor.plan", plan_free);
}

// state_holds(plan) -> bool; state_failing(plan) -> index of the first entry that fails, or -1
Py_ssize_t first_failing(PyObject* capsule) {
  auto* plan = static_cast<Plan*>(PyCapsule_GetPointer(capsule, "shardtensor.plan"));
  if (plan == nullptr) throw PythonErrorSet();
  for (size_t i = 0; i < plan->entries.size(); ++i)
    if (!entry_holds(plan->entries[i])) return static_cast<Py_ssize_t>(i);
  return -1;
}

PyObject* py_state_holds(PyObject*, PyObject* capsule) {
  try {
    if (first_failing(capsule) < 0) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
  } catch (const PythonErrorSet&) {
    return nullptr;
  }
}

PyObject* py_state_failing(PyObject*, PyObject* capsule) {
  try {
    return PyLong_FromSsize_t(first_failing(capsule));
  } catch (const PythonErrorSet&) {
    return nullptr;
  }
}

// tensor_state(t) -> bytes: what a kTensor entry compares (its requires_grad, hook dicts, .grad, and
// its __dict__'s tag: shardtensor's storage cell and the user's attributes; a CPU tensor's version,
// data address and geometry too: what its values and shape are)
void tensor_state(std::vector<uint64_t>& out, PyObject* t) {
  push_tensor(out, t);
  PyObject* d = object_dict(t);
  out.push_back(d == nullptr ? 0 : dict_tag(d));
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 13
  at::Tensor tensor = reads_directly(t) ? reinterpret_cast<TensorObject*>(t)->cdata : unpack_tensor(t);
#else
  at::Tensor tensor = unpack_tensor(t);
#endif
  if (tensor.device().type() == c10::DeviceType::CPU) {
    c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
    out.push_back(static_cast<uint64_t>(tensor._version()));
    out.push_back(reinterpret_cast<uintptr_t>(impl->has_storage() ? impl->storage().data() : nullptr));
    out.push_back(static_cast<uint64_t>(tensor.scalar_type()));
    out.push_back(static_cast<uint64_t>(tensor.storage_offset()));
    for (int64_t s : tensor.sizes()) out.push_back(static_cast<uint64_t>(s));
    out.push_back(kNoDict);
    for (int64_t s : tensor.strides()) out.push_back(static_cast<uint64_t>(s));
  }
}

PyObject* py_tensor_fast(PyObject*, PyObject* t) {  // tensor_fast(t): whether a kFastTensor entry can watch t
  uint64_t out[6];
  try {
    if (fast_tensor_state(t, out)) Py_RETURN_TRUE;
  } catch (const PythonErrorSet&) {
    return nullptr;
  }
  Py_RETURN_FALSE;
}

PyObject* py_tensor_state(PyObject*, PyObject* t) {
  std::vector<uint64_t> out;
  try {
    tensor_state(out, t);
  } catch (const PythonErrorSet&) {
    return nullptr;
  } catch (const Unusual&) {
    PyErr_SetString(PyExc_TypeError, "tensor_state: a tensor whose hooks are not in torch's form");
    return nullptr;
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    return nullptr;
  }
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(out.data()),
                                   static_cast<Py_ssize_t>(out.size() * sizeof(uint64_t)));
}
