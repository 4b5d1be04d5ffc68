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

#include "block_queue.h"
#include "kernels.h"
#include "records.h"

/* Interned names of the pool's attributes, made on first use. */
static PyObject *s_fresh, *s_ref_counts, *s_evictable, *s_protected, *s_caches, *s_block_group,
    *s_block_hash, *s_epoch, *s_take, *s_move_hash, *s_pop;

static int intern_names(void) {
    if (s_fresh != NULL) return 0;
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {
        {&s_fresh, "_fresh"}, {&s_ref_counts, "ref_counts"}, {&s_evictable, "_evictable"},
        {&s_protected, "_protected"}, {&s_caches, "caches"}, {&s_block_group, "_block_group"},
        {&s_block_hash, "_block_hash"}, {&s_epoch, "epoch"}, {&s_take, "take"},
        {&s_move_hash, "_move_hash"}, {&s_pop, "pop"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        *names[i].slot = PyUnicode_InternFromString(names[i].text);
        if (*names[i].slot == NULL) return -1;
    }
    return 0;
}

int kv_dense_config(PyObject *config, DenseConfig *out) {
    /* (pool, hasher, block_tokens, admission_cap, max_model_len, hash_block_size,
     *  cacheable) */
    if (intern_names() < 0) return -1;
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

/* A registered record's int field: 0, 1 when unset or not an exact int (the step is left to
 * the method), -1 on an error. */
static int record_ssize(PyObject *record, Py_ssize_t offset, Py_ssize_t *value) {
    PyObject *item = record_get(record, offset);
    if (item == NULL || !PyLong_CheckExact(item)) return 1;
    *value = PyLong_AsSsize_t(item);
    return (*value == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int record_set_ssize(PyObject *record, Py_ssize_t offset, Py_ssize_t value) {
    PyObject *item = PyLong_FromSsize_t(value);
    if (item == NULL) return -1;
    record_set(record, offset, item);
    return 0;
}

/* ``list[0]`` of a per-group list (one group): 0, 1 if it is not a list starting with an
 * exact int, -1 on an error. */
static int first_int(PyObject *list, Py_ssize_t *value) {
    if (list == NULL || !PyList_CheckExact(list) || PyList_GET_SIZE(list) < 1
        || !PyLong_CheckExact(PyList_GET_ITEM(list, 0)))
        return 1;
    *value = PyLong_AsSsize_t(PyList_GET_ITEM(list, 0));
    return (*value == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int set_first(PyObject *list, Py_ssize_t value) {
    PyObject *item = PyLong_FromSsize_t(value);
    if (item == NULL) return -1;
    return PyList_SetItem(list, 0, item); /* steals item */
}

/* The pool attribute ``name`` from its __dict__ (borrowed), or NULL with AttributeError. */
static PyObject *pool_get(PyObject *pool_dict, PyObject *name) {
    PyObject *value = PyDict_GetItemWithError(pool_dict, name);
    if (value == NULL && !PyErr_Occurred()) PyErr_SetObject(PyExc_AttributeError, name);
    return value;
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
    PyObject *fresh = NULL, *evictable = NULL, *protected_ = NULL, *hashes = NULL;
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
    if ((status = first_int(num_real, &real_held)) != 0) goto status;
    HOLD(num_real);
    if ((pool_dict = PyObject_GenericGetDict(config->pool, NULL)) == NULL) goto error;
    if (real > 0) {
        if (real_held + real > config->cap) goto fallback; /* over the admission cap */
        if ((fresh = pool_get(pool_dict, s_fresh)) == NULL
            || (evictable = pool_get(pool_dict, s_evictable)) == NULL
            || (protected_ = pool_get(pool_dict, s_protected)) == NULL)
            goto error;
        HOLD(fresh);
        HOLD(evictable);
        HOLD(protected_);
        Py_ssize_t num_fresh = PyObject_Length(fresh), num_evictable = PyObject_Length(evictable),
                   num_protected = PyObject_Length(protected_);
        if (num_fresh < 0 || num_evictable < 0 || num_protected < 0) goto error;
        if (real > num_fresh + num_evictable + num_protected) goto fallback; /* too few */
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
        if ((status = first_int(cache_at, &cache_from)) != 0
            || (status = first_int(num_cached, &cached)) != 0)
            goto status;
        HOLD(cache_at);
        HOLD(num_cached);
        if (cached_upto >= cache_from && !hash) goto fallback; /* thresholds out of step */
    }
    if (hash) {
        /* PrefixHasher.hashes(request, cached_upto), for a request this hasher hashed. */
        PyObject *mm_inputs = record_get(request, request_fields[REQUEST_MM_INPUTS]);
        hashes = record_get(request, request_fields[REQUEST_BLOCK_HASHES]);
        if (record_get(request, request_fields[REQUEST_HASH_OWNER]) != config->hasher
            || mm_inputs == NULL || !PyTuple_CheckExact(mm_inputs)
            || PyTuple_GET_SIZE(mm_inputs) != 0 || hashes == NULL || !PyList_CheckExact(hashes))
            goto fallback;
        HOLD(hashes);
        Py_ssize_t done = PyList_GET_SIZE(hashes), target = cached_upto / tokens;
        if (target > done) {
            if (done == 0) goto fallback; /* the first block's parent is the request's root */
            PyObject *parent = PyList_GET_ITEM(hashes, done - 1);
            Py_INCREF(parent);
            int chained = kv_chain_hashes(parent, token_ids, done * tokens, target * tokens,
                                          tokens, hashes);
            Py_DECREF(parent);
            if (chained < 0) {
                /* A token that cannot be hashed: nothing was appended; the method refuses
                 * the step with its own message. */
                if (PyErr_ExceptionMatches(PyExc_ValueError)) {
                    PyErr_Clear();
                    goto fallback;
                }
                goto error;
            }
        }
    }
    /* From here on the step happens. */
    if (real > 0) {
        PyObject *refs = pool_get(pool_dict, s_ref_counts);
        if (refs == NULL) goto error;
        if (!PyList_CheckExact(refs)) goto error_type;
        HOLD(refs);
        Py_ssize_t num_fresh = PyObject_Length(fresh);
        if (num_fresh < 0) goto error;
        if (real == 1 && num_fresh > 0) {
            /* BlockPool.take's common case: one uncached block off the free stack. */
            PyObject *block = PyObject_CallMethodNoArgs(fresh, s_pop);
            if (block == NULL) goto error;
            Py_ssize_t id = PyLong_AsSsize_t(block);
            if ((id == -1 && PyErr_Occurred()) || id < 1 || id >= PyList_GET_SIZE(refs)) {
                Py_DECREF(block);
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_IndexError, "block id %zd is not in this pool", id);
                goto error;
            }
            taken = PyList_New(1);
            if (taken == NULL) {
                Py_DECREF(block);
                goto error;
            }
            PyList_SET_ITEM(taken, 0, block);
            Py_INCREF(kv_one);
            if (PyList_SetItem(refs, id, kv_one) < 0) goto error;
        } else if (real == 1 && PyObject_Length(evictable) >= 1) {
            /* No uncached block left: evict the oldest never-reused cached one. */
            PyObject *caches = pool_get(pool_dict, s_caches);
            PyObject *block_group = caches ? pool_get(pool_dict, s_block_group) : NULL;
            PyObject *block_hash = block_group ? pool_get(pool_dict, s_block_hash) : NULL;
            if (block_hash == NULL || (taken = PyList_New(0)) == NULL) goto error;
            PyObject *args[7] = {kv_one, taken, evictable, caches, block_group, block_hash, refs};
            PyObject *done = kv_py_evict_take(NULL, args, 7);
            if (done == NULL) goto error;
            Py_DECREF(done);
            PyObject *epoch = pool_get(pool_dict, s_epoch);
            PyObject *next = epoch == NULL ? NULL : PyNumber_Add(epoch, kv_one);
            if (next == NULL) goto error;
            status = PyDict_SetItem(pool_dict, s_epoch, next);
            Py_DECREF(next);
            if (status < 0) goto error;
        } else {
            PyObject *number = PyLong_FromSsize_t(real);
            if (number == NULL) goto error;
            taken = PyObject_CallMethodOneArg(config->pool, s_take, number);
            Py_DECREF(number);
            if (taken == NULL) goto error;
            if (!PyList_CheckExact(taken)) goto error_type;
        }
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(taken); i++)
            if (PyList_Append(table, PyList_GET_ITEM(taken, i)) < 0) goto error;
        if (set_first(num_real, real_held + real) < 0) goto error;
    }
    if (record_set_ssize(state, fields[STATE_COMPUTED], known) < 0) goto error;
    Py_ssize_t end_limit = max_len + 1, new_known_limit = max_len + 1;
    Py_ssize_t end = PyList_GET_SIZE(table) * tokens + 1;
    if (end < end_limit) end_limit = end;
    if (config->cacheable) {
        if (cached_upto >= cache_from) {
            Py_ssize_t stop = cached_upto / tokens;
            PyObject *caches = pool_get(pool_dict, s_caches);
            PyObject *block_hash = caches ? pool_get(pool_dict, s_block_hash) : NULL;
            if (block_hash == NULL) goto error;
            if (!PyDict_Check(caches)) goto error_type;
            PyObject *group_block = Py_None;
            if (PyDict_GET_SIZE(caches) > 1) {
                /* Several groups share the pool: cache_blocks records the group. */
                if ((group_block = pool_get(pool_dict, s_block_group)) == NULL) goto error;
            }
            PyObject *gid = PyLong_FromLong(0);
            PyObject *cache = gid == NULL ? NULL : PyDict_GetItemWithError(caches, gid);
            PyObject *digests = PyList_GetSlice(hashes, cached, stop);
            PyObject *ids = PyList_GetSlice(table, cached, stop);
            PyObject *move_hash = PyObject_GetAttr(config->pool, s_move_hash);
            PyObject *stored = NULL;
            if (cache != NULL && digests != NULL && ids != NULL && move_hash != NULL) {
                PyObject *args[7] = {gid, digests, ids, cache, block_hash, group_block, move_hash};
                stored = kv_py_cache_blocks(NULL, args, 7);
            } else if (cache == NULL && !PyErr_Occurred()) {
                PyErr_SetString(PyExc_KeyError, "the pool has no cache of group 0");
            }
            Py_XDECREF(gid);
            Py_XDECREF(digests);
            Py_XDECREF(ids);
            Py_XDECREF(move_hash);
            if (stored == NULL) goto error;
            Py_DECREF(stored);
            cache_from = (stop + 1) * tokens;
            if (set_first(num_cached, stop) < 0 || set_first(cache_at, cache_from) < 0)
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
    } else {
        /* Allocated(new_block_ids=(tuple(taken),)), its one slot filled directly. */
        PyObject *ids = PyList_AsTuple(taken);
        PyObject *per_group = ids == NULL ? NULL : PyTuple_Pack(1, ids);
        Py_XDECREF(ids);
        if (per_group == NULL) goto error;
        result = kv_allocated_type->tp_alloc(kv_allocated_type, 0);
        if (result == NULL) {
            Py_DECREF(per_group);
            goto error;
        }
        record_set(result, kv_allocated_offset, per_group);
    }
    goto done;
status:
    if (status > 0) goto fallback;
    goto error;
error_type:
    if (!PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "dense step: the pool's containers changed type");
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
