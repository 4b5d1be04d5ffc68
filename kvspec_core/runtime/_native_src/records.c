/* register_types: where the fields of the records in records.h sit in their instances. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <structmember.h> /* T_OBJECT_EX: the member type of __slots__ fields */

#include "records.h"

PyTypeObject *kv_state_type, *kv_request_type, *kv_allocated_type, *kv_prefix_type;
Py_ssize_t kv_state_offsets[STATE_FIELDS], kv_request_offsets[REQUEST_FIELDS],
    kv_allocated_offset, kv_prefix_offsets[PREFIX_FIELDS];
PyObject *kv_state_names[STATE_FIELDS];

static const char *state_fields[STATE_FIELDS] = {
    "computed", "end_limit", "known_limit", "computed_limit",
    "blocks", "num_real", "num_cached", "cache_at", "request", "num_skipped",
};
static const char *request_fields[REQUEST_FIELDS] = {
    "request_id", "token_ids", "block_hashes", "_hash_owner", "mm_inputs", "cache_salt",
    "lora_name", "num_encoder_tokens",
};
static const char *prefix_fields[PREFIX_FIELDS] = {
    "request_id", "num_tokens", "block_ids", "epochs", "checkpoint_at",
};

/* The offsets of ``count`` __slots__ fields of ``type``; -1 with TypeError if one is not. */
static int slot_offsets(PyObject *type, const char *const *names, int count,
                        Py_ssize_t *offsets) {
    for (int i = 0; i < count; i++) {
        PyObject *descr = PyObject_GetAttrString(type, names[i]);
        if (descr == NULL) return -1;
        int is_slot = Py_IS_TYPE(descr, &PyMemberDescr_Type)
            && ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX;
        if (is_slot) offsets[i] = ((PyMemberDescrObject *)descr)->d_member->offset;
        Py_DECREF(descr);
        if (!is_slot) {
            PyErr_Format(PyExc_TypeError, "%R.%s must be a __slots__ field", type, names[i]);
            return -1;
        }
    }
    return 0;
}

PyObject *kv_py_register_types(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyType_Check(args[0]) || !PyType_Check(args[1])
        || !PyType_Check(args[2]) || !PyType_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "register_types(state_class, request_class, allocated_class, "
                        "prefix_class)");
        return NULL;
    }
    Py_ssize_t state[STATE_FIELDS], request[REQUEST_FIELDS], allocated, prefix[PREFIX_FIELDS];
    static const char *allocated_fields[1] = {"new_block_ids"};
    if (slot_offsets(args[0], state_fields, STATE_FIELDS, state) < 0
        || slot_offsets(args[1], request_fields, REQUEST_FIELDS, request) < 0
        || slot_offsets(args[2], allocated_fields, 1, &allocated) < 0
        || slot_offsets(args[3], prefix_fields, PREFIX_FIELDS, prefix) < 0)
        return NULL;
    for (int i = 0; i < STATE_FIELDS; i++) {
        if (kv_state_names[i] == NULL
            && (kv_state_names[i] = PyUnicode_InternFromString(state_fields[i])) == NULL)
            return NULL;
    }
    PyTypeObject **types[4] = {&kv_state_type, &kv_request_type, &kv_allocated_type,
                               &kv_prefix_type};
    for (int i = 0; i < 4; i++) {
        Py_INCREF(args[i]);
        Py_XSETREF(*types[i], (PyTypeObject *)args[i]);
    }
    memcpy(kv_state_offsets, state, sizeof state);
    memcpy(kv_request_offsets, request, sizeof request);
    kv_allocated_offset = allocated;
    memcpy(kv_prefix_offsets, prefix, sizeof prefix);
    Py_RETURN_NONE;
}
