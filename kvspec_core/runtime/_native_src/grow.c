/* The block-boundary step of a one-group full-attention allocator (KVCacheAllocator.
 * _grow_dense with one holding group whose blocks are hash blocks): take the new block,
 * hash and cache the blocks that became full, move the step thresholds. SlotsFastPath calls
 * it for every step its first test does not answer. Anything out of the ordinary (over
 * max_model_len or the admission cap, too few free blocks, a token that cannot be hashed, a
 * request hashed by another hasher, multimodal inputs, a first hash block) is left to the
 * Python method: the kernel gives up before it changes anything, and the method then
 * answers (or refuses) as it always does. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "kernels.h"
#include "records.h"

int kv_dense_config(PyObject *config, DenseConfig *out) {
    /* (pool, hasher, block_tokens, admission_cap, max_model_len, hash_block_size,
     *  cacheable) */
    if (!PyTuple_CheckExact(config) || PyTuple_GET_SIZE(config) != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "dense must be (pool, hasher, block_tokens, admission_cap, "
                        "max_model_len, hash_block_size, cacheable) or None");
        return -1;
    }
    Py_ssize_t numbers[4];
    for (int i = 0; i < 4; i++) {
        numbers[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(config, 2 + i));
        if (numbers[i] == -1 && PyErr_Occurred()) return -1;
    }
    int cacheable = PyObject_IsTrue(PyTuple_GET_ITEM(config, 6));
    if (cacheable < 0) return -1;
    /* block_tokens == hash_block_size: a group block is one hash block. */
    if (numbers[0] < 1 || numbers[0] != numbers[3] || numbers[1] < 0 || numbers[2] < 0
        || numbers[2] >= PY_SSIZE_T_MAX / 2) {
        PyErr_SetString(PyExc_ValueError,
                        "dense: block_tokens must equal hash_block_size (>= 1), caps >= 0");
        return -1;
    }
    out->pool = PyTuple_GET_ITEM(config, 0);
    out->hasher = PyTuple_GET_ITEM(config, 1);
    out->block_tokens = numbers[0];
    out->cap = numbers[1];
    out->max_len = numbers[2];
    out->cacheable = cacheable;
    return 0;
}

PyObject *kv_dense_grow(const DenseConfig *config, PyObject *state, PyObject *request,
                        Py_ssize_t count, Py_ssize_t lookahead, PyObject *no_new_blocks) {
    if (Py_TYPE(state) != kv_state_type || Py_TYPE(request) != kv_request_type
        || kv_allocated_type == NULL)
        return NULL; /* not records the kernels know: the method */
    /* Every object used across a call that may run Python code is held here. */
    PyObject *held[16];
    int num_held = 0;
#define HOLD(object) (Py_INCREF(object), held[num_held++] = (object))
    PyObject *result = NULL, *pool_dict = NULL, *taken = NULL;
    PyObject *hashes = NULL;
    PyObject *num_cached = NULL, *cache_at = NULL;
    const Py_ssize_t tokens = config->block_tokens, max_len = config->max_len;
    const Py_ssize_t *fields = kv_state_offsets, *request_fields = kv_request_offsets;
    Py_ssize_t computed, known_limit, real_held, cached = 0, cache_from = 0;
    int status;

    if ((status = record_ssize(state, fields[STATE_COMPUTED], &computed)) != 0) goto status;
    if (count > max_len || computed > max_len - count) goto fallback; /* over max_model_len */
    Py_ssize_t known = computed + count;
    Py_ssize_t total = lookahead > max_len - known ? max_len : known + lookahead;
    PyObject *blocks = record_get(state, fields[STATE_BLOCKS]);
    if (blocks == NULL || !PyList_CheckExact(blocks) || PyList_GET_SIZE(blocks) != 1
        || !PyList_CheckExact(PyList_GET_ITEM(blocks, 0)))
        goto fallback;
    PyObject *table = HOLD(PyList_GET_ITEM(blocks, 0));
    Py_ssize_t real = (total + tokens - 1) / tokens - PyList_GET_SIZE(table);
    PyObject *num_real = record_get(state, fields[STATE_NUM_REAL]);
    if ((status = list_ssize(num_real, 0, &real_held)) != 0) goto status;
    HOLD(num_real);
    if ((pool_dict = kv_pool_dict(config->pool)) == NULL) goto error;
    if (real > 0) {
        if (real_held + real > config->cap) goto fallback; /* over the admission cap */
        Py_ssize_t num_free;
        if (kv_pool_num_free(pool_dict, &num_free) < 0) goto error;
        if (real > num_free) goto fallback; /* too few */
    }
    PyObject *token_ids = record_get(request, request_fields[REQUEST_TOKEN_IDS]);
    if (token_ids == NULL || !PyList_CheckExact(token_ids)) goto fallback;
    HOLD(token_ids);
    Py_ssize_t available = PyList_GET_SIZE(token_ids);
    Py_ssize_t cached_upto = known < available ? known : available;
    if ((status = record_ssize(state, fields[STATE_KNOWN_LIMIT], &known_limit)) != 0)
        goto status;
    int hash = config->cacheable && cached_upto >= known_limit;
    if (config->cacheable) {
        cache_at = record_get(state, fields[STATE_CACHE_AT]);
        num_cached = record_get(state, fields[STATE_NUM_CACHED]);
        if ((status = list_ssize(cache_at, 0, &cache_from)) != 0
            || (status = list_ssize(num_cached, 0, &cached)) != 0)
            goto status;
        HOLD(cache_at);
        HOLD(num_cached);
        if (cached_upto >= cache_from && !hash) goto fallback; /* thresholds out of step */
    }
    if (hash) {
        if ((status = kv_hash_request(config->hasher, request, cached_upto, tokens, &hashes)) != 0)
            goto status;
        HOLD(hashes);
    }
    /* From here on the step happens. */
    if (real > 0) {
        if ((taken = kv_pool_take_onto(config->pool, pool_dict, real, table)) == NULL)
            goto error;
        if (list_set_ssize(num_real, 0, real_held + real) < 0) goto error;
    }
    if (record_set_ssize(state, fields[STATE_COMPUTED], known) < 0) goto error;
    Py_ssize_t end_limit = max_len + 1, new_known_limit = max_len + 1;
    Py_ssize_t end = PyList_GET_SIZE(table) * tokens + 1;
    if (end < end_limit) end_limit = end;
    if (config->cacheable) {
        if (cached_upto >= cache_from) {
            Py_ssize_t stop = cached_upto / tokens;
            if (kv_pool_cache_range(config->pool, pool_dict, 0, hashes, table, cached, stop) < 0)
                goto error;
            cache_from = (stop + 1) * tokens;
            if (list_set_ssize(num_cached, 0, stop) < 0 || list_set_ssize(cache_at, 0, cache_from) < 0)
                goto error;
        }
        if (cache_from < new_known_limit) new_known_limit = cache_from;
    }
    if (record_set_ssize(state, fields[STATE_END_LIMIT], end_limit) < 0
        || record_set_ssize(state, fields[STATE_KNOWN_LIMIT], new_known_limit) < 0
        || record_set_ssize(state, fields[STATE_COMPUTED_LIMIT], PY_SSIZE_T_MAX) < 0)
        goto error;
    if (real <= 0) {
        Py_INCREF(no_new_blocks);
        result = no_new_blocks;
    } else if ((result = new_allocated_one(taken)) == NULL) {
        goto error;
    }
    goto done;
status:
    if (status > 0) goto fallback;
    goto error;
error:
fallback:
    result = NULL;
done:
    Py_XDECREF(pool_dict);
    Py_XDECREF(taken);
    while (num_held > 0) Py_DECREF(held[--num_held]);
#undef HOLD
    return result;
}
