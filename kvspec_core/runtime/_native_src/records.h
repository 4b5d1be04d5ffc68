/* The Python records the kernels read and write in place: the allocator's per-request
 * state (``_Running``), ``Request`` and ``Allocated``, all __slots__ classes. Their slot
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
    STATE_FIELDS
};
/* Request's. */
enum {
    REQUEST_ID,
    REQUEST_TOKEN_IDS,
    REQUEST_BLOCK_HASHES,
    REQUEST_HASH_OWNER,
    REQUEST_MM_INPUTS,
    REQUEST_FIELDS
};

/* NULL until register_types ran. */
extern PyTypeObject *kv_state_type, *kv_request_type, *kv_allocated_type;
extern Py_ssize_t kv_state_offsets[STATE_FIELDS], kv_request_offsets[REQUEST_FIELDS],
    kv_allocated_offset;
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

/* register_types(state_class, request_class, allocated_class). */
PyObject *kv_py_register_types(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif
