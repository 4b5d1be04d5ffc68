/* The admission of a request (KVCacheAllocator._admit_checked) to an allocator whose holding
 * groups all follow one of the core's parametric rule shapes (see group_step.c), each
 * group's block one hash block: the hit's blocks revived, skipped and null entries placed,
 * new blocks taken, the prompt's full blocks cached, the running state built with its
 * thresholds. SlotsFastPath calls it for a request that is not running yet. Anything out of
 * the ordinary (a prefix that is not a CachedPrefix for this request at the pools' epochs, a
 * request freed before, over max_model_len or an admission cap, too few free blocks, a hit
 * block the pool no longer holds, tokens it cannot hash) is left to the Python method: the
 * kernel gives up before it changes anything, and the method then answers (or refuses) as
 * it always does. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "kernels.h"
#include "records.h"

int kv_admit_config(PyObject *config, AdmitConfig *out) {
    /* (freed, prefix_class, pools, groups, handed_out): groups as SlotsFastPath's
     * ``groups``, handed_out the allocator's _handed_out. */
    if (!PyTuple_CheckExact(config) || PyTuple_GET_SIZE(config) != 5
        || !PyDict_CheckExact(PyTuple_GET_ITEM(config, 4))
        || !PyDict_Check(PyTuple_GET_ITEM(config, 0)) || !PyType_Check(PyTuple_GET_ITEM(config, 1))
        || !PyTuple_CheckExact(PyTuple_GET_ITEM(config, 2))) {
        PyErr_SetString(PyExc_TypeError,
                        "admit must be (freed, prefix_class, pools, groups, handed_out) or "
                        "None");
        return -1;
    }
    if (kv_groups_config(PyTuple_GET_ITEM(config, 3), &out->groups) < 0) return -1;
    out->freed = PyTuple_GET_ITEM(config, 0);
    out->prefix_type = PyTuple_GET_ITEM(config, 1);
    out->pools = PyTuple_GET_ITEM(config, 2);
    out->handed = PyTuple_GET_ITEM(config, 4);
    return 0;
}

static PyObject *prefix_names[4];

static int intern_prefix_names(void) {
    if (prefix_names[0] != NULL) return 0;
    static const char *const texts[4] = {"request_id", "num_tokens", "block_ids", "epochs"};
    for (int i = 0; i < 4; i++)
        if ((prefix_names[i] = PyUnicode_InternFromString(texts[i])) == NULL) return -1;
    return 0;
}

/* 1 if every pool's epoch is the one in ``epochs`` (a tuple of exact ints: comparing
 * anything else could run code), 0 if not, -1 on an error. */
static int epochs_current(PyObject *pools, PyObject *epochs) {
    if (!PyTuple_CheckExact(epochs) || PyTuple_GET_SIZE(epochs) != PyTuple_GET_SIZE(pools))
        return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(pools); i++) {
        if (!PyLong_CheckExact(PyTuple_GET_ITEM(epochs, i))) return 0;
        PyObject *pool_dict = kv_pool_dict(PyTuple_GET_ITEM(pools, i));
        PyObject *epoch = pool_dict == NULL ? NULL : kv_pool_get(pool_dict, POOL_EPOCH);
        int same = epoch == NULL ? -1 : !PyLong_CheckExact(epoch) ? 0
            : PyObject_RichCompareBool(PyTuple_GET_ITEM(epochs, i), epoch, Py_EQ);
        Py_XDECREF(pool_dict);
        if (same <= 0) return same;
    }
    return 1;
}

/* The hit of ``prefix`` for request id ``rid`` (an exact str or int) of a request of
 * ``num_tokens`` tokens: each group's block table (new lists of exact ints in ``tables``) and
 * the tokens it covers, as the method's _check_prefix reads them (an int in [0, num_tokens),
 * each holding group's table ``computed / block_tokens`` entries, the others' none). 0, 1:
 * leave it to the method (it refuses what is not such a hit, or finds it stale), -1: an
 * error. */
static int prefix_hit(const AdmitConfig *config, PyObject *prefix, PyObject *rid,
                      PyObject *request, Py_ssize_t num_tokens, PyObject **tables,
                      Py_ssize_t *computed_out, int *trusted) {
    if ((PyObject *)Py_TYPE(prefix) != config->prefix_type) return 1;
    if (intern_prefix_names() < 0) return -1;
    PyObject *fields[4];
    for (int i = 0; i < 4; i++) {
        if ((fields[i] = PyObject_GetAttr(prefix, prefix_names[i])) == NULL) {
            while (i > 0) Py_DECREF(fields[--i]);
            return -1;
        }
    }
    const Py_ssize_t num_groups = config->groups.num_groups;
    PyObject *ids = fields[2];
    /* Compared only with an id of its own type (comparing another object runs its code). */
    int status = Py_TYPE(fields[0]) != Py_TYPE(rid) ? 0
        : PyObject_RichCompareBool(fields[0], rid, Py_EQ);
    if (status <= 0) {
        status = status < 0 ? -1 : 1; /* another request's prefix: the method refuses it */
        goto done;
    }
    status = 1;
    if (!PyLong_CheckExact(fields[1]) || !PyTuple_CheckExact(ids)
        || PyTuple_GET_SIZE(ids) != num_groups)
        goto done;
    for (Py_ssize_t gid = 0; gid < num_groups; gid++)
        if (!PyTuple_CheckExact(PyTuple_GET_ITEM(ids, gid))) goto done;
    int current = epochs_current(config->pools, fields[3]);
    if (current <= 0) {
        status = current < 0 ? -1 : 1; /* evicted since: the method checks which blocks */
        goto done;
    }
    Py_ssize_t computed = PyLong_AsSsize_t(fields[1]);
    if (computed == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        goto done;
    }
    if (computed < 0 || (computed > 0 && computed >= num_tokens)) goto done;
    Py_ssize_t expected[KV_STEP_GROUPS] = {0};
    for (int i = 0; i < config->groups.count; i++) {
        const GroupShape *group = &config->groups.groups[i];
        if (computed % group->block_tokens) goto done;
        expected[group->gid] = computed / group->block_tokens;
    }
    for (Py_ssize_t gid = 0; gid < num_groups; gid++) {
        PyObject *group_ids = PyTuple_GET_ITEM(ids, gid);
        if (PyTuple_GET_SIZE(group_ids) != expected[gid]) goto done;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(group_ids); i++)
            if (!PyLong_CheckExact(PyTuple_GET_ITEM(group_ids, i))) goto done;
    }
    for (Py_ssize_t gid = 0; gid < num_groups; gid++) {
        if ((tables[gid] = PySequence_List(PyTuple_GET_ITEM(ids, gid))) == NULL) {
            status = -1;
            goto done;
        }
    }
    *computed_out = computed;
    /* Handed out for this very request and unchanged (the method's _check_prefix): the
     * epochs are current, so its blocks are still cached under the request's hashes. */
    PyObject *entry = PyDict_GetItemWithError(config->handed, rid); /* an exact id: no code */
    if (entry == NULL && PyErr_Occurred()) {
        status = -1;
        goto done;
    }
    *trusted = entry != NULL && PyTuple_CheckExact(entry) && PyTuple_GET_SIZE(entry) == 5
        && PyTuple_GET_ITEM(entry, 0) == prefix && PyTuple_GET_ITEM(entry, 1) == request
        && PyTuple_GET_ITEM(entry, 2) == fields[1] && PyTuple_GET_ITEM(entry, 3) == ids
        && PyTuple_GET_ITEM(entry, 4) == fields[3];
    status = 0;
done:
    for (int i = 0; i < 4; i++) Py_DECREF(fields[i]);
    return status;
}

/* A per-group list of ints; NULL with an exception. */
static PyObject *int_list(const Py_ssize_t *values, Py_ssize_t count) {
    PyObject *list = PyList_New(count);
    for (Py_ssize_t i = 0; list != NULL && i < count; i++) {
        PyObject *item = PyLong_FromSsize_t(values[i]);
        if (item == NULL) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, item);
    }
    return list;
}

/* Checks a group's hit table against its pool before anything changes (what touch
 * requires) and counts its real blocks and those no request holds. 0, 1: leave it to the
 * method (it refuses or names the bad entry), -1: an error. */
static int check_hit(PyObject *pool_dict, PyObject *table, Py_ssize_t *num_real,
                     Py_ssize_t *num_unreferenced) {
    /* Held: each lookup may run a hostile key's code, which may replace an earlier one. */
    static const int fields[3] = {POOL_REF_COUNTS, POOL_EVICTABLE, POOL_PROTECTED};
    PyObject *held[3];
    if (kv_pool_get_all(pool_dict, fields, 3, held) < 0) return -1;
    int status = 1;
    if (PyList_CheckExact(held[0])) {
        Py_ssize_t bad = kv_first_unrevivable(table, held[0], held[1], held[2], num_real,
                                              num_unreferenced);
        if (bad == -2) PyErr_Clear(); /* an entry that is no block id */
        status = bad != -1;
    }
    kv_release_all(held, 3);
    return status;
}

/* 0: each entry of ``table`` (a hit of group ``gid``, exact ints) from ``skip`` on is a real
 * block, and each real block is the one the group's cache maps the request's hash at its
 * position to (``hashes``: the request's hashes, at least one per entry); 1: not (the method
 * tells a stale prefix from one it never handed out), -1: an error. */
static int hit_is_cached(PyObject *pool_dict, Py_ssize_t gid, PyObject *table, Py_ssize_t skip,
                         PyObject *hashes) {
    /* The caches and the group's cache are held, the lists' sizes read again at each step
     * and each digest held across its lookup: a key of the cache that is no bytes but has a
     * digest's hash runs its __eq__, which may change any of them. */
    PyObject *caches = Py_XNewRef(kv_pool_get(pool_dict, POOL_CACHES)), *cache = NULL;
    if (caches == NULL) return -1;
    int status = 1;
    if (!PyDict_CheckExact(caches) || hashes == NULL) goto done;
    PyObject *key = PyLong_FromSsize_t(gid);
    if (key == NULL) {
        status = -1;
        goto done;
    }
    cache = Py_XNewRef(PyDict_GetItemWithError(caches, key));
    Py_DECREF(key);
    if (cache == NULL) {
        status = PyErr_Occurred() ? -1 : 1;
        goto done;
    }
    if (!PyDict_CheckExact(cache)) goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(table); i++) {
        PyObject *entry = PyList_GET_ITEM(table, i);
        if (i >= PyList_GET_SIZE(hashes) || !PyLong_CheckExact(entry)) goto done;
        Py_ssize_t block = PyLong_AsSsize_t(entry);
        if (block == -1 && PyErr_Occurred()) {
            status = -1;
            goto done;
        }
        if (block == 0) {
            if (i >= skip) goto done; /* a block the group needs to resume */
            continue;
        }
        PyObject *digest = PyList_GET_ITEM(hashes, i);
        if (!PyBytes_CheckExact(digest)) goto done;
        Py_INCREF(digest);
        PyObject *cached = PyDict_GetItemWithError(cache, digest);
        Py_DECREF(digest);
        if (cached == NULL) {
            status = PyErr_Occurred() ? -1 : 1;
            goto done;
        }
        if (!PyLong_CheckExact(cached)) goto done;
        Py_ssize_t cached_block = PyLong_AsSsize_t(cached);
        if (cached_block == -1 && PyErr_Occurred()) {
            status = -1;
            goto done;
        }
        if (cached_block != block) goto done;
    }
    status = 0;
done:
    Py_XDECREF(caches);
    Py_XDECREF(cache);
    return status;
}

/* BlockPool.touch(table) once check_hit passed: -1 with an exception, else 0. */
static int revive(PyObject *pool_dict, PyObject *table) {
    PyObject *args[7] = {table};
    static const int fields[5] = {POOL_REF_COUNTS, POOL_REUSED, POOL_EVICTABLE,
                                  POOL_PROTECTED, POOL_SEGMENTED};
    if (kv_pool_get_all(pool_dict, fields, 5, args + 1) < 0) return -1;
    args[6] = Py_False; /* checked */
    PyObject *bad = kv_py_touch(NULL, args, 7);
    kv_release_all(args + 1, 5);
    Py_XDECREF(bad);
    return bad == NULL ? -1 : 0;
}

PyObject *kv_admit(const AdmitConfig *config, PyObject *running, PyObject *request,
                   Py_ssize_t count, Py_ssize_t lookahead, PyObject *prefix) {
    const GroupsConfig *groups = &config->groups;
    const Py_ssize_t num_groups = groups->num_groups, max_len = groups->max_len;
    const int num_holding = groups->count;
    if (num_holding < 0 || num_groups > KV_STEP_GROUPS || Py_TYPE(request) != kv_request_type
        || kv_state_type == NULL || kv_allocated_type == NULL || !PyDict_CheckExact(running))
        return NULL; /* not what the kernel knows: the method */
    PyObject *tables[KV_STEP_GROUPS] = {NULL}, *taken[KV_STEP_GROUPS] = {NULL};
    PyObject *pool_dicts[KV_STEP_GROUPS] = {NULL};
    PyObject *result = NULL, *hashes = NULL, *state = NULL, *zero = NULL;
    GroupPlan plans[KV_STEP_GROUPS];
    Py_ssize_t need[KV_STEP_GROUPS] = {0}, num_real[KV_STEP_GROUPS] = {0},
               num_cached[KV_STEP_GROUPS] = {0}, cache_at[KV_STEP_GROUPS] = {0},
               num_skipped[KV_STEP_GROUPS] = {0};
    Py_ssize_t computed = 0;
    int status, trusted = 0;
    PyObject *rid = record_get(request, kv_request_offsets[REQUEST_ID]);
    PyObject *token_ids = record_get(request, kv_request_offsets[REQUEST_TOKEN_IDS]);
    /* An id of another type (its lookup could run code) is the method's to refuse; so is a
     * request with encoder tokens (the method refuses them where no group holds them). */
    PyObject *encoder = record_get(request, kv_request_offsets[REQUEST_NUM_ENCODER_TOKENS]);
    int overflow = 0;
    if (!kv_is_request_id(rid) || token_ids == NULL || !PyList_CheckExact(token_ids)
        || encoder == NULL || !PyLong_CheckExact(encoder)
        || PyLong_AsLongAndOverflow(encoder, &overflow) != 0 || overflow)
        return NULL;
    Py_INCREF(rid);
    Py_INCREF(token_ids);
    /* A request freed before: the method refuses it or, with a prefix, forgets the free. */
    if ((status = PyDict_Contains(config->freed, rid)) != 0) goto status;
    if (prefix == Py_None) {
        for (Py_ssize_t gid = 0; gid < num_groups; gid++)
            if ((tables[gid] = PyList_New(0)) == NULL) goto error;
    } else {
        if ((status = prefix_hit(config, prefix, rid, request, PyList_GET_SIZE(token_ids),
                                 tables, &computed, &trusted)) != 0)
            goto status;
        int holding[KV_STEP_GROUPS] = {0};
        for (int i = 0; i < num_holding; i++) holding[groups->groups[i].gid] = 1;
        for (Py_ssize_t gid = 0; gid < num_groups; gid++) {
            /* A group that holds no blocks has no hit (find_cached_prefix gives ()). */
            if (!holding[gid] && PyList_GET_SIZE(tables[gid])) goto fallback;
            num_cached[gid] = PyList_GET_SIZE(tables[gid]);
        }
        if (computed > 0) {
            /* The hit is checked against the request's own hashes (as the method's
             * _check_prefix): hash the blocks it covers, as the method does first. */
            if (!groups->cacheable) goto fallback;
            if ((status = kv_hash_request(groups->hasher, request, computed,
                                          groups->hash_tokens, &hashes)) != 0)
                goto status;
            Py_INCREF(hashes);
        }
    }
    if (count > max_len || computed > max_len - count) goto fallback; /* over max_model_len */
    const Py_ssize_t known = computed + count;
    const Py_ssize_t total = lookahead > max_len - known ? max_len : known + lookahead;
    if ((zero = PyLong_FromLong(0)) == NULL) goto error;
    for (int i = 0; i < num_holding; i++) {
        const GroupShape *group = &groups->groups[i];
        GroupPlan *plan = &plans[i];
        PyObject *table = tables[group->gid];
        plan->done = 0;
        kv_plan_group(group, computed, known, total, PyList_GET_SIZE(table), plan);
        PyObject *pool_dict = kv_pool_dict_of(pool_dicts, group);
        if (pool_dict == NULL) goto error;
        if (computed > 0 && !trusted
            && (status = hit_is_cached(pool_dict, group->gid, table, plan->skip, hashes)) != 0)
            goto status;
        /* Hit blocks the step skips are never touched: null entries, nothing released. */
        for (Py_ssize_t index = 0; index < plan->skip; index++) {
            Py_INCREF(zero);
            PyList_SetItem(table, index, zero);
        }
        num_skipped[group->gid] = plan->skip;
        Py_ssize_t hit_real, unreferenced;
        if ((status = check_hit(pool_dict, table, &hit_real, &unreferenced)) != 0) goto status;
        if (hit_real + plan->real > group->cap) goto fallback; /* over the admission cap */
        num_real[group->gid] = hit_real + plan->real;
        need[group->pool_slot] += plan->real + unreferenced;
    }
    for (int i = 0; i < num_holding; i++) {
        const int slot = groups->groups[i].pool_slot;
        if (slot != i || need[slot] == 0) continue;
        Py_ssize_t num_free;
        if (kv_pool_num_free(pool_dicts[slot], &num_free) < 0) goto error;
        if (need[slot] > num_free) goto fallback; /* too few free blocks */
    }
    const Py_ssize_t available = PyList_GET_SIZE(token_ids);
    const Py_ssize_t upto = known < available ? known : available;
    if (groups->cacheable) {
        /* Hash before anything changes: bad token ids refuse the admission here (the
         * hasher's error, as the method's). */
        Py_CLEAR(hashes);
        if ((status = kv_hash_request(groups->hasher, request, upto, groups->hash_tokens,
                                      &hashes)) != 0)
            goto status;
        Py_INCREF(hashes);
    }
    /* From here on the admission happens. Revive every group's hit before any group takes
     * new blocks: groups sharing a pool would otherwise take each other's hit blocks. */
    for (int i = 0; i < num_holding; i++) {
        const GroupShape *group = &groups->groups[i];
        if (revive(pool_dicts[group->pool_slot], tables[group->gid]) < 0) goto error;
    }
    for (int i = 0; i < num_holding; i++) {
        const GroupShape *group = &groups->groups[i];
        PyObject *table = tables[group->gid];
        for (Py_ssize_t j = 0; j < plans[i].nulls; j++)
            if (PyList_Append(table, zero) < 0) goto error;
        if (plans[i].real == 0) continue;
        taken[i] = kv_pool_take_onto(group->pool, pool_dicts[group->pool_slot], plans[i].real,
                                     table);
        if (taken[i] == NULL) goto error;
    }
    Py_ssize_t end_limit = max_len + 1, known_limit = max_len + 1,
               computed_limit = PY_SSIZE_T_MAX;
    for (int i = 0; i < num_holding; i++) {
        const GroupShape *group = &groups->groups[i];
        const Py_ssize_t gid = group->gid, tokens = group->block_tokens;
        PyObject *table = tables[gid];
        if (groups->cacheable) {
            Py_ssize_t start, stop;
            kv_cache_range(group, num_cached[gid], known, available, &start, &stop);
            if (stop > start
                && kv_pool_cache_range(group->pool, pool_dicts[group->pool_slot], gid, hashes,
                                       table, start, stop) < 0)
                goto error;
            if (stop > num_cached[gid]) num_cached[gid] = stop;
            cache_at[gid] = (num_cached[gid] + 1) * tokens;
            if (cache_at[gid] < known_limit) known_limit = cache_at[gid];
        }
        /* FamilyRules.next_allocation_end is len(table) * block_tokens + 1 for every shape. */
        Py_ssize_t end = PyList_GET_SIZE(table) * tokens + 1;
        if (end < end_limit) end_limit = end;
        Py_ssize_t skip_at = kv_next_skip(group, plans[i].skip);
        if (skip_at < computed_limit) computed_limit = skip_at;
    }
    PyObject *blocks = PyList_New(num_groups);
    PyObject *per_group = blocks == NULL ? NULL : kv_new_block_ids(groups, taken);
    if (per_group == NULL) {
        Py_XDECREF(blocks);
        goto error;
    }
    for (Py_ssize_t gid = 0; gid < num_groups; gid++) {
        Py_INCREF(tables[gid]);
        PyList_SET_ITEM(blocks, gid, tables[gid]);
    }
    PyObject *values[STATE_FIELDS] = {
        [STATE_COMPUTED] = PyLong_FromSsize_t(known),
        [STATE_END_LIMIT] = PyLong_FromSsize_t(end_limit),
        [STATE_KNOWN_LIMIT] = PyLong_FromSsize_t(known_limit),
        [STATE_COMPUTED_LIMIT] = PyLong_FromSsize_t(computed_limit),
        [STATE_BLOCKS] = blocks,
        [STATE_NUM_REAL] = int_list(num_real, num_groups),
        [STATE_NUM_CACHED] = int_list(num_cached, num_groups),
        [STATE_CACHE_AT] = int_list(cache_at, num_groups),
        [STATE_REQUEST] = (Py_INCREF(request), request),
        [STATE_NUM_SKIPPED] = int_list(num_skipped, num_groups),
    };
    state = new_record(kv_state_type, kv_state_offsets, values, STATE_FIELDS);
    if (state == NULL || PyDict_SetItem(running, rid, state) < 0) {
        Py_DECREF(per_group);
        goto error;
    }
    /* Admitted: its handed-out prefix is spent (as the method's _admit_checked). */
    if (PyDict_DelItem(config->handed, rid) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_KeyError)) {
            Py_DECREF(per_group);
            goto error;
        }
        PyErr_Clear();
    }
    if ((result = new_allocated(per_group)) == NULL) goto error;
    goto done;
status:
    if (status > 0) goto fallback;
    goto error;
error:
fallback:
    result = NULL;
done:
    for (int i = 0; i < KV_STEP_GROUPS; i++) {
        Py_XDECREF(tables[i]);
        Py_XDECREF(taken[i]);
        Py_XDECREF(pool_dicts[i]);
    }
    Py_XDECREF(state);
    Py_XDECREF(hashes);
    Py_XDECREF(zero);
    Py_DECREF(token_ids);
    Py_DECREF(rid);
    return result;
}
