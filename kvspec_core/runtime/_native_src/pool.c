/* Twins of BlockPool's per-block loops, over the pool's own containers: ref counts (a list of
 * ints), cached hashes (a list of bytes or None), reused flags (a bytearray), group ids (an
 * array of uint16), the free stack (an array of int) and the two eviction orders
 * (BlockQueues: the kernels serve only pools built with them). Block ids are bounds-checked
 * before anything changes. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "block_queue.h"
#include "dict_prefetch.h"
#include "kernels.h"


int kv_dict_layout_known = 0;

int kv_dict_prefetch_init(void) {
    kv_dict_layout_known = 0;
#ifdef KV_DICT_PREFETCH
    enum { KEYS = 100 };
    PyObject *dict = PyDict_New(), *keys_held = PyList_New(0);
    if (dict == NULL || keys_held == NULL) goto fail;
    for (int i = 0; i < KEYS; i++) {
        PyObject *key = PyBytes_FromFormat("kvspec dict layout check %d", i);
        PyObject *value = key ? PyLong_FromLong(i) : NULL;
        int failed = value == NULL || PyDict_SetItem(dict, key, value) < 0
                     || PyList_Append(keys_held, key) < 0;
        Py_XDECREF(key);
        Py_XDECREF(value);
        if (failed) goto fail;
    }
    const kv_dict_keys *keys = kv_dict_keys_of(dict);
    unsigned log2_size = keys->dk_log2_size;
    /* Index width: 1 byte up to 0xff slots, 2 up to 0xffff (a dict of 100 keys: 1 or 2). */
    unsigned width_log2 = log2_size <= 7 ? 0 : 1;
    size_t size = (size_t)1 << (log2_size < 31 ? log2_size : 0);
    int matches = keys->dk_kind == KV_DICT_KEYS_GENERAL && keys->dk_nentries == KEYS
                  && log2_size >= 7 && log2_size <= 10
                  && keys->dk_log2_index_bytes == log2_size + width_log2
                  && (size_t)(keys->dk_usable + keys->dk_nentries) == (size << 1) / 3;
    int found = 0;
    for (Py_ssize_t i = 0; matches && i < KEYS; i++) {
        PyObject *key = PyList_GET_ITEM(keys_held, i);
        Py_hash_t hash = kv_bytes_hash(key);
        unsigned width;
        const char *slot = kv_dict_first_slot(keys, hash, &width);
        int64_t index = width == 0 ? *(const int8_t *)slot : *(const int16_t *)slot;
        if (index < -2 || index >= KEYS) {
            matches = 0;
            break;
        }
        if (index < 0) continue;
        const char *entries = keys->dk_indices + ((size_t)1 << keys->dk_log2_index_bytes);
        const void *const *entry = (const void *const *)(entries + index * 3 * sizeof(void *));
        if (entry[1] == (const void *)key && *(const Py_hash_t *)&entry[0] == hash) found++;
    }
    /* Most keys sit where their first probe points (a table at most 2/3 full). */
    kv_dict_layout_known = matches && found >= KEYS / 2;
    Py_DECREF(dict);
    Py_DECREF(keys_held);
    return 0;
fail:
    Py_XDECREF(dict);
    Py_XDECREF(keys_held);
    return -1;
#else
    return 0;
#endif
}

static inline int block_in_range(Py_ssize_t block, Py_ssize_t size) {
    if (block < 0 || block >= size) {
        PyErr_Format(PyExc_IndexError, "block id %zd is not in this pool (0..%zd)", block,
                     size - 1);
        return 0;
    }
    return 1;
}

/* A block id: an exact int (reading anything else could run its __index__, which could
 * change the lists being read); -1 with TypeError (or OverflowError) if it is not one. */
static inline Py_ssize_t block_id(PyObject *item) {
    if (!PyLong_CheckExact(item)) {
        PyErr_Format(PyExc_TypeError, "block ids must be ints, not %.100s",
                     Py_TYPE(item)->tp_name);
        return -1;
    }
    return PyLong_AsSsize_t(item);
}

/* Block ids of a list, bounds-checked; NULL with an exception on a bad item. */
static Py_ssize_t *block_ids_of(PyObject *blocks, Py_ssize_t size, Py_ssize_t *count) {
    if (!PyList_Check(blocks)) {
        PyErr_SetString(PyExc_TypeError, "blocks must be a list");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(blocks);
    Py_ssize_t *ids = PyMem_Malloc(sizeof(Py_ssize_t) * (n ? n : 1));
    if (ids == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t block = block_id(PyList_GET_ITEM(blocks, i));
        if ((block == -1 && PyErr_Occurred()) || !block_in_range(block, size)) {
            PyMem_Free(ids);
            return NULL;
        }
        ids[i] = block;
    }
    *count = n;
    return ids;
}

/* The ref count of a block (an exact int: no code runs); -1 with an exception if not. */
static inline Py_ssize_t ref_of(PyObject *refs, Py_ssize_t block) {
    PyObject *count = PyList_GET_ITEM(refs, block);
    if (!PyLong_CheckExact(count)) {
        PyErr_SetString(PyExc_TypeError, "ref counts must be ints");
        return -1;
    }
    return PyLong_AsSsize_t(count);
}

static inline int set_ref(PyObject *refs, Py_ssize_t block, Py_ssize_t count) {
    PyObject *value = PyLong_FromSsize_t(count);
    if (value == NULL) return -1;
    PyObject *old = PyList_GET_ITEM(refs, block);
    PyList_SET_ITEM(refs, block, value);
    Py_DECREF(old);
    return 0;
}

/* The pool's two eviction orders, BlockQueues of its size (a pool built with the kernels). */
static int pool_queues(PyObject *evictable, PyObject *protected_, Py_ssize_t size,
                       BlockQueue **evict_queue, BlockQueue **protect_queue) {
    *evict_queue = as_queue(evictable, size);
    *protect_queue = as_queue(protected_, size);
    if (*evict_queue == NULL || *protect_queue == NULL) {
        PyErr_SetString(PyExc_TypeError,
                        "the eviction orders must be the pool's BlockQueues (a pool built with "
                        "the compiled kernels)");
        return -1;
    }
    return 0;
}

static int check_pool_lists(PyObject *refs, PyObject *block_hash, PyObject *reused) {
    if (!PyList_CheckExact(refs) || !PyList_CheckExact(block_hash)
        || !PyByteArray_CheckExact(reused)
        || PyList_GET_SIZE(block_hash) != PyList_GET_SIZE(refs)
        || PyByteArray_GET_SIZE(reused) != PyList_GET_SIZE(refs)) {
        PyErr_SetString(PyExc_TypeError,
                        "refs, block_hash (lists) and reused (bytearray) must be one pool's");
        return -1;
    }
    return 0;
}

/* release(blocks, reverse, refs, block_hash, reused, fresh, evictable, protected): drop one
 * reference from each non-null block (last first if ``reverse``); a block reaching 0 joins
 * ``fresh`` (no cached hash), ``protected`` (reused) or ``evictable``, in release order.
 * BlockPool._release_unchecked; the caller has checked no count goes below 0. */
PyObject *kv_py_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "release takes 8 arguments");
        return NULL;
    }
    PyObject *refs = args[2], *block_hash = args[3], *reused = args[4], *fresh = args[5],
             *evictable = args[6], *protected_ = args[7];
    int reverse = PyObject_IsTrue(args[1]);
    if (reverse < 0 || check_pool_lists(refs, block_hash, reused) < 0) return NULL;
    Py_ssize_t count;
    Py_ssize_t *ids = block_ids_of(args[0], PyList_GET_SIZE(refs), &count);
    if (ids == NULL) return NULL;
    BlockQueue *queues[2]; /* evictable, protected: by the reused flag */
    if (pool_queues(evictable, protected_, PyList_GET_SIZE(refs), &queues[0], &queues[1]) < 0) {
        PyMem_Free(ids);
        return NULL;
    }
    const char *flags = PyByteArray_AS_STRING(reused);
    PyObject *uncached = PyList_New(0);
    if (uncached == NULL) goto fail;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t block = ids[reverse ? count - 1 - i : i];
        if (!block) continue;
        Py_ssize_t refs_now = ref_of(refs, block);
        if (refs_now == -1 && PyErr_Occurred()) goto fail;
        Py_ssize_t refs_left = refs_now - 1;
        if (set_ref(refs, block, refs_left) < 0) goto fail;
        if (refs_left) continue;
        if (PyList_GET_ITEM(block_hash, block) == Py_None) {
            PyObject *key = PyList_GET_ITEM(args[0], reverse ? count - 1 - i : i);
            if (PyList_Append(uncached, key) < 0) goto fail;
            continue;
        }
        BlockQueue *queue = queues[flags[block] ? 1 : 0];
        if (queue->prev == NULL && kv_queue_alloc(queue) < 0) goto fail;
        if (!queue_has(queue, block)) queue_push(queue, block);
    }
    if (PyList_GET_SIZE(uncached)) {
        PyObject *done = PyObject_CallMethodOneArg(fresh, kv_str_extend, uncached);
        if (done == NULL) goto fail;
        Py_DECREF(done);
    }
    Py_DECREF(uncached);
    PyMem_Free(ids);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(uncached);
    PyMem_Free(ids);
    return NULL;
}

Py_ssize_t kv_first_unrevivable(PyObject *blocks, PyObject *refs, PyObject *evictable,
                                PyObject *protected_, Py_ssize_t *num_real,
                                Py_ssize_t *num_unreferenced) {
    Py_ssize_t size = PyList_GET_SIZE(refs), real = 0, unreferenced = 0;
    BlockQueue *queues[2];
    if (pool_queues(evictable, protected_, size, &queues[0], &queues[1]) < 0) return -2;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(blocks); i++) {
        Py_ssize_t block = block_id(PyList_GET_ITEM(blocks, i));
        if (block == -1 && PyErr_Occurred()) return -2;
        if (!block) continue;
        if (block < 0 || block >= size) return i;
        Py_ssize_t refs_now = ref_of(refs, block);
        if (refs_now == -1 && PyErr_Occurred()) return -2;
        real++;
        if (refs_now) continue;
        if (!queue_has(queues[0], block) && !queue_has(queues[1], block)) return i;
        unreferenced++;
    }
    if (num_real != NULL) *num_real = real;
    if (num_unreferenced != NULL) *num_unreferenced = unreferenced;
    return -1;
}

/* touch(blocks, refs, reused, evictable, protected, segmented, check) -> int: add a
 * reference to each non-null block; a free one leaves its eviction order; ``segmented``
 * marks each reused. With ``check``, first finds a block that is neither in use nor a cached
 * free block: returns its position in ``blocks`` and changes nothing. Returns -1 when done.
 * BlockPool.touch. */
PyObject *kv_py_touch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "touch takes 7 arguments");
        return NULL;
    }
    PyObject *refs = args[1], *reused = args[2], *evictable = args[3], *protected_ = args[4];
    int segmented = PyObject_IsTrue(args[5]), check = PyObject_IsTrue(args[6]);
    if (segmented < 0 || check < 0) return NULL;
    if (!PyList_CheckExact(refs) || !PyByteArray_CheckExact(reused)
        || PyByteArray_GET_SIZE(reused) != PyList_GET_SIZE(refs) || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError,
                        "touch: blocks and refs must be lists, reused a bytearray");
        return NULL;
    }
    PyObject *blocks = args[0];
    Py_ssize_t size = PyList_GET_SIZE(refs), count = PyList_GET_SIZE(blocks);
    BlockQueue *queues[2]; /* evictable, protected: by the reused flag */
    if (pool_queues(evictable, protected_, size, &queues[0], &queues[1]) < 0) return NULL;
    if (check) {
        Py_ssize_t bad = kv_first_unrevivable(blocks, refs, evictable, protected_, NULL, NULL);
        if (bad == -2) return NULL;
        if (bad >= 0) return PyLong_FromSsize_t(bad);
    }
    char *flags = PyByteArray_AS_STRING(reused);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *key = PyList_GET_ITEM(blocks, i);
        Py_ssize_t block = block_id(key);
        if (block == -1 && PyErr_Occurred()) return NULL;
        if (!block) continue;
        if (!block_in_range(block, size)) return NULL;
        Py_ssize_t refs_now = ref_of(refs, block);
        if (refs_now == -1 && PyErr_Occurred()) return NULL;
        if (refs_now == 0) {
            BlockQueue *queue = queues[flags[block] ? 1 : 0];
            if (!queue_has(queue, block)) {
                PyErr_SetObject(PyExc_KeyError, key);
                return NULL;
            }
            queue_unlink(queue, block);
        }
        if (segmented) flags[block] = 1;
        if (set_ref(refs, block, refs_now + 1) < 0) return NULL;
    }
    return PyLong_FromLong(-1);
}

/* Ask the CPU for what the next victims' rounds of evict_take read (in a large pool, each
 * is a cache miss): the block after ``block`` in the queue, its hash and ref count slots,
 * group id and its hash's index slot in ``cache`` (the last victim's group's; NULL: none
 * yet), and the hash slot of the one after that. Reads only in-range slots, and a
 * prefetch never faults: where code changed anything meanwhile it is only wasted. */
static inline void prefetch_victims(const BlockQueue *queue, Py_ssize_t block,
                                    PyObject *block_hash, PyObject *refs,
                                    const uint16_t *group_of, Py_ssize_t size, PyObject *cache) {
#if defined(__GNUC__) || defined(__clang__)
    Py_ssize_t next = queue->next[block];
    if (next < 0 || next >= size || next >= PyList_GET_SIZE(block_hash)
        || next >= PyList_GET_SIZE(refs))
        return;
    __builtin_prefetch(&queue->next[next]);
    __builtin_prefetch(&group_of[next]);
    __builtin_prefetch(&PyList_GET_ITEM(refs, next));
    __builtin_prefetch(PyList_GET_ITEM(block_hash, next));
    /* Its hash's slot in the cache the current victim leaves (most often its own). */
    if (cache != NULL) kv_prefetch_dict_index(cache, PyList_GET_ITEM(block_hash, next));
    Py_ssize_t after = queue->next[next];
    if (after >= 0 && after < size && after < PyList_GET_SIZE(block_hash))
        __builtin_prefetch(&PyList_GET_ITEM(block_hash, after));
#else
    (void)queue, (void)block, (void)block_hash, (void)refs, (void)group_of, (void)size,
        (void)cache;
#endif
}

/* evict_take(count, out, evictable, caches, block_group, block_hash, refs[, groups_out,
 * hashes_out]): pop ``count`` blocks from the front of ``evictable`` (never-reused cached free
 * blocks, oldest first), drop each from its group's cache (``caches[block_group[block]]``),
 * give it ref count 1 and append it to ``out``; with the two lists (None: not wanted), also
 * append each victim's group id and hash to them (what the pool's eviction hook is told).
 * BlockPool.take's one-pass eviction; the caller checked that ``evictable`` holds ``count``
 * blocks. */
PyObject *kv_py_evict_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 && nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "evict_take takes 7 or 9 arguments");
        return NULL;
    }
    Py_ssize_t count = PyLong_AsSsize_t(args[0]);
    if (count == -1 && PyErr_Occurred()) return NULL;
    PyObject *out = args[1], *evictable = args[2], *caches = args[3], *block_hash = args[5],
             *refs = args[6];
    /* Exact lists (appending to them runs no Python code), or None. */
    PyObject *groups_out = nargs == 9 && args[7] != Py_None ? args[7] : NULL;
    PyObject *hashes_out = nargs == 9 && args[8] != Py_None ? args[8] : NULL;
    if (!PyList_Check(out) || !PyDict_Check(caches) || !PyList_CheckExact(block_hash)
        || !PyList_CheckExact(refs) || PyList_GET_SIZE(refs) != PyList_GET_SIZE(block_hash)
        || (groups_out != NULL && !PyList_CheckExact(groups_out))
        || (hashes_out != NULL && !PyList_CheckExact(hashes_out))) {
        PyErr_SetString(PyExc_TypeError, "evict_take: bad pool containers");
        return NULL;
    }
    Py_buffer groups;
    if (PyObject_GetBuffer(args[4], &groups, PyBUF_FORMAT) < 0) return NULL;
    if (groups.itemsize != 2 || groups.len / 2 != PyList_GET_SIZE(refs)) {
        PyBuffer_Release(&groups);
        PyErr_SetString(PyExc_TypeError, "evict_take: block_group must be the pool's array('H')");
        return NULL;
    }
    const uint16_t *group_of = (const uint16_t *)groups.buf;
    Py_ssize_t size = PyList_GET_SIZE(refs);
    PyObject *cache = NULL, *cache_gid = NULL; /* held: the last group's cache and id */
    long last_gid = -1;
    BlockQueue *queue = as_queue(evictable, size);
    if (queue == NULL) {
        PyErr_SetString(PyExc_TypeError, "evict_take: evictable must be the pool's BlockQueue");
        goto fail;
    }
    if (queue->length < count) {
        PyErr_SetString(PyExc_KeyError, "evict_take: too few blocks");
        goto fail;
    }
    Py_ssize_t sentinel = queue->capacity;
    for (Py_ssize_t i = 0; i < count; i++) {
        /* A digest's code run by an earlier deletion may have cleared the queue (freeing
         * its arrays) or shrunk the lists. */
        if (queue->prev == NULL || queue->length == 0) {
            PyErr_SetString(PyExc_RuntimeError, "evict_take: the eviction order changed");
            goto fail;
        }
        Py_ssize_t block = queue->next[sentinel]; /* the oldest */
        if (!block_in_range(block, size) || !block_in_range(block, PyList_GET_SIZE(block_hash))
            || !block_in_range(block, PyList_GET_SIZE(refs)))
            goto fail;
        prefetch_victims(queue, block, block_hash, refs, group_of, size, cache);
        PyObject *key = PyLong_FromSsize_t(block);
        if (key == NULL) goto fail;
        int appended = PyList_Append(out, key);
        Py_DECREF(key);
        if (appended < 0) goto fail;
        queue_unlink(queue, block);
        if (group_of[block] != last_gid) {
            last_gid = group_of[block];
            Py_CLEAR(cache_gid);
            cache_gid = PyLong_FromLong(last_gid);
            if (cache_gid == NULL) goto fail;
            Py_CLEAR(cache);
            cache = PyDict_GetItemWithError(caches, cache_gid);
            Py_XINCREF(cache);
            if (cache == NULL) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_KeyError, "no cache of group %ld", last_gid);
                goto fail;
            }
        }
        if (groups_out != NULL && PyList_Append(groups_out, cache_gid) < 0) goto fail;
        PyObject *digest = PyList_GET_ITEM(block_hash, block);
        if (hashes_out != NULL && PyList_Append(hashes_out, digest) < 0) goto fail;
        Py_INCREF(Py_None);
        PyList_SET_ITEM(block_hash, block, Py_None);
        int failed = PyDict_DelItem(cache, digest); /* the digest's code may run here */
        Py_DECREF(digest);
        if (failed < 0) goto fail;
        if (block >= PyList_GET_SIZE(refs) || block >= PyList_GET_SIZE(block_hash)) {
            PyErr_SetString(PyExc_RuntimeError, "evict_take: the pool's lists changed");
            goto fail;
        }
        if (set_ref(refs, block, 1) < 0) goto fail;
    }
    Py_XDECREF(cache);
    Py_XDECREF(cache_gid);
    PyBuffer_Release(&groups);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(cache);
    Py_XDECREF(cache_gid);
    PyBuffer_Release(&groups);
    return NULL;
}

/* Before looking up ``keys[i]`` in ``dict`` in a loop over the list: ask for the index slot
 * of the key PREFETCH_AHEAD further on and for the entry of the one half as far (whose slot
 * was asked for earlier), so the misses of several lookups overlap (dict_prefetch.h). Reads
 * only in-range list items, which are exact bytes or skipped: no code runs. */
#define PREFETCH_AHEAD 8
static inline void prefetch_lookups(PyObject *dict, PyObject *keys, Py_ssize_t i) {
    Py_ssize_t size = PyList_GET_SIZE(keys);
    if (i + PREFETCH_AHEAD < size)
        kv_prefetch_dict_index(dict, PyList_GET_ITEM(keys, i + PREFETCH_AHEAD));
    if (i + PREFETCH_AHEAD / 2 < size)
        kv_prefetch_dict_entry(dict, PyList_GET_ITEM(keys, i + PREFETCH_AHEAD / 2));
}

/* cache_blocks(gid, digests, blocks, cache, block_hash, block_group, move_hash) -> int: for
 * each (digest, block) pair of a non-null block with no cached hash: map ``digest`` to it in
 * ``cache`` (an entry naming another block calls ``move_hash(cache, digest, old, block)``),
 * record the hash and, with ``block_group`` not None, the group. Returns how many blocks were
 * newly cached. BlockPool.cache_blocks. */
PyObject *kv_py_cache_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "cache_blocks takes 7 arguments");
        return NULL;
    }
    long gid = PyLong_AsLong(args[0]);
    if (gid == -1 && PyErr_Occurred()) return NULL;
    PyObject *digests = args[1], *blocks = args[2], *cache = args[3], *block_hash = args[4],
             *move_hash = args[6];
    if (!PyList_Check(digests) || !PyList_Check(blocks) || !PyDict_Check(cache)
        || !PyList_CheckExact(block_hash)) {
        PyErr_SetString(PyExc_TypeError, "cache_blocks: digests, blocks, block_hash must be lists");
        return NULL;
    }
    Py_buffer groups;
    uint16_t *group_of = NULL;
    Py_ssize_t size = PyList_GET_SIZE(block_hash);
    if (args[5] != Py_None) {
        if (PyObject_GetBuffer(args[5], &groups, PyBUF_FORMAT | PyBUF_WRITABLE) < 0) return NULL;
        if (groups.itemsize != 2 || groups.len / 2 != size) {
            PyBuffer_Release(&groups);
            PyErr_SetString(PyExc_TypeError, "cache_blocks: block_group must be array('H')");
            return NULL;
        }
        group_of = (uint16_t *)groups.buf;
    }
    /* Every id checked before anything changes (nothing half-applied); again in the loop,
     * where code a digest or move_hash runs may have changed the lists. */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(digests) && i < PyList_GET_SIZE(blocks); i++) {
        Py_ssize_t block = block_id(PyList_GET_ITEM(blocks, i));
        if ((block == -1 && PyErr_Occurred()) || !block_in_range(block, size)) goto fail;
    }
    Py_ssize_t stored = 0;
    /* The lists are re-read each time: a digest's __hash__ / __eq__ and move_hash may run
     * Python code that changes them (the pair at hand is held meanwhile). */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(digests) && i < PyList_GET_SIZE(blocks); i++) {
        prefetch_lookups(cache, digests, i);
        PyObject *key = PyList_GET_ITEM(blocks, i);
        Py_ssize_t block = block_id(key);
        /* ``size``: the group buffer's (and the pool's) size when the call began. */
        if ((block == -1 && PyErr_Occurred()) || !block_in_range(block, size)
            || !block_in_range(block, PyList_GET_SIZE(block_hash)))
            goto fail;
        if (!block || PyList_GET_ITEM(block_hash, block) != Py_None) continue;
        PyObject *digest = PyList_GET_ITEM(digests, i);
        Py_INCREF(key);
        Py_INCREF(digest);
        PyObject *old = PyDict_SetDefault(cache, digest, key); /* borrowed */
        Py_XINCREF(old);
        int failed = old == NULL;
        if (!failed && old != key) {
            Py_ssize_t old_block = PyLong_AsSsize_t(old);
            failed = old_block == -1 && PyErr_Occurred();
            if (!failed && old_block != block) {
                PyObject *call[4] = {cache, digest, old, key};
                PyObject *done = PyObject_Vectorcall(move_hash, call, 4, NULL);
                failed = done == NULL;
                Py_XDECREF(done);
            }
        }
        if (!failed && block >= PyList_GET_SIZE(block_hash)) {
            PyErr_SetString(PyExc_RuntimeError, "cache_blocks: the pool's lists changed");
            failed = 1;
        }
        Py_XDECREF(old);
        Py_DECREF(key);
        if (failed) {
            Py_DECREF(digest);
            goto fail;
        }
        PyObject *previous = PyList_GET_ITEM(block_hash, block);
        PyList_SET_ITEM(block_hash, block, digest); /* steals the held reference */
        Py_DECREF(previous);
        if (group_of != NULL) group_of[block] = (uint16_t)gid;
        stored++;
    }
    if (group_of != NULL) PyBuffer_Release(&groups);
    return PyLong_FromSsize_t(stored);
fail:
    if (group_of != NULL) PyBuffer_Release(&groups);
    return NULL;
}

/* count_unreferenced(blocks, refs) -> int: how many non-null blocks of ``blocks`` have ref
 * count 0. BlockPool.num_unreferenced. */
PyObject *kv_py_count_unreferenced(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_Check(args[0]) || !PyList_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "count_unreferenced(blocks, refs): two lists");
        return NULL;
    }
    PyObject *blocks = args[0], *refs = args[1];
    Py_ssize_t size = PyList_GET_SIZE(refs), count = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(blocks); i++) {
        Py_ssize_t block = block_id(PyList_GET_ITEM(blocks, i));
        if ((block == -1 && PyErr_Occurred()) || !block_in_range(block, size)) return NULL;
        if (!block) continue;
        Py_ssize_t refs_now = ref_of(refs, block);
        if (refs_now == -1 && PyErr_Occurred()) return NULL;
        count += refs_now == 0;
    }
    return PyLong_FromSsize_t(count);
}

/* longest_hit(digests, cache, max_blocks) -> list: the blocks ``cache`` maps the first
 * digests to, up to the first digest it lacks, at most ``max_blocks``.
 * FullAttentionRules.longest_hit. */
PyObject *kv_py_longest_hit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "longest_hit(digests, cache, max_blocks)");
        return NULL;
    }
    PyObject *digests = args[0], *cache = args[1];
    if (!PyList_Check(digests) || !PyDict_Check(cache) || !PyIndex_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError,
                        "longest_hit: digests must be a list, cache a dict, max_blocks an int");
        return NULL;
    }
    /* As the reference's ``hashes[:max_blocks]`` (core_rules.py): clipped, negative from
     * the end. */
    Py_ssize_t max_blocks = PyNumber_AsSsize_t(args[2], NULL);
    if (max_blocks == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(digests);
    if (max_blocks < 0) max_blocks = n + max_blocks < 0 ? 0 : n + max_blocks;
    if (max_blocks < n) n = max_blocks;
    PyObject *found = PyList_New(0);
    if (found == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n && i < PyList_GET_SIZE(digests); i++) {
        /* Held: a key's __eq__ may change the list. */
        PyObject *digest = PyList_GET_ITEM(digests, i);
        Py_INCREF(digest);
        PyObject *block = PyDict_GetItemWithError(cache, digest);
        Py_XINCREF(block); /* before the digest is released (its release could run code) */
        Py_DECREF(digest);
        if (block == NULL || block == Py_None) {
            /* None: a miss, as the reference's ``cache.get`` reads it. */
            Py_XDECREF(block);
            if (PyErr_Occurred()) {
                Py_DECREF(found);
                return NULL;
            }
            break;
        }
        int failed = PyList_Append(found, block);
        Py_DECREF(block);
        if (failed < 0) {
            Py_DECREF(found);
            return NULL;
        }
    }
    return found;
}

/* A slot a tier's cache names: an exact int in 1 .. limit - 1; else -1 with ValueError (a
 * cache that names no slot of its pool: nothing may be refreshed from it). */
static Py_ssize_t cached_slot(PyObject *slot, Py_ssize_t limit) {
    Py_ssize_t value = PyLong_CheckExact(slot) ? PyLong_AsSsize_t(slot) : -1;
    if (value == -1) PyErr_Clear();
    if (value < 1 || value >= limit) {
        PyErr_SetString(PyExc_ValueError,
                        "store_victims: the tier's cache maps a hash to a value that is no "
                        "slot of its pool");
        return -1;
    }
    return value;
}

int kv_sort_victims(PyObject *cache, PyObject *in_flight, PyObject *hashes, PyObject *sources,
                    Py_ssize_t slot_limit, PyObject *held, PyObject *held_seen,
                    PyObject *kept_hashes, PyObject *kept_sources, PyObject *seen) {
    /* The lists are re-read each time: a key's __hash__ / __eq__ may change them (the pair at
     * hand is held meanwhile). */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(hashes) && i < PyList_GET_SIZE(sources); i++) {
        prefetch_lookups(cache, hashes, i);
        PyObject *digest = PyList_GET_ITEM(hashes, i), *source = PyList_GET_ITEM(sources, i);
        Py_INCREF(digest);
        Py_INCREF(source);
        PyObject *slot = PyDict_GetItemWithError(cache, digest); /* borrowed */
        int failed = 0;
        if (slot != NULL) {
            Py_INCREF(slot);
            if (slot_limit >= 0 && cached_slot(slot, slot_limit) < 0) {
                failed = 1;
            } else if (held_seen != NULL) {
                /* An exact int (checked above): adding it runs no code. */
                Py_ssize_t before = PySet_GET_SIZE(held_seen);
                failed = PySet_Add(held_seen, slot) < 0;
                if (!failed && PySet_GET_SIZE(held_seen) != before)
                    failed = PyList_Append(held, slot) < 0;
            } else {
                failed = PyList_Append(held, slot) < 0;
            }
            Py_DECREF(slot);
        } else if (PyErr_Occurred()) {
            failed = 1;
        } else {
            int flying = PyDict_GET_SIZE(in_flight) ? PyDict_Contains(in_flight, digest) : 0;
            failed = flying < 0;
            if (!failed && !flying) {
                Py_ssize_t before = PySet_GET_SIZE(seen);
                failed = PySet_Add(seen, digest) < 0;
                if (!failed && PySet_GET_SIZE(seen) != before)
                    failed = PyList_Append(kept_hashes, digest) < 0
                             || PyList_Append(kept_sources, source) < 0;
            }
        }
        Py_DECREF(digest);
        Py_DECREF(source);
        if (failed) return -1;
    }
    return 0;
}

/* split_held(cache, in_flight, hashes, sources) -> (held, hashes, sources): the tier store's
 * sorting of one group's victims (``hashes``, copied from ``sources``), in one pass of C-level
 * dict lookups instead of a Python call per block: ``held`` the slots ``cache`` (the tier's
 * ``hash -> slot``) holds some of the hashes in, in order (repeats included); then the
 * hashes it does not hold, less those ``in_flight`` (``hash -> transfer id``) has and any
 * repeat of an earlier one, with their sources. tier_victims.split_held in Python.
 * ``cache`` and ``in_flight`` are exact dicts (a subclass's own lookup would not run here). */
PyObject *kv_py_split_held(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "split_held(cache, in_flight, hashes, sources)");
        return NULL;
    }
    PyObject *cache = args[0], *in_flight = args[1], *hashes = args[2], *sources = args[3];
    if (!PyDict_CheckExact(cache) || !PyDict_CheckExact(in_flight) || !PyList_CheckExact(hashes)
        || !PyList_CheckExact(sources)) {
        PyErr_SetString(PyExc_TypeError,
                        "split_held: cache and in_flight must be dicts, hashes and sources lists");
        return NULL;
    }
    if (PyList_GET_SIZE(hashes) != PyList_GET_SIZE(sources)) {
        PyErr_SetString(PyExc_ValueError, "split_held: hashes and sources differ in length");
        return NULL;
    }
    PyObject *held = PyList_New(0), *kept_hashes = PyList_New(0), *kept_sources = PyList_New(0);
    PyObject *seen = PySet_New(NULL), *result = NULL;
    if (held != NULL && kept_hashes != NULL && kept_sources != NULL && seen != NULL
        && kv_sort_victims(cache, in_flight, hashes, sources, -1, held, NULL, kept_hashes,
                           kept_sources, seen) == 0)
        result = PyTuple_Pack(3, held, kept_hashes, kept_sources);
    Py_XDECREF(held);
    Py_XDECREF(kept_hashes);
    Py_XDECREF(kept_sources);
    Py_XDECREF(seen);
    return result;
}
