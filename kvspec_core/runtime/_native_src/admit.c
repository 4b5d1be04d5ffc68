/* The admission of a request to a one-group full-attention allocator (KVCacheAllocator.
 * _admit_checked for the allocators grow.c serves): the hit blocks revived, the new blocks
 * taken, the prompt's full blocks cached, the running state built with its thresholds.
 * SlotsFastPath calls it for a request that is not running yet. Anything out of the ordinary
 * (a prefix that is not a CachedPrefix for this request at the pool's epoch, a request freed
 * before, over max_model_len or the admission cap, too few free blocks, a hit block the pool
 * no longer holds, tokens it cannot hash) is left to the Python method: the kernel gives up
 * before it changes anything, and the method then answers (or refuses) as it always does. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "kernels.h"
#include "records.h"

static PyObject *prefix_names[4];

static int intern_prefix_names(void) {
    if (prefix_names[0] != NULL) return 0;
    static const char *const texts[4] = {"request_id", "num_tokens", "block_ids", "epochs"};
    for (int i = 0; i < 4; i++)
        if ((prefix_names[i] = PyUnicode_InternFromString(texts[i])) == NULL) return -1;
    return 0;
}

/* The hit of ``prefix`` for request id ``rid``: its block table (a new list) and tokens.
 * 0, 1: leave it to the method, -1: an error. */
static int prefix_hit(const DenseConfig *config, PyObject *pool_dict, PyObject *prefix,
                      PyObject *rid, PyObject **table_out, Py_ssize_t *computed_out) {
    if ((PyObject *)Py_TYPE(prefix) != config->prefix_type) return 1;
    if (intern_prefix_names() < 0) return -1;
    PyObject *fields[4];
    for (int i = 0; i < 4; i++) {
        if ((fields[i] = PyObject_GetAttr(prefix, prefix_names[i])) == NULL) {
            while (i > 0) Py_DECREF(fields[--i]);
            return -1;
        }
    }
    int status = 1;
    PyObject *ids = fields[2], *epochs = fields[3];
    PyObject *epoch = kv_pool_get(pool_dict, POOL_EPOCH);
    if (epoch == NULL) {
        status = -1;
        goto done;
    }
    int same_request = fields[0] == rid || PyObject_RichCompareBool(fields[0], rid, Py_EQ);
    if (same_request < 0) {
        status = -1;
        goto done;
    }
    if (!same_request || !PyLong_CheckExact(fields[1]) || !PyTuple_CheckExact(ids)
        || PyTuple_GET_SIZE(ids) != 1 || !PyTuple_CheckExact(PyTuple_GET_ITEM(ids, 0))
        || !PyTuple_CheckExact(epochs) || PyTuple_GET_SIZE(epochs) != 1
        || !PyLong_CheckExact(PyTuple_GET_ITEM(epochs, 0)) || !PyLong_CheckExact(epoch))
        goto done; /* refused by the method */
    int current = PyObject_RichCompareBool(PyTuple_GET_ITEM(epochs, 0), epoch, Py_EQ);
    if (current <= 0) {
        status = current; /* 0: evicted since, the method checks which blocks */
        if (status == 0) status = 1;
        goto done;
    }
    Py_ssize_t computed = PyLong_AsSsize_t(fields[1]);
    if (computed == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        goto done;
    }
    if (computed < 0) goto done;
    if ((*table_out = PySequence_List(PyTuple_GET_ITEM(ids, 0))) == NULL) {
        status = -1;
        goto done;
    }
    *computed_out = computed;
    status = 0;
done:
    for (int i = 0; i < 4; i++) Py_DECREF(fields[i]);
    return status;
}

/* A new _Running, every field set (new references stolen); NULL with an exception. */
static PyObject *new_state(PyObject *values[STATE_FIELDS]) {
    PyObject *state = NULL;
    for (int i = 0; i < STATE_FIELDS; i++)
        if (values[i] == NULL) goto fail;
    if ((state = kv_state_type->tp_alloc(kv_state_type, 0)) == NULL) goto fail;
    for (int i = 0; i < STATE_FIELDS; i++) record_set(state, kv_state_offsets[i], values[i]);
    return state;
fail:
    for (int i = 0; i < STATE_FIELDS; i++) Py_XDECREF(values[i]);
    return NULL;
}

/* A one-item list holding ``value``; NULL with an exception. */
static PyObject *one_int_list(Py_ssize_t value) {
    PyObject *item = PyLong_FromSsize_t(value);
    PyObject *list = item == NULL ? NULL : PyList_New(1);
    if (list == NULL) {
        Py_XDECREF(item);
        return NULL;
    }
    PyList_SET_ITEM(list, 0, item);
    return list;
}

PyObject *kv_dense_admit(const DenseConfig *config, PyObject *running, PyObject *request,
                         Py_ssize_t count, Py_ssize_t lookahead, PyObject *prefix) {
    if (Py_TYPE(request) != kv_request_type || kv_state_type == NULL
        || kv_allocated_type == NULL || !PyDict_CheckExact(running))
        return NULL; /* not records the kernels know: the method */
    PyObject *result = NULL, *pool_dict = NULL, *table = NULL, *taken = NULL;
    PyObject *hashes = NULL, *state = NULL;
    const Py_ssize_t tokens = config->block_tokens, max_len = config->max_len;
    Py_ssize_t computed = 0, prefix_blocks = 0;
    int status;
    PyObject *rid = record_get(request, kv_request_offsets[REQUEST_ID]);
    PyObject *token_ids = record_get(request, kv_request_offsets[REQUEST_TOKEN_IDS]);
    if (rid == NULL || token_ids == NULL || !PyList_CheckExact(token_ids)) return NULL;
    Py_INCREF(rid);
    Py_INCREF(token_ids);
    /* A request freed before: the method refuses it or, with a prefix, forgets the free. */
    if ((status = PyDict_Contains(config->freed, rid)) != 0) goto status;
    if ((pool_dict = kv_pool_dict(config->pool)) == NULL) goto error;
    if (prefix == Py_None) {
        if ((table = PyList_New(0)) == NULL) goto error;
    } else {
        if ((status = prefix_hit(config, pool_dict, prefix, rid, &table, &computed)) != 0)
            goto status;
        prefix_blocks = PyList_GET_SIZE(table);
    }
    if (count > max_len || computed > max_len - count) goto fallback; /* over max_model_len */
    Py_ssize_t known = computed + count;
    Py_ssize_t total = lookahead > max_len - known ? max_len : known + lookahead;
    Py_ssize_t real = (total + tokens - 1) / tokens - PyList_GET_SIZE(table);
    if (real < 0) real = 0;
    /* The hit's real blocks, and those no request holds (a revival takes them off the free
     * blocks). */
    PyObject *refs = kv_pool_get(pool_dict, POOL_REF_COUNTS);
    if (refs == NULL) goto error;
    if (!PyList_CheckExact(refs)) goto fallback;
    Py_ssize_t size = PyList_GET_SIZE(refs), num_hit = 0, num_unreferenced = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(table); i++) {
        PyObject *item = PyList_GET_ITEM(table, i);
        if (!PyLong_CheckExact(item)) goto fallback;
        Py_ssize_t block = PyLong_AsSsize_t(item);
        if (block == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            goto fallback;
        }
        if (block < 0 || block >= size) goto fallback; /* the method names the bad block */
        if (!block) continue;
        num_hit++;
        PyObject *ref = PyList_GET_ITEM(refs, block);
        if (!PyLong_CheckExact(ref)) goto fallback;
        num_unreferenced += PyLong_AsSsize_t(ref) == 0;
    }
    if (num_hit + real > config->cap) goto fallback; /* over the admission cap */
    Py_ssize_t num_free;
    if (kv_pool_num_free(pool_dict, &num_free) < 0) goto error;
    if (real + num_unreferenced > num_free) goto fallback; /* too few */
    Py_ssize_t available = PyList_GET_SIZE(token_ids);
    Py_ssize_t cached_upto = known < available ? known : available;
    if (config->cacheable) {
        /* Hash before anything changes: bad token ids refuse the admission here (the
         * method raises the hasher's error). */
        if ((status = kv_hash_known(config->hasher, request, cached_upto, tokens, &hashes)) < 0)
            goto error;
        if (status == 0) {
            Py_INCREF(hashes);
        } else if ((hashes = PyObject_CallMethod(config->hasher, "hashes", "On", request,
                                                 cached_upto)) == NULL) {
            PyErr_Clear();
            goto fallback;
        } else if (!PyList_CheckExact(hashes)) {
            goto fallback;
        }
    }
    /* Revive the hit: refused (nothing changed) for a block that is neither in use nor a
     * cached free block. */
    PyObject *touch_args[7] = {table, refs};
    static const int touch_fields[4] = {POOL_REUSED, POOL_EVICTABLE, POOL_PROTECTED,
                                        POOL_SEGMENTED};
    for (int i = 0; i < 4; i++)
        if ((touch_args[2 + i] = kv_pool_get(pool_dict, touch_fields[i])) == NULL) goto error;
    touch_args[6] = Py_True;
    PyObject *bad = kv_py_touch(NULL, touch_args, 7);
    if (bad == NULL) goto error;
    Py_ssize_t bad_index = PyLong_AsSsize_t(bad);
    Py_DECREF(bad);
    if (bad_index >= 0) goto fallback;
    /* From here on the admission happens. */
    if (real > 0) {
        if ((taken = kv_pool_take(config->pool, pool_dict, real)) == NULL) goto error;
        Py_ssize_t end = PyList_GET_SIZE(table);
        if (PyList_SetSlice(table, end, end, taken) < 0) goto error;
    }
    Py_ssize_t num_cached = prefix_blocks, cache_at = 0;
    if (config->cacheable) {
        Py_ssize_t stop = cached_upto / tokens;
        if (stop > num_cached) {
            if (kv_pool_cache_range(config->pool, pool_dict, 0, hashes, table, num_cached,
                                    stop) < 0)
                goto error;
            num_cached = stop;
        }
        cache_at = (num_cached + 1) * tokens;
    }
    Py_ssize_t end_limit = PyList_GET_SIZE(table) * tokens + 1;
    if (end_limit > max_len + 1) end_limit = max_len + 1;
    Py_ssize_t known_limit = config->cacheable && cache_at < max_len + 1 ? cache_at : max_len + 1;
    PyObject *blocks = PyList_New(1);
    if (blocks == NULL) goto error;
    Py_INCREF(table);
    PyList_SET_ITEM(blocks, 0, table);
    PyObject *values[STATE_FIELDS] = {
        [STATE_COMPUTED] = PyLong_FromSsize_t(known),
        [STATE_END_LIMIT] = PyLong_FromSsize_t(end_limit),
        [STATE_KNOWN_LIMIT] = PyLong_FromSsize_t(known_limit),
        [STATE_COMPUTED_LIMIT] = PyLong_FromSsize_t(PY_SSIZE_T_MAX),
        [STATE_BLOCKS] = blocks,
        [STATE_NUM_REAL] = one_int_list(num_hit + real),
        [STATE_NUM_CACHED] = one_int_list(num_cached),
        [STATE_CACHE_AT] = one_int_list(cache_at),
        [STATE_REQUEST] = (Py_INCREF(request), request),
        [STATE_NUM_SKIPPED] = one_int_list(0),
    };
    if ((state = new_state(values)) == NULL || PyDict_SetItem(running, rid, state) < 0)
        goto error;
    if ((result = new_allocated_one(taken)) == NULL) goto error;
    goto done;
status:
    if (status > 0) goto fallback;
    goto error;
error:
fallback:
    result = NULL;
done:
    Py_XDECREF(state);
    Py_XDECREF(hashes);
    Py_XDECREF(taken);
    Py_XDECREF(table);
    Py_XDECREF(pool_dict);
    Py_DECREF(token_ids);
    Py_DECREF(rid);
    return result;
}
