/* The block-boundary step of an allocator whose holding groups all follow one of the core's
 * parametric rule shapes (KVCacheAllocator._grow_checked for them, without asking the rules
 * objects): full attention (FullAttentionRules), a trailing window (TrailingWindowRules:
 * blocks below ``computed - retained`` are freed) and state checkpoints
 * (StateCheckpointRules: only the state block a step starts from and those it writes are
 * real; a state is cached when a step ends on its boundary). Every group's block is one
 * hash block. As in grow.c, anything out of the ordinary (over max_model_len or an
 * admission cap, too few free blocks, a token that cannot be hashed, multimodal inputs, a
 * request this hasher has not hashed) is left to the Python method before anything changes. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "kernels.h"
#include "records.h"

int kv_groups_config(PyObject *config, GroupsConfig *out) {
    /* (hasher, max_model_len, hash_block_size, cacheable, num_groups,
     *  ((gid, shape, block_tokens, admission_cap, retained_tokens, is_state, pool), ...)) */
    static const char *usage =
        "groups must be (hasher, max_model_len, hash_block_size, cacheable, num_groups, "
        "((gid, shape, block_tokens, admission_cap, retained_tokens, is_state, pool), ...))";
    if (!PyTuple_CheckExact(config) || PyTuple_GET_SIZE(config) != 6
        || !PyTuple_CheckExact(PyTuple_GET_ITEM(config, 5))) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    Py_ssize_t numbers[3];
    static const int positions[3] = {1, 2, 4};
    for (int i = 0; i < 3; i++) {
        numbers[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(config, positions[i]));
        if (numbers[i] == -1 && PyErr_Occurred()) return -1;
    }
    int cacheable = PyObject_IsTrue(PyTuple_GET_ITEM(config, 3));
    if (cacheable < 0) return -1;
    PyObject *groups = PyTuple_GET_ITEM(config, 5);
    Py_ssize_t count = PyTuple_GET_SIZE(groups);
    if (numbers[0] < 0 || numbers[0] >= PY_SSIZE_T_MAX / 2 || numbers[1] < 1 || numbers[2] < 1) {
        PyErr_SetString(PyExc_ValueError, "groups: max_model_len >= 0, sizes >= 1");
        return -1;
    }
    out->hasher = PyTuple_GET_ITEM(config, 0);
    out->max_len = numbers[0];
    out->hash_tokens = numbers[1];
    out->num_groups = numbers[2];
    out->cacheable = cacheable;
    out->count = count > KV_STEP_GROUPS ? -1 : (int)count;
    for (Py_ssize_t i = 0; i < count && i < KV_STEP_GROUPS; i++) {
        PyObject *group = PyTuple_GET_ITEM(groups, i);
        if (!PyTuple_CheckExact(group) || PyTuple_GET_SIZE(group) != 7) {
            PyErr_SetString(PyExc_TypeError, usage);
            return -1;
        }
        Py_ssize_t fields[6];
        for (int j = 0; j < 6; j++) {
            fields[j] = PyLong_AsSsize_t(PyTuple_GET_ITEM(group, j));
            if (fields[j] == -1 && PyErr_Occurred()) return -1;
        }
        GroupShape *shape = &out->groups[i];
        shape->gid = fields[0];
        shape->shape = fields[1];
        shape->block_tokens = fields[2];
        shape->cap = fields[3];
        shape->retained = fields[4];
        shape->is_state = fields[5] != 0;
        shape->pool = PyTuple_GET_ITEM(group, 6);
        /* One block is one hash block: hashes index blocks directly. */
        if (shape->gid < 0 || shape->gid >= out->num_groups || shape->shape < 0
            || shape->shape >= SHAPES || shape->block_tokens != out->hash_tokens
            || shape->cap < 0 || shape->retained < 0 || shape->retained >= PY_SSIZE_T_MAX / 4) {
            PyErr_SetString(PyExc_ValueError,
                            "groups: a group's block must be one hash block, its gid one of "
                            "the groups, its shape known, its cap and retained tokens >= 0");
            return -1;
        }
        shape->pool_slot = (int)i;
        for (Py_ssize_t j = 0; j < i; j++)
            if (out->groups[j].pool == shape->pool) {
                shape->pool_slot = (int)j;
                break;
            }
    }
    return 0;
}

void kv_plan_group(const GroupShape *group, Py_ssize_t computed, Py_ssize_t known,
                   Py_ssize_t total, Py_ssize_t length, GroupPlan *plan) {
    const Py_ssize_t tokens = group->block_tokens;
    Py_ssize_t skipped = 0;
    if (group->shape == SHAPE_WINDOW)
        skipped = computed > group->retained ? computed - group->retained : 0;
    else if (group->shape == SHAPE_STATE && computed > 0)
        skipped = (computed - 1) / tokens * tokens;
    Py_ssize_t skip = skipped / tokens;
    if (skip > length) skip = length;
    if (skip < plan->done) skip = plan->done;
    plan->skip = skip;
    plan->nulls = plan->real = 0;
    if (group->shape != SHAPE_STATE) {
        Py_ssize_t real = (total + tokens - 1) / tokens - length;
        plan->real = real > 0 ? real : 0;
    } else if (total > 0) {
        Py_ssize_t target = (total - 1) / tokens + 1;
        if (target > length) {
            Py_ssize_t first_real = (known > 1 ? known - 1 : 0) / tokens;
            if (first_real < length) first_real = length;
            plan->nulls = first_real - length;
            plan->real = target - first_real;
        }
    }
    plan->planned = plan->nulls || plan->real || skip > plan->done;
}

void kv_cache_range(const GroupShape *group, Py_ssize_t num_cached, Py_ssize_t known,
                    Py_ssize_t available, Py_ssize_t *start, Py_ssize_t *stop) {
    const Py_ssize_t tokens = group->block_tokens;
    const Py_ssize_t upto = known < available ? known : available, boundary = upto / tokens;
    if (group->is_state && known > available) {
        /* The step ends past the tokens the engine appended (drafts): the state it saves is
         * not the state of a known prefix, so nothing is cached. */
        *start = *stop = known / tokens;
    } else if (group->shape != SHAPE_STATE) {
        *start = num_cached;
        *stop = boundary > num_cached ? boundary : num_cached;
    } else if (upto % tokens) {
        *start = *stop = boundary;
    } else {
        *start = boundary - 1 > num_cached ? boundary - 1 : num_cached;
        *stop = boundary;
    }
}

Py_ssize_t kv_next_skip(const GroupShape *group, Py_ssize_t num_skipped) {
    if (group->shape == SHAPE_WINDOW)
        return (num_skipped + 1) * group->block_tokens + group->retained;
    if (group->shape == SHAPE_STATE) return (num_skipped + 1) * group->block_tokens + 1;
    return PY_SSIZE_T_MAX;
}

PyObject *kv_pool_dict_of(PyObject **pool_dicts, const GroupShape *group) {
    PyObject **slot = &pool_dicts[group->pool_slot];
    if (*slot == NULL) *slot = kv_pool_dict(group->pool);
    return *slot;
}

/* Release table[done:skip]'s real blocks, last first, and null the entries. */
static int drop_skipped(PyObject *pool_dict, PyObject *table, GroupPlan *plan,
                        PyObject *zero) {
    PyObject *dropped = PyList_New(0);
    if (dropped == NULL) return -1;
    for (Py_ssize_t index = plan->skip - 1; index >= plan->done; index--) {
        PyObject *block = PyList_GET_ITEM(table, index);
        int is_real = PyObject_IsTrue(block);
        if (is_real < 0 || (is_real && PyList_Append(dropped, block) < 0)) goto fail;
    }
    for (Py_ssize_t index = plan->done; index < plan->skip; index++) {
        Py_INCREF(zero);
        if (PyList_SetItem(table, index, zero) < 0) goto fail;
    }
    int failed = kv_pool_release(pool_dict, dropped);
    Py_DECREF(dropped);
    return failed;
fail:
    Py_DECREF(dropped);
    return -1;
}

PyObject *kv_new_block_ids(const GroupsConfig *config, PyObject *const *taken) {
    PyObject *per_group = PyTuple_New(config->num_groups);
    if (per_group == NULL) return NULL;
    for (Py_ssize_t gid = 0; gid < config->num_groups; gid++) {
        PyObject *ids = NULL;
        for (int i = 0; i < config->count; i++)
            if (config->groups[i].gid == gid && taken[i] != NULL) ids = PyList_AsTuple(taken[i]);
        if (ids == NULL && !PyErr_Occurred()) ids = PyTuple_New(0);
        if (ids == NULL) {
            Py_DECREF(per_group);
            return NULL;
        }
        PyTuple_SET_ITEM(per_group, gid, ids);
    }
    return per_group;
}

PyObject *kv_groups_grow(const GroupsConfig *config, PyObject *state, PyObject *request,
                         Py_ssize_t count, Py_ssize_t lookahead, PyObject *no_new_blocks) {
    if (config->count < 0 || Py_TYPE(state) != kv_state_type
        || Py_TYPE(request) != kv_request_type || kv_allocated_type == NULL)
        return NULL; /* not what the kernel knows: the method */
    const int num_holding = config->count;
    const Py_ssize_t max_len = config->max_len, num_groups = config->num_groups;
    const Py_ssize_t *fields = kv_state_offsets;
    /* The state's per-group lists, held across calls that may run Python code. */
    enum { BLOCKS, NUM_REAL, NUM_SKIPPED, NUM_CACHED, CACHE_AT, LISTS };
    static const int list_fields[LISTS] = {STATE_BLOCKS, STATE_NUM_REAL, STATE_NUM_SKIPPED,
                                           STATE_NUM_CACHED, STATE_CACHE_AT};
    PyObject *lists[LISTS] = {NULL};
    PyObject *pool_dicts[KV_STEP_GROUPS] = {NULL};
    PyObject *taken[KV_STEP_GROUPS] = {NULL};
    PyObject *hashes = NULL, *zero = NULL, *result = NULL;
    GroupPlan plans[KV_STEP_GROUPS];
    Py_ssize_t need[KV_STEP_GROUPS] = {0}, freed[KV_STEP_GROUPS] = {0};
    Py_ssize_t computed, value;
    int status, any_planned = 0, num_tables = 0;

    if ((status = record_ssize(state, fields[STATE_COMPUTED], &computed)) != 0) goto status;
    if (count > max_len || computed > max_len - count) goto fallback; /* over max_model_len */
    const Py_ssize_t known = computed + count;
    const Py_ssize_t total = lookahead > max_len - known ? max_len : known + lookahead;
    for (int i = 0; i < LISTS; i++) {
        PyObject *list = record_get(state, fields[list_fields[i]]);
        if (list == NULL || !PyList_CheckExact(list) || PyList_GET_SIZE(list) != num_groups)
            goto fallback;
        Py_INCREF(list);
        lists[i] = list;
    }
    for (int i = 0; i < num_holding; i++) {
        const GroupShape *group = &config->groups[i];
        GroupPlan *plan = &plans[i];
        PyObject *table = PyList_GET_ITEM(lists[BLOCKS], group->gid);
        if (!PyList_CheckExact(table)) goto fallback;
        Py_INCREF(table);
        plan->table = table;
        num_tables = i + 1;
        if ((status = list_ssize(lists[NUM_SKIPPED], group->gid, &plan->done)) != 0)
            goto status;
        Py_ssize_t length = PyList_GET_SIZE(table);
        kv_plan_group(group, computed, known, total, length, plan);
        plan->dropped = 0;
        if (!plan->planned) continue;
        any_planned = 1;
        if (kv_pool_dict_of(pool_dicts, group) == NULL) goto error;
        if (plan->skip > plan->done) {
            PyObject *refs = kv_pool_get(pool_dicts[group->pool_slot], POOL_REF_COUNTS);
            if (refs == NULL) goto error;
            for (Py_ssize_t index = plan->done; index < plan->skip; index++) {
                Py_ssize_t block, refs_of;
                if ((status = list_ssize(table, index, &block)) != 0) goto status;
                if (block == 0) continue;
                if (block < 0 || (status = list_ssize(refs, block, &refs_of)) != 0)
                    goto fallback_or_status;
                plan->dropped++;
                freed[group->pool_slot] += refs_of == 1;
            }
        }
        if (plan->real) {
            Py_ssize_t held;
            if ((status = list_ssize(lists[NUM_REAL], group->gid, &held)) != 0) goto status;
            if (held - plan->dropped + plan->real > group->cap) goto fallback; /* over cap */
        }
        need[group->pool_slot] += plan->real;
    }
    for (int i = 0; i < num_holding; i++) {
        const int slot = config->groups[i].pool_slot;
        if (slot != i || need[slot] == 0) continue;
        Py_ssize_t num_free;
        if (kv_pool_num_free(pool_dicts[slot], &num_free) < 0) goto error;
        if (need[slot] > num_free + freed[slot]) goto fallback; /* too few free blocks */
    }
    PyObject *token_ids = record_get(request, kv_request_offsets[REQUEST_TOKEN_IDS]);
    if (token_ids == NULL || !PyList_CheckExact(token_ids)) goto fallback;
    const Py_ssize_t available = PyList_GET_SIZE(token_ids);
    const Py_ssize_t upto = known < available ? known : available;
    if (config->cacheable) {
        /* The step's preflight: hash every hash block it knows. */
        if ((status = kv_hash_request(config->hasher, request, upto, config->hash_tokens,
                                      &hashes)) != 0)
            goto status;
        Py_INCREF(hashes);
    }
    /* From here on the step happens. */
    if ((zero = PyLong_FromLong(0)) == NULL) goto error;
    for (int i = 0; i < num_holding; i++) {
        GroupPlan *plan = &plans[i];
        if (!plan->planned || plan->skip <= plan->done) continue;
        const GroupShape *group = &config->groups[i];
        if (drop_skipped(pool_dicts[group->pool_slot], plan->table, plan, zero) < 0
            || list_set_ssize(lists[NUM_SKIPPED], group->gid, plan->skip) < 0
            || list_ssize(lists[NUM_REAL], group->gid, &value) != 0
            || list_set_ssize(lists[NUM_REAL], group->gid, value - plan->dropped) < 0)
            goto error;
    }
    for (int i = 0; i < num_holding; i++) {
        GroupPlan *plan = &plans[i];
        const GroupShape *group = &config->groups[i];
        for (Py_ssize_t j = 0; j < plan->nulls; j++)
            if (PyList_Append(plan->table, zero) < 0) goto error;
        if (plan->real == 0) continue;
        taken[i] = kv_pool_take_onto(group->pool, pool_dicts[group->pool_slot], plan->real,
                                     plan->table);
        if (taken[i] == NULL) goto error;
        if (list_ssize(lists[NUM_REAL], group->gid, &value) != 0
            || list_set_ssize(lists[NUM_REAL], group->gid, value + plan->real) < 0)
            goto error;
    }
    if (record_set_ssize(state, fields[STATE_COMPUTED], known) < 0) goto error;
    Py_ssize_t end_limit = max_len + 1, known_limit = max_len + 1,
               computed_limit = PY_SSIZE_T_MAX;
    for (int i = 0; i < num_holding; i++) {
        const GroupShape *group = &config->groups[i];
        const Py_ssize_t tokens = group->block_tokens, gid = group->gid;
        PyObject *table = plans[i].table;
        Py_ssize_t cache_from = 0, num_cached = 0;
        if (config->cacheable) {
            if (list_ssize(lists[CACHE_AT], gid, &cache_from) != 0
                || list_ssize(lists[NUM_CACHED], gid, &num_cached) != 0)
                goto error_type;
            if (upto >= cache_from) {
                Py_ssize_t start, stop;
                kv_cache_range(group, num_cached, known, available, &start, &stop);
                if (stop > start) {
                    PyObject *pool_dict = kv_pool_dict_of(pool_dicts, group);
                    if (pool_dict == NULL) goto error;
                    if (kv_pool_cache_range(group->pool, pool_dict, gid, hashes, table, start,
                                            stop) < 0)
                        goto error;
                }
                if (stop > num_cached) {
                    num_cached = stop;
                    if (list_set_ssize(lists[NUM_CACHED], gid, num_cached) < 0) goto error;
                }
                cache_from = (num_cached + 1) * tokens;
                if (list_set_ssize(lists[CACHE_AT], gid, cache_from) < 0) goto error;
            }
            if (cache_from < known_limit) known_limit = cache_from;
        }
        /* FamilyRules.next_allocation_end is len(table) * block_tokens + 1 for every shape. */
        Py_ssize_t end = PyList_GET_SIZE(table) * tokens + 1;
        if (end < end_limit) end_limit = end;
        /* plans[i].skip is the group's num_skipped now, changed by this step or not. */
        Py_ssize_t skip_at = kv_next_skip(group, plans[i].skip);
        if (skip_at < computed_limit) computed_limit = skip_at;
    }
    if (record_set_ssize(state, fields[STATE_END_LIMIT], end_limit) < 0
        || record_set_ssize(state, fields[STATE_KNOWN_LIMIT], known_limit) < 0
        || record_set_ssize(state, fields[STATE_COMPUTED_LIMIT], computed_limit) < 0)
        goto error;
    if (!any_planned) {
        Py_INCREF(no_new_blocks);
        result = no_new_blocks;
        goto done;
    }
    PyObject *per_group = kv_new_block_ids(config, taken);
    if (per_group == NULL || (result = new_allocated(per_group)) == NULL) goto error;
    goto done;
fallback_or_status:
    if (status == 0) goto fallback;
status:
    if (status > 0) goto fallback;
    goto error;
error_type:
    if (!PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "group step: the state's lists changed type");
error:
fallback:
    result = NULL;
done:
    for (int i = 0; i < LISTS; i++) Py_XDECREF(lists[i]);
    for (int i = 0; i < num_tables; i++) Py_DECREF(plans[i].table);
    for (int i = 0; i < KV_STEP_GROUPS; i++) {
        Py_XDECREF(pool_dicts[i]);
        Py_XDECREF(taken[i]);
    }
    Py_XDECREF(hashes);
    Py_XDECREF(zero);
    return result;
}
