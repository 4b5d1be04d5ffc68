/* The Python records the kernels read and write in place: the allocator's per-request
 * state (``_Running``), ``Request``, ``Allocated`` and ``CachedPrefix``, all __slots__ classes. Their slot
 * offsets come from the classes' member descriptors (register_types), so a field is one
 * load instead of an attribute lookup. An object of another class is not read this way:
 * the kernels then take the general path. */
#ifndef KVSPEC_RECORDS_H
#define KVSPEC_RECORDS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* _Running's fields the kernels use. */
enum {
    STATE_COMPUTED,
    STATE_END_LIMIT,
    STATE_KNOWN_LIMIT,
    STATE_COMPUTED_LIMIT,
    STATE_BLOCKS,
    STATE_NUM_REAL,
    STATE_NUM_CACHED,
    STATE_CACHE_AT,
    STATE_REQUEST,
    STATE_NUM_SKIPPED,
    STATE_FIELDS
};
/* Request's. */
enum {
    REQUEST_ID,
    REQUEST_TOKEN_IDS,
    REQUEST_BLOCK_HASHES,
    REQUEST_HASH_OWNER,
    REQUEST_MM_INPUTS,
    REQUEST_CACHE_SALT,
    REQUEST_LORA_NAME,
    REQUEST_NUM_ENCODER_TOKENS,
    REQUEST_FIELDS
};

/* CachedPrefix's. */
enum {
    PREFIX_REQUEST_ID,
    PREFIX_NUM_TOKENS,
    PREFIX_BLOCK_IDS,
    PREFIX_EPOCHS,
    PREFIX_CHECKPOINT_AT,
    PREFIX_FIELDS
};

/* NULL until register_types ran. */
extern PyTypeObject *kv_state_type, *kv_request_type, *kv_allocated_type, *kv_prefix_type;
extern Py_ssize_t kv_state_offsets[STATE_FIELDS], kv_request_offsets[REQUEST_FIELDS],
    kv_allocated_offset, kv_prefix_offsets[PREFIX_FIELDS];
/* The field names, by index (interned). */
extern PyObject *kv_state_names[STATE_FIELDS];

/* Field at ``offset`` of a registered record (borrowed; NULL if unset). */
static inline PyObject *record_get(PyObject *record, Py_ssize_t offset) {
    return *(PyObject **)((char *)record + offset);
}

/* Set the field at ``offset`` to ``value`` (a new reference, stolen). */
static inline void record_set(PyObject *record, Py_ssize_t offset, PyObject *value) {
    PyObject **slot = (PyObject **)((char *)record + offset);
    PyObject *old = *slot;
    *slot = value;
    Py_XDECREF(old);
}

/* A new instance of registered record class ``type`` without an __init__ call, field i at
 * ``offsets[i]`` set to ``values[i]`` (``count`` new references, stolen; released on
 * failure, and a NULL among them is a failure); NULL with an exception. */
static inline PyObject *new_record(PyTypeObject *type, const Py_ssize_t *offsets,
                                   PyObject **values, int count) {
    PyObject *record = NULL;
    int complete = 1;
    for (int i = 0; i < count; i++) complete &= values[i] != NULL;
    if (complete) record = type->tp_alloc(type, 0);
    for (int i = 0; i < count; i++) {
        if (record != NULL) record_set(record, offsets[i], values[i]);
        else Py_XDECREF(values[i]);
    }
    return record;
}

/* Allocated(new_block_ids=per_group), its one slot filled directly (steals ``per_group``,
 * which is released on failure); NULL with an exception. */
static inline PyObject *new_allocated(PyObject *per_group) {
    PyObject *result = kv_allocated_type->tp_alloc(kv_allocated_type, 0);
    if (result == NULL) {
        Py_DECREF(per_group);
        return NULL;
    }
    record_set(result, kv_allocated_offset, per_group);
    return result;
}

/* Allocated(new_block_ids=(tuple(taken),)) of a one-group allocator (``taken``: the list
 * of blocks the group received, NULL for none); NULL with an exception. */
static inline PyObject *new_allocated_one(PyObject *taken) {
    PyObject *ids = taken == NULL ? PyTuple_New(0) : PyList_AsTuple(taken);
    PyObject *per_group = ids == NULL ? NULL : PyTuple_Pack(1, ids);
    Py_XDECREF(ids);
    return per_group == NULL ? NULL : new_allocated(per_group);
}

/* Whether ``id`` is an exact str or int: what the allocator keys requests by (hashing and
 * comparing one runs no code of the caller's, and it is equal to itself). */
static inline int kv_is_request_id(PyObject *id) {
    return id != NULL && (PyUnicode_CheckExact(id) || PyLong_CheckExact(id));
}

/* A registered record's int field: 0, 1 when unset or not an exact int (the step is left to
 * the Python method), -1 on an error. */
static inline int record_ssize(PyObject *record, Py_ssize_t offset, Py_ssize_t *value) {
    PyObject *item = record_get(record, offset);
    if (item == NULL || !PyLong_CheckExact(item)) return 1;
    *value = PyLong_AsSsize_t(item);
    return (*value == -1 && PyErr_Occurred()) ? -1 : 0;
}

static inline int record_set_ssize(PyObject *record, Py_ssize_t offset, Py_ssize_t value) {
    PyObject *item = PyLong_FromSsize_t(value);
    if (item == NULL) return -1;
    record_set(record, offset, item);
    return 0;
}

/* ``list[index]`` of a per-group list: 0, 1 if it is not a list with an exact int there,
 * -1 on an error. */
static inline int list_ssize(PyObject *list, Py_ssize_t index, Py_ssize_t *value) {
    if (list == NULL || !PyList_CheckExact(list) || PyList_GET_SIZE(list) <= index
        || !PyLong_CheckExact(PyList_GET_ITEM(list, index)))
        return 1;
    *value = PyLong_AsSsize_t(PyList_GET_ITEM(list, index));
    return (*value == -1 && PyErr_Occurred()) ? -1 : 0;
}

static inline int list_set_ssize(PyObject *list, Py_ssize_t index, Py_ssize_t value) {
    PyObject *item = PyLong_FromSsize_t(value);
    if (item == NULL) return -1;
    return PyList_SetItem(list, index, item); /* steals item */
}

/* register_types(state_class, request_class, allocated_class, prefix_class). */
PyObject *kv_py_register_types(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif
