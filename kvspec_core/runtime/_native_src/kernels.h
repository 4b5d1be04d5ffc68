/* What the kernel files of kvspec_core.runtime._native share: the interned attribute names,
 * the int 1, and each file's Python-facing functions (registered in module.c). */
#ifndef KVSPEC_KERNELS_H
#define KVSPEC_KERNELS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Set by module.c when the module is created. */
extern PyObject *kv_one; /* the int 1 */
extern PyObject *kv_str_extend, *kv_str_request_id, *kv_str_computed, *kv_str_end_limit,
    *kv_str_known_limit, *kv_str_computed_limit;

/* hashing.c */
PyObject *kv_py_blake2b(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *kv_py_chain_hashes(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
/* chain_hashes with C arguments: 0, or -1 with an exception. */
int kv_chain_hashes(PyObject *parent, PyObject *tokens, Py_ssize_t start, Py_ssize_t stop,
                    Py_ssize_t size, PyObject *out);

/* pool.c */
PyObject *kv_py_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *kv_py_touch(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *kv_py_evict_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *kv_py_cache_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *kv_py_longest_hit(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *kv_py_count_unreferenced(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* grow.c: the block-boundary step of a one-group full-attention allocator. */
typedef struct {
    PyObject *pool, *hasher; /* borrowed from the config tuple */
    Py_ssize_t block_tokens, cap, max_len;
    int cacheable;
} DenseConfig;
/* Parse SlotsFastPath's ``dense`` tuple; -1 with an exception. */
int kv_dense_config(PyObject *config, DenseConfig *out);
/* The step's result (new reference); NULL without an exception: leave the step to the
 * Python method (nothing changed); NULL with one: an error. */
PyObject *kv_dense_grow(const DenseConfig *config, PyObject *state, PyObject *request,
                        Py_ssize_t count, Py_ssize_t lookahead, PyObject *no_new_blocks);

/* step.c */
extern PyTypeObject kv_SlotsFastPath_Type;
PyObject *kv_py_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *kv_py_decode_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif
