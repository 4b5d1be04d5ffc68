/* store_victims: the store of a batch of one group's victims into an offload tier's pool in
 * one call (tier_victims.store_victims in Python, the reference; TierStoring._store_group
 * calls it for a tier pool of one group): sorting the victims against the tier's cache
 * and the copies in flight (split_held's loop), refreshing the entries the tier holds,
 * taking slots for the rest (free ones, then the tier's LRU victims) and recording the
 * copies in the pending transfer's lists and the in-flight map, with no intermediate
 * Python list of the victims and no Python frame per step. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "block_queue.h"
#include "kernels.h"

static PyObject *events_name; /* "_events", interned once */

/* The only cache of the pool (its one group's), borrowed from its ``caches``; NULL with an
 * exception unless the pool has exactly one group and its cache is a dict. */
static PyObject *only_cache(PyObject *pool_dict) {
    PyObject *caches = kv_pool_get(pool_dict, POOL_CACHES);
    if (caches == NULL) return NULL;
    Py_ssize_t position = 0;
    PyObject *gid, *cache;
    if (!PyDict_CheckExact(caches) || PyDict_GET_SIZE(caches) != 1
        || !PyDict_Next(caches, &position, &gid, &cache) || !PyDict_CheckExact(cache)) {
        PyErr_SetString(PyExc_TypeError,
                        "store_victims: the pool must serve one group (its caches: one dict)");
        return NULL;
    }
    return cache;
}

/* Call a pool kernel with ``nargs`` arguments; -1 with an exception. */
static int run_kernel(PyObject *(*kernel)(PyObject *, PyObject *const *, Py_ssize_t),
                      PyObject *const *args, Py_ssize_t nargs) {
    PyObject *done = kernel(NULL, args, nargs);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}

/* BlockPool.touch(slots, known_cached=True) then BlockPool._release_unchecked(slots): each
 * slot becomes its eviction order's most recent entry (one in use keeps its count). */
static int refresh(PyObject *pool_dict, PyObject *slots) {
    static const int fields[7] = {POOL_REF_COUNTS, POOL_REUSED, POOL_EVICTABLE, POOL_PROTECTED,
                                  POOL_SEGMENTED, POOL_BLOCK_HASH, POOL_FRESH};
    /* Each held as soon as read: a later lookup (a hostile key of the pool's __dict__) or the
     * touch / release (a hostile ref count's or flag's code) may replace the attribute. */
    PyObject *got[7] = {NULL};
    int failed = 0;
    for (int i = 0; i < 7 && !failed; i++) {
        got[i] = kv_pool_get(pool_dict, fields[i]);
        failed = got[i] == NULL;
        Py_XINCREF(got[i]);
    }
    if (!failed) {
        PyObject *touch_args[7] = {slots, got[0], got[1], got[2], got[3], got[4], Py_False};
        PyObject *release_args[8] = {slots,  Py_False, got[0], got[5],
                                     got[1], got[6],   got[2], got[3]};
        failed = run_kernel(kv_py_touch, touch_args, 7) < 0
                 || run_kernel(kv_py_release, release_args, 8) < 0;
    }
    for (int i = 0; i < 7; i++) Py_XDECREF(got[i]);
    return failed ? -1 : 0;
}

/* store_victims(pool, in_flight, hashes, sources, out_sources, out_destinations, out_hashes,
 * transfer_id) -> int. See tier_victims.store_victims. */
PyObject *kv_py_store_victims(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "store_victims(pool, in_flight, hashes, sources, out_sources, "
                        "out_destinations, out_hashes, transfer_id)");
        return NULL;
    }
    PyObject *pool = args[0], *in_flight = args[1], *hashes = args[2], *sources = args[3];
    PyObject *out_sources = args[4], *out_destinations = args[5], *out_hashes = args[6];
    PyObject *transfer_id = args[7];
    if (!PyDict_CheckExact(in_flight) || !PyList_CheckExact(hashes)
        || !PyList_CheckExact(sources) || !PyList_CheckExact(out_sources)
        || !PyList_CheckExact(out_destinations) || !PyList_CheckExact(out_hashes)
        || !PyLong_CheckExact(transfer_id)) {
        PyErr_SetString(PyExc_TypeError,
                        "store_victims: in_flight must be a dict, hashes, sources and the "
                        "three outputs lists, transfer_id an int");
        return NULL;
    }
    Py_ssize_t count = PyList_GET_SIZE(hashes);
    if (count != PyList_GET_SIZE(sources)) {
        PyErr_SetString(PyExc_ValueError, "store_victims: hashes and sources differ in length");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!PyBytes_CheckExact(PyList_GET_ITEM(hashes, i))
            || !PyLong_CheckExact(PyList_GET_ITEM(sources, i))) {
            PyErr_SetString(PyExc_TypeError,
                            "store_victims: hashes must be bytes and sources ints");
            return NULL;
        }
    }
    PyObject *pool_dict = kv_pool_dict(pool);
    if (pool_dict == NULL) return NULL;
    PyObject *cache = NULL, *refs, *events, *held = NULL, *kept_hashes = NULL,
             *kept_sources = NULL, *seen = NULL, *held_seen = NULL, *taken = NULL, *result = NULL;
    if ((refs = kv_pool_get(pool_dict, POOL_REF_COUNTS)) == NULL) goto done;
    if (!PyList_CheckExact(refs)) {
        PyErr_SetString(PyExc_TypeError, "store_victims: the pool's ref_counts must be a list");
        goto done;
    }
    /* Read now: ``refs`` is borrowed, and the lookups below may run a hostile key's code
     * (the pool's __dict__ may hold any key), which may replace it. */
    Py_ssize_t size = PyList_GET_SIZE(refs);
    if (events_name == NULL && (events_name = PyUnicode_InternFromString("_events")) == NULL)
        goto done;
    /* As BlockPool's attribute: missing, AttributeError (the twin reads pool._events). */
    if ((events = PyDict_GetItemWithError(pool_dict, events_name)) == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_AttributeError, events_name);
        goto done;
    }
    if (events != Py_None) {
        PyErr_SetString(PyExc_ValueError,
                        "store_victims: the pool records events (a tier pool records none)");
        goto done;
    }
    if ((cache = only_cache(pool_dict)) == NULL) goto done;
    Py_INCREF(cache); /* held: a key's __eq__ may replace the pool's caches */
    /* The eviction orders must be BlockQueues (a pool built with the kernels): refused here,
     * before anything changes (the touch or an eviction would refuse them half-way). */
    for (int i = 0; i < 2; i++) {
        PyObject *order = kv_pool_get(pool_dict, i ? POOL_PROTECTED : POOL_EVICTABLE);
        if (order == NULL) goto done;
        if (as_queue(order, 0) == NULL) {
            PyErr_SetString(PyExc_TypeError,
                            "store_victims: the pool's eviction orders must be its BlockQueues "
                            "(a pool built with the compiled kernels)");
            goto done;
        }
    }
    held = PyList_New(0);
    kept_hashes = PyList_New(0);
    kept_sources = PyList_New(0);
    seen = PySet_New(NULL);
    held_seen = PySet_New(NULL);
    if (held == NULL || kept_hashes == NULL || kept_sources == NULL || seen == NULL
        || held_seen == NULL)
        goto done;
    /* 1. Sort: held by the tier (refreshed, each once, in order of first sight), in flight
     * to it or a repeat (skipped), or to copy. A key of the cache or of in_flight with the
     * same hash may run Python code (__eq__) that changes the lists (split_held's loop). */
    if (kv_sort_victims(cache, in_flight, hashes, sources, size, held, held_seen, kept_hashes,
                        kept_sources, seen) < 0)
        goto done;
    /* 2. The held entries become the tier's most recently used ones. Code run above may have
     * changed the pool: its containers are read again. */
    if (PyList_GET_SIZE(held) && refresh(pool_dict, held) < 0) goto done;
    /* 3. As many copies as there are free slots: the newest victims. */
    Py_ssize_t room, wanted = PyList_GET_SIZE(kept_hashes);
    if (kv_pool_num_free(pool_dict, &room) < 0) goto done;
    if (wanted > room) {
        if (PyList_SetSlice(kept_hashes, 0, wanted - room, NULL) < 0
            || PyList_SetSlice(kept_sources, 0, wanted - room, NULL) < 0)
            goto done;
        wanted = room;
    }
    if (wanted == 0) {
        result = PyLong_FromLong(0);
        goto done;
    }
    /* 4. The slots (evicting the tier's oldest entries; a pool with a hook tells it). */
    taken = kv_pool_take(pool, pool_dict, wanted);
    if (taken == NULL) goto done;
    if (PyList_GET_SIZE(taken) != wanted) {
        PyErr_SetString(PyExc_RuntimeError, "store_victims: the pool handed out a wrong count");
        goto done;
    }
    /* 5. The copies: appended to the transfer's lists, their hashes in flight to it. The
     * kept lists are this call's own (no code can reach them). */
    Py_ssize_t end;
    end = PyList_GET_SIZE(out_sources);
    if (PyList_SetSlice(out_sources, end, end, kept_sources) < 0) goto done;
    end = PyList_GET_SIZE(out_destinations);
    if (PyList_SetSlice(out_destinations, end, end, taken) < 0) goto done;
    end = PyList_GET_SIZE(out_hashes);
    if (PyList_SetSlice(out_hashes, end, end, kept_hashes) < 0) goto done;
    for (Py_ssize_t i = 0; i < wanted && i < PyList_GET_SIZE(kept_hashes); i++) {
        PyObject *digest = Py_NewRef(PyList_GET_ITEM(kept_hashes, i));
        int failed = PyDict_SetItem(in_flight, digest, transfer_id) < 0;
        Py_DECREF(digest);
        if (failed) goto done;
    }
    result = PyLong_FromSsize_t(wanted);
done:
    Py_XDECREF(cache);
    Py_XDECREF(held);
    Py_XDECREF(kept_hashes);
    Py_XDECREF(kept_sources);
    Py_XDECREF(seen);
    Py_XDECREF(held_seen);
    Py_XDECREF(taken);
    Py_DECREF(pool_dict);
    return result;
}
