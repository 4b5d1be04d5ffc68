/* kvspec_core.runtime._native: optional compiled kernels of kvspec's runtime allocator.
 *
 * The pure-Python modules (hashing.py, pool.py, allocator.py, rules.py) are the reference;
 * every function here computes exactly what its Python twin computes (tests compare them),
 * only without the interpreter's per-block cost. The extension is built when a C compiler is
 * present (pyproject.toml: optional = true); without it kvspec runs the Python code.
 *
 *   blake2b.c      BLAKE2b (RFC 7693)
 *   hashing.c      blake2b(), chain_hashes(): the chained block hashes
 *   block_queue.c  BlockQueue: the pools' eviction orders
 *   pool.c         release, touch, evict_take, cache_blocks, longest_hit,
 *                  count_unreferenced, split_held: the pool's loops
 *   tier_store.c   store_victims: a batch of victims stored into an offload tier's pool
 *   dict_prefetch.h  asking for a dict lookup's memory a few keys ahead (large tier caches)
 *   records.c      register_types: the Python records read and written in place
 *   step.c         step, decode_step, SlotsFastPath: the per-step fast paths
 *   grow.c         the block-boundary step of one-group full-attention allocators
 *   admit.c        the admission of a request (groups of the core's rule shapes)
 *   find.c         find_prefix: the prefix lookup of one-group full-attention allocators
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "block_queue.h"
#include "dict_prefetch.h"
#include "kernels.h"
#include "records.h"

PyObject *kv_one;
PyObject *kv_str_extend, *kv_str_request_id, *kv_str_computed, *kv_str_end_limit,
    *kv_str_known_limit, *kv_str_computed_limit;

static PyMethodDef native_methods[] = {
    {"blake2b", (PyCFunction)(void (*)(void))kv_py_blake2b, METH_FASTCALL,
     "blake2b(data, digest_size) -> bytes: hashlib.blake2b(data, digest_size=n).digest()"},
    {"chain_hashes", (PyCFunction)(void (*)(void))kv_py_chain_hashes, METH_FASTCALL,
     "chain_hashes(parent, tokens, start, stop, block_tokens, out): append chained digests"},
    {"release", (PyCFunction)(void (*)(void))kv_py_release, METH_FASTCALL,
     "release(blocks, reverse, refs, block_hash, reused, fresh, evictable, protected)"},
    {"touch", (PyCFunction)(void (*)(void))kv_py_touch, METH_FASTCALL,
     "touch(blocks, refs, reused, evictable, protected, segmented, check) -> int"},
    {"evict_take", (PyCFunction)(void (*)(void))kv_py_evict_take, METH_FASTCALL,
     "evict_take(count, out, evictable, caches, block_group, block_hash, refs[, groups_out, "
     "hashes_out])"},
    {"cache_blocks", (PyCFunction)(void (*)(void))kv_py_cache_blocks, METH_FASTCALL,
     "cache_blocks(gid, digests, blocks, cache, block_hash, block_group, move_hash) -> int"},
    {"longest_hit", (PyCFunction)(void (*)(void))kv_py_longest_hit, METH_FASTCALL,
     "longest_hit(digests, cache, max_blocks) -> list of the cached prefix's blocks"},
    {"count_unreferenced", (PyCFunction)(void (*)(void))kv_py_count_unreferenced,
     METH_FASTCALL, "count_unreferenced(blocks, refs) -> non-null blocks with ref count 0"},
    {"split_held", (PyCFunction)(void (*)(void))kv_py_split_held, METH_FASTCALL,
     "split_held(cache, in_flight, hashes, sources) -> (held slots, hashes to store, their "
     "sources)"},
    {"store_victims", (PyCFunction)(void (*)(void))kv_py_store_victims, METH_FASTCALL,
     "store_victims(pool, in_flight, hashes, sources, out_sources, out_destinations, "
     "out_hashes, transfer_id) -> int: one group's victims stored into a tier pool"},
    {"register_types", (PyCFunction)(void (*)(void))kv_py_register_types, METH_FASTCALL,
     "register_types(state_class, request_class, allocated_class, prefix_class): the records "
     "read and written in place"},
    {"find_prefix", (PyCFunction)(void (*)(void))kv_py_find_prefix, METH_FASTCALL,
     "find_prefix(config, method, request) -> CachedPrefix: find_cached_prefix of a one-group "
     "full-attention allocator"},
    {"decode_step", (PyCFunction)(void (*)(void))kv_py_decode_step, METH_FASTCALL,
     "decode_step(request_ids, tokens, running, lookahead, no_new_blocks, allocate_slots, "
     "results) -> int"},
    {"step", (PyCFunction)(void (*)(void))kv_py_step, METH_FASTCALL,
     "step(pairs, running, lookahead, no_new_blocks, one_pair, results)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "kvspec_core.runtime._native",
    "Compiled kernels of kvspec's runtime allocator (optional; see hashing.py, pool.py).",
    -1, native_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {
        {&kv_str_extend, "extend"}, {&kv_str_request_id, "request_id"},
        {&kv_str_computed, "computed"}, {&kv_str_end_limit, "end_limit"},
        {&kv_str_known_limit, "known_limit"}, {&kv_str_computed_limit, "computed_limit"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        *names[i].slot = PyUnicode_InternFromString(names[i].text);
        if (*names[i].slot == NULL) return NULL;
    }
    kv_one = PyLong_FromLong(1);
    if (kv_one == NULL) return NULL;
    if (kv_block_queue_types_ready() < 0
        || PyType_Ready(&kv_SlotsFastPath_Type) < 0 || kv_dict_prefetch_init() < 0)
        return NULL;
    PyObject *module = PyModule_Create(&native_module);
    if (module == NULL) return NULL;
    Py_INCREF(&kv_BlockQueue_Type);
    if (PyModule_AddObject(module, "BlockQueue", (PyObject *)&kv_BlockQueue_Type) < 0) {
        Py_DECREF(&kv_BlockQueue_Type);
        Py_DECREF(module);
        return NULL;
    }
    /* Whether the kernels prefetch dict lookups (dict_prefetch.h): diagnostics, tests. */
    if (PyModule_AddIntConstant(module, "dict_prefetch", kv_dict_layout_known) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    Py_INCREF(&kv_SlotsFastPath_Type);
    if (PyModule_AddObject(module, "SlotsFastPath", (PyObject *)&kv_SlotsFastPath_Type) < 0) {
        Py_DECREF(&kv_SlotsFastPath_Type);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
