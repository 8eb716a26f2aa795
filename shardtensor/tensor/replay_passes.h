// Part of device_guard.cpp, compiled as one unit with it (included inside its anonymous
// namespace; setup.py and device.py hash the three files together): a frozen replay's gather and store passes.
#pragma once

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
