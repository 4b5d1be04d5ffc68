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
    for (Py_ssize_t i = first; i < length && !failed; i++) {
        PyObject *block = PyLong_FromLong(ids[i]);
        failed = block == NULL || PyList_Append(out, block) < 0;
        Py_XDECREF(block);
        if (!failed) {
            Py_INCREF(kv_one);
            failed = PyList_SetItem(refs, ids[i], kv_one) < 0;
        }
    }
    PyBuffer_Release(&stack);
    return failed ? -1 : PySequence_DelSlice(fresh, first, length);
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
        if (groups != NULL && hashes != NULL && rest != NULL
            && take_fresh(fresh, refs, num_fresh, taken) == 0) {
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
    PyObject *args[8] = {blocks, Py_False};
    static const int fields[6] = {POOL_REF_COUNTS, POOL_BLOCK_HASH, POOL_REUSED, POOL_FRESH,
                                  POOL_EVICTABLE, POOL_PROTECTED};
    for (int i = 0; i < 6; i++)
        if ((args[2 + i] = kv_pool_get(pool_dict, fields[i])) == NULL) return -1;
    PyObject *done = kv_py_release(NULL, args, 8);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}

int kv_pool_cache(PyObject *pool, PyObject *pool_dict, PyObject *gid, PyObject *digests,
                  PyObject *blocks) {
    /* BlockPool.cache_blocks(gid, digests, blocks). */
    PyObject *caches = kv_pool_get(pool_dict, POOL_CACHES);
    PyObject *block_hash = caches ? kv_pool_get(pool_dict, POOL_BLOCK_HASH) : NULL;
    if (block_hash == NULL) return -1;
    if (!PyDict_Check(caches)) {
        PyErr_SetString(PyExc_TypeError, "the pool's caches changed type");
        return -1;
    }
    PyObject *group_block = Py_None;
    /* Several groups share the pool: cache_blocks records the group. */
    if (PyDict_GET_SIZE(caches) > 1
        && (group_block = kv_pool_get(pool_dict, POOL_BLOCK_GROUP)) == NULL)
        return -1;
    PyObject *cache = PyDict_GetItemWithError(caches, gid);
    if (cache == NULL) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "the pool has no cache of group %R", gid);
        return -1;
    }
    PyObject *move_hash = PyObject_GetAttr(pool, names[POOL_MOVE_HASH]);
    if (move_hash == NULL) return -1;
    /* Borrowed from the pool's dicts: held across move_hash (Python code). */
    PyObject *args[7] = {gid, digests, blocks, cache, block_hash, group_block, move_hash};
    for (int i = 3; i < 6; i++) Py_INCREF(args[i]);
    PyObject *stored = kv_py_cache_blocks(NULL, args, 7);
    for (int i = 3; i < 6; i++) Py_DECREF(args[i]);
    Py_DECREF(move_hash);
    Py_XDECREF(stored);
    return stored == NULL ? -1 : 0;
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
