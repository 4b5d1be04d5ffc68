/* What the block-boundary kernels (grow.c, group_step.c) do to a BlockPool without calling
 * its Python methods: read its containers, count its free blocks, take blocks (the one-block
 * cases inline and never-reused victims in one pass, telling a pool's ``_on_evict`` hook
 * as BlockPool.take does; every other count through BlockPool.take), release and cache
 * blocks through the pool's own kernels. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "kernels.h"

static PyObject *names[POOL_FIELDS];

static int intern_names(void) {
    if (names[0] != NULL) return 0;
    static const char *const texts[POOL_FIELDS] = {
        "_fresh", "ref_counts", "_evictable", "_protected", "caches", "_block_group",
        "_block_hash", "_reused", "epoch", "take", "_move_hash", "_segmented", "_on_evict",
    };
    for (int i = 0; i < POOL_FIELDS; i++)
        if ((names[i] = PyUnicode_InternFromString(texts[i])) == NULL) return -1;
    return 0;
}

PyObject *kv_pool_dict(PyObject *pool) {
    if (intern_names() < 0) return NULL;
    return PyObject_GenericGetDict(pool, NULL);
}

PyObject *kv_pool_get(PyObject *pool_dict, int field) {
    PyObject *value = PyDict_GetItemWithError(pool_dict, names[field]);
    if (value == NULL && !PyErr_Occurred()) PyErr_SetObject(PyExc_AttributeError, names[field]);
    return value;
}

int kv_pool_get_all(PyObject *pool_dict, const int *fields, int count, PyObject **out) {
    for (int i = 0; i < count; i++) out[i] = NULL;
    for (int i = 0; i < count; i++) {
        if ((out[i] = Py_XNewRef(kv_pool_get(pool_dict, fields[i]))) == NULL) {
            kv_release_all(out, i);
            return -1;
        }
    }
    return 0;
}

void kv_release_all(PyObject **objects, int count) {
    for (int i = 0; i < count; i++) Py_CLEAR(objects[i]);
}

int kv_pool_num_free(PyObject *pool_dict, Py_ssize_t *num_free) {
    /* BlockPool.num_free_blocks: uncached free + evictable + protected cached free. */
    static const int fields[3] = {POOL_FRESH, POOL_EVICTABLE, POOL_PROTECTED};
    *num_free = 0;
    for (int i = 0; i < 3; i++) {
        PyObject *container = kv_pool_get(pool_dict, fields[i]);
        Py_ssize_t size = container == NULL ? -1 : PyObject_Length(container);
        if (size < 0) return -1;
        *num_free += size;
    }
    return 0;
}

/* Move the last ``count`` ids of the free stack (an array('i')), in its order, onto ``out``
 * with ref count 1: the slice BlockPool.take hands out. -1 with an exception. */
static int take_fresh(PyObject *fresh, PyObject *refs, Py_ssize_t count, PyObject *out) {
    Py_buffer stack;
    if (count == 0) return 0;
    if (PyObject_GetBuffer(fresh, &stack, PyBUF_FORMAT) < 0) return -1;
    Py_ssize_t length = stack.len / (stack.itemsize ? stack.itemsize : 1);
    if (stack.itemsize != 4 || stack.format == NULL || strcmp(stack.format, "i") != 0
        || count > length) {
        PyBuffer_Release(&stack);
        PyErr_SetString(PyExc_TypeError, "the pool's free stack must be an array('i')");
        return -1;
    }
    const int *ids = (const int *)stack.buf;
    Py_ssize_t first = length - count, size = PyList_GET_SIZE(refs);
    for (Py_ssize_t i = first; i < length; i++) {
        if (ids[i] < 1 || ids[i] >= size) {
            PyBuffer_Release(&stack);
            PyErr_Format(PyExc_IndexError, "block id %d is not in this pool", ids[i]);
            return -1;
        }
    }
    int failed = 0;
    Py_ssize_t end = first, out_start = PyList_GET_SIZE(out);
    for (; end < length && !failed; end++) {
        PyObject *block = PyLong_FromLong(ids[end]);
        failed = block == NULL || PyList_Append(out, block) < 0;
        Py_XDECREF(block);
        if (!failed) {
            Py_INCREF(kv_one);
            failed = PyList_SetItem(refs, ids[end], kv_one) < 0;
        }
    }
    if (failed) {
        /* Nothing half-applied: the blocks stay on the free stack, uncounted. */
        for (Py_ssize_t i = first; i < end; i++) {
            PyObject *zero = PyLong_FromLong(0);
            if (zero == NULL || PyList_SetItem(refs, ids[i], zero) < 0) break;
        }
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        if (PyList_SetSlice(out, out_start, PyList_GET_SIZE(out), NULL) < 0) PyErr_Clear();
        PyErr_Restore(type, value, traceback);
    }
    PyBuffer_Release(&stack);
    return failed ? -1 : PySequence_DelSlice(fresh, first, length);
}

/* BlockPool._give_back: the blocks a failed take had taken (``taken``: the uncached ones
 * and the cached ones evicted so far) free and uncached again, ref count 0 and back on the
 * free stack, nothing lost; the exception in flight is kept. */
static void give_back(PyObject *fresh, PyObject *refs, PyObject *taken) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *zero = PyLong_FromLong(0);
    for (Py_ssize_t i = 0; zero != NULL && i < PyList_GET_SIZE(taken); i++) {
        Py_ssize_t block = PyLong_AsSsize_t(PyList_GET_ITEM(taken, i));
        if (block > 0 && block < PyList_GET_SIZE(refs)) PyList_SetItem(refs, block, Py_NewRef(zero));
    }
    Py_XDECREF(zero);
    PyObject *done = PyObject_CallMethod(fresh, "extend", "O", taken);
    Py_XDECREF(done);
    PyErr_Clear(); /* the take's own error is the one to raise */
    PyErr_Restore(type, value, traceback);
}

/* The pool's attribute ``field``, held in ``held[field]`` (released by kv_pool_take), or
 * NULL with AttributeError. */
static PyObject *held_field(PyObject *pool_dict, int field, PyObject **held) {
    PyObject *value = kv_pool_get(pool_dict, field);
    Py_XINCREF(value);
    held[field] = value;
    return value;
}

static PyObject *take_held(PyObject *pool, PyObject *pool_dict, Py_ssize_t count,
                           PyObject **held) {
    PyObject *refs = held_field(pool_dict, POOL_REF_COUNTS, held);
    PyObject *fresh = refs == NULL ? NULL : held_field(pool_dict, POOL_FRESH, held);
    PyObject *evictable = fresh == NULL ? NULL : held_field(pool_dict, POOL_EVICTABLE, held);
    if (evictable == NULL) return NULL;
    if (!PyList_CheckExact(refs)) {
        PyErr_SetString(PyExc_TypeError, "the pool's ref_counts changed type");
        return NULL;
    }
    Py_ssize_t num_fresh = PyObject_Length(fresh), num_evictable;
    if (num_fresh < 0) return NULL;
    if (count <= num_fresh) {
        /* Uncached blocks cover it. */
        PyObject *taken = PyList_New(0);
        if (taken == NULL || take_fresh(fresh, refs, count, taken) < 0) {
            Py_XDECREF(taken);
            return NULL;
        }
        return taken;
    }
    if ((num_evictable = PyObject_Length(evictable)) < 0) return NULL;
    PyObject *on_evict = held_field(pool_dict, POOL_ON_EVICT, held);
    if (on_evict == NULL) return NULL;
    if (count - num_fresh <= num_evictable) {
        /* Every uncached block, then never-reused cached ones evicted in one pass; a pool
         * with an eviction hook (offload tiers) then tells it the victims, as
         * BlockPool.take does. */
        PyObject *caches = held_field(pool_dict, POOL_CACHES, held);
        PyObject *block_group = caches ? held_field(pool_dict, POOL_BLOCK_GROUP, held) : NULL;
        PyObject *block_hash = block_group ? held_field(pool_dict, POOL_BLOCK_HASH, held) : NULL;
        PyObject *taken = block_hash == NULL ? NULL : PyList_New(0);
        if (taken == NULL) return NULL;
        int hooked = on_evict != Py_None;
        /* Held: the hook runs Python code, after which the pool's dict may not hold it. */
        PyObject *hook = hooked ? Py_NewRef(on_evict) : NULL;
        PyObject *groups = hooked ? PyList_New(0) : Py_NewRef(Py_None);
        PyObject *hashes = hooked ? PyList_New(0) : Py_NewRef(Py_None);
        PyObject *rest = PyLong_FromSsize_t(count - num_fresh);
        PyObject *done = NULL;
        int fresh_taken = 0; /* the uncached blocks moved onto ``taken`` */
        if (groups != NULL && hashes != NULL && rest != NULL
            && (fresh_taken = take_fresh(fresh, refs, num_fresh, taken) == 0)) {
            PyObject *args[9] = {rest,       taken, evictable, caches, block_group,
                                 block_hash, refs,  groups,    hashes};
            done = kv_py_evict_take(NULL, args, hooked ? 9 : 7);
        }
        Py_XDECREF(rest);
        PyObject *epoch = done == NULL ? NULL : held_field(pool_dict, POOL_EPOCH, held);
        PyObject *next = epoch == NULL ? NULL : PyNumber_Add(epoch, kv_one);
        int failed = next == NULL || PyDict_SetItem(pool_dict, names[POOL_EPOCH], next) < 0;
        Py_XDECREF(done);
        Py_XDECREF(next);
        if (!failed && hooked) {
            PyObject *victims = PyList_GetSlice(taken, num_fresh, PY_SSIZE_T_MAX);
            PyObject *call[3] = {groups, hashes, victims};
            PyObject *told = victims == NULL ? NULL : PyObject_Vectorcall(hook, call, 3, NULL);
            failed = told == NULL;
            Py_XDECREF(told);
            Py_XDECREF(victims);
        }
        Py_XDECREF(hook);
        Py_XDECREF(groups);
        Py_XDECREF(hashes);
        if (failed) {
            if (fresh_taken) give_back(fresh, refs, taken);
            Py_DECREF(taken);
            return NULL;
        }
        return taken;
    }
    /* Reused (protected) blocks too: BlockPool.take's general path. */
    PyObject *number = PyLong_FromSsize_t(count);
    if (number == NULL) return NULL;
    PyObject *taken = PyObject_CallMethodOneArg(pool, names[POOL_TAKE], number);
    Py_DECREF(number);
    if (taken != NULL && !PyList_CheckExact(taken)) {
        Py_DECREF(taken);
        PyErr_SetString(PyExc_TypeError, "BlockPool.take must return a list");
        return NULL;
    }
    return taken;
}

PyObject *kv_pool_take(PyObject *pool, PyObject *pool_dict, Py_ssize_t count) {
    /* Everything read from the pool is held for the whole take: a container's __len__, a
     * hostile cache key's __eq__ (an eviction deletes keys) or the hook may replace the
     * pool's attributes, freeing what a borrowed pointer would still read. */
    PyObject *held[POOL_FIELDS] = {NULL};
    PyObject *taken = take_held(pool, pool_dict, count, held);
    for (int i = 0; i < POOL_FIELDS; i++) Py_XDECREF(held[i]);
    return taken;
}

PyObject *kv_pool_take_onto(PyObject *pool, PyObject *pool_dict, Py_ssize_t count,
                            PyObject *table) {
    PyObject *taken = kv_pool_take(pool, pool_dict, count);
    Py_ssize_t end = taken == NULL ? 0 : PyList_GET_SIZE(table);
    if (taken != NULL && PyList_SetSlice(table, end, end, taken) < 0) Py_CLEAR(taken);
    return taken;
}

int kv_pool_release(PyObject *pool_dict, PyObject *blocks) {
    static const int fields[6] = {POOL_REF_COUNTS, POOL_BLOCK_HASH, POOL_REUSED, POOL_FRESH,
                                  POOL_EVICTABLE, POOL_PROTECTED};
    PyObject *args[8] = {blocks, Py_False};
    if (kv_pool_get_all(pool_dict, fields, 6, args + 2) < 0) return -1;
    PyObject *done = kv_py_release(NULL, args, 8);
    kv_release_all(args + 2, 6);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}

int kv_pool_cache(PyObject *pool, PyObject *pool_dict, PyObject *gid, PyObject *digests,
                  PyObject *blocks) {
    /* BlockPool.cache_blocks(gid, digests, blocks). Everything read is held until the end:
     * a lookup (a hostile key of the pool's __dict__ or of its caches) or move_hash (Python
     * code) may replace what was read. */
    static const int fields[2] = {POOL_CACHES, POOL_BLOCK_HASH};
    PyObject *held[2], *group_block = NULL, *cache = NULL, *move_hash = NULL;
    int status = -1;
    if (kv_pool_get_all(pool_dict, fields, 2, held) < 0) return -1;
    PyObject *caches = held[0], *block_hash = held[1];
    if (!PyDict_Check(caches)) {
        PyErr_SetString(PyExc_TypeError, "the pool's caches changed type");
        goto done;
    }
    /* Several groups share the pool: cache_blocks records the group. */
    group_block = PyDict_GET_SIZE(caches) > 1
        ? Py_XNewRef(kv_pool_get(pool_dict, POOL_BLOCK_GROUP)) : Py_NewRef(Py_None);
    if (group_block == NULL) goto done;
    if ((cache = Py_XNewRef(PyDict_GetItemWithError(caches, gid))) == NULL) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "the pool has no cache of group %R", gid);
        goto done;
    }
    if ((move_hash = PyObject_GetAttr(pool, names[POOL_MOVE_HASH])) == NULL) goto done;
    PyObject *args[7] = {gid, digests, blocks, cache, block_hash, group_block, move_hash};
    PyObject *stored = kv_py_cache_blocks(NULL, args, 7);
    status = stored == NULL ? -1 : 0;
    Py_XDECREF(stored);
done:
    kv_release_all(held, 2);
    Py_XDECREF(group_block);
    Py_XDECREF(cache);
    Py_XDECREF(move_hash);
    return status;
}

int kv_pool_cache_range(PyObject *pool, PyObject *pool_dict, Py_ssize_t gid, PyObject *hashes,
                        PyObject *table, Py_ssize_t start, Py_ssize_t stop) {
    PyObject *digests = PyList_GetSlice(hashes, start, stop);
    PyObject *ids = digests == NULL ? NULL : PyList_GetSlice(table, start, stop);
    PyObject *gid_object = ids == NULL ? NULL : PyLong_FromSsize_t(gid);
    int failed = gid_object == NULL
        || kv_pool_cache(pool, pool_dict, gid_object, digests, ids) < 0;
    Py_XDECREF(gid_object);
    Py_XDECREF(digests);
    Py_XDECREF(ids);
    return failed ? -1 : 0;
}
