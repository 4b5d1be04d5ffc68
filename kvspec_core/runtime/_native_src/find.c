/* find_prefix: KVCacheAllocator.find_cached_prefix of a one-group full-attention allocator
 * whose block is one hash block (the prompt's hashes, the longest cached run of them, the
 * CachedPrefix), without a Python frame. An allocator built with the kernels holds
 * functools.partial(find_prefix, config, method) as its find_cached_prefix; anything out of
 * the ordinary (a running request, nothing to look up, multimodal inputs, a token that cannot
 * be hashed) is answered by the method, before anything changes. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "kernels.h"
#include "records.h"

/* The prefix of ``request`` (a new reference); NULL without an exception: the method's. */
static PyObject *find_dense(PyObject *config, PyObject *request) {
    /* (running, pool, hasher, cache, block_tokens, handed_out) */
    if (!PyTuple_CheckExact(config) || PyTuple_GET_SIZE(config) != 6
        || Py_TYPE(request) != kv_request_type || kv_prefix_type == NULL)
        return NULL;
    PyObject *running = PyTuple_GET_ITEM(config, 0), *pool = PyTuple_GET_ITEM(config, 1),
             *hasher = PyTuple_GET_ITEM(config, 2), *cache = PyTuple_GET_ITEM(config, 3),
             *handed = PyTuple_GET_ITEM(config, 5);
    Py_ssize_t tokens = PyLong_AsSsize_t(PyTuple_GET_ITEM(config, 4));
    if (tokens < 1 || !PyDict_Check(running) || !PyDict_Check(cache)
        || !PyDict_CheckExact(handed)) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *rid = record_get(request, kv_request_offsets[REQUEST_ID]);
    PyObject *token_ids = record_get(request, kv_request_offsets[REQUEST_TOKEN_IDS]);
    /* An id of another type (its lookup could run code) is the method's to refuse. */
    if (!kv_is_request_id(rid) || token_ids == NULL || !PyList_CheckExact(token_ids))
        return NULL;
    int is_running = PyDict_Contains(running, rid);
    if (is_running != 0) {
        PyErr_Clear(); /* running: the method refuses it */
        return NULL;
    }
    /* The last prompt token is always computed (to produce logits). */
    Py_ssize_t max_tokens = PyList_GET_SIZE(token_ids) - 1;
    if (max_tokens < tokens) return NULL; /* nothing to look up: the method's empty hit */
    Py_INCREF(rid);
    PyObject *hashes, *result = NULL, *hit = NULL, *pool_dict = NULL;
    int status = kv_hash_request(hasher, request, max_tokens, tokens, &hashes);
    if (status != 0) goto done;
    PyObject *max_blocks = PyLong_FromSsize_t(max_tokens / tokens);
    if (max_blocks == NULL) goto done;
    PyObject *args[3] = {hashes, cache, max_blocks};
    Py_INCREF(hashes);
    hit = kv_py_longest_hit(NULL, args, 3);
    Py_DECREF(hashes);
    Py_DECREF(max_blocks);
    if (hit == NULL || (pool_dict = kv_pool_dict(pool)) == NULL) goto done;
    PyObject *epoch = kv_pool_get(pool_dict, POOL_EPOCH);
    if (epoch == NULL) goto done;
    PyObject *values[PREFIX_FIELDS] = {
        [PREFIX_REQUEST_ID] = (Py_INCREF(rid), rid),
        [PREFIX_NUM_TOKENS] = PyLong_FromSsize_t(PyList_GET_SIZE(hit) * tokens),
        [PREFIX_BLOCK_IDS] = NULL,
        [PREFIX_EPOCHS] = PyTuple_Pack(1, epoch),
        [PREFIX_CHECKPOINT_AT] = (Py_INCREF(Py_None), Py_None),
    };
    PyObject *ids = PyList_AsTuple(hit);
    values[PREFIX_BLOCK_IDS] = ids == NULL ? NULL : PyTuple_Pack(1, ids);
    Py_XDECREF(ids);
    /* CachedPrefix(request_id=..., ...), its slots filled directly (see results.py). */
    result = new_record(kv_prefix_type, kv_prefix_offsets, values, PREFIX_FIELDS);
    if (result != NULL && PyList_GET_SIZE(hit) > 0) {
        /* Remembered as the method remembers it (allocator._handed_out): an admission with
         * this very prefix, unchanged, skips the per-block check. */
        const Py_ssize_t *at = kv_prefix_offsets;
        PyObject *entry = PyTuple_Pack(5, result, request, record_get(result, at[PREFIX_NUM_TOKENS]),
                                       record_get(result, at[PREFIX_BLOCK_IDS]),
                                       record_get(result, at[PREFIX_EPOCHS]));
        if (entry != NULL && PyDict_GET_SIZE(handed) >= 4096) PyDict_Clear(handed);
        if (entry == NULL || PyDict_SetItem(handed, rid, entry) < 0) Py_CLEAR(result);
        Py_XDECREF(entry);
    }
done:
    Py_XDECREF(pool_dict);
    Py_XDECREF(hit);
    Py_DECREF(rid);
    return result;
}

PyObject *kv_py_find_prefix(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "find_prefix(config, method, request)");
        return NULL;
    }
    PyObject *prefix = find_dense(args[0], args[2]);
    if (prefix != NULL || PyErr_Occurred()) return prefix;
    return PyObject_CallOneArg(args[1], args[2]);
}
