/* Prefetching a dict lookup's memory ahead of the lookup (in a tier's ``hash -> slot`` cache
 * of 262,144 digests, each lookup is a cache miss in the dict's index table, then another in
 * its entry table: a loop over a batch of victims pays them one after the other). A kernel
 * looping over a batch asks, a few keys ahead, for the index slot of a key
 * (kv_prefetch_dict_index) and, once that has arrived, for the entry it names
 * (kv_prefetch_dict_entry); the lookup itself then runs through the public dict API.
 *
 * The dict's table layout is CPython's private one (Include/internal/pycore_dict.h, the same
 * in 3.11 and 3.12): it is mirrored below and checked against a dict built at import
 * (kv_dict_prefetch_init); on any other version, compiler or a failed check, both calls do
 * nothing. They only read the dict's keys header and one index slot inside its table, and
 * only issue prefetches (which never fault, and change no result): a wrong guess costs time,
 * never an answer. */
#ifndef KVSPEC_DICT_PREFETCH_H
#define KVSPEC_DICT_PREFETCH_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* Set by kv_dict_prefetch_init when the mirrored layout matched a real dict's. */
extern int kv_dict_layout_known;

/* Check the mirrored layout against a dict built here; sets kv_dict_layout_known. 0, or -1
 * with an exception (memory). Called once, when the module is created. */
int kv_dict_prefetch_init(void);

/* Never on a free-threaded build: there another thread may resize a dict while ma_keys is
 * read without its lock. */
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030D0000 \
    && (defined(__GNUC__) || defined(__clang__)) && !defined(Py_GIL_DISABLED)
#define KV_DICT_PREFETCH 1

/* struct _dictkeysobject of CPython 3.11 / 3.12. */
typedef struct {
    Py_ssize_t dk_refcnt;
    uint8_t dk_log2_size;
    uint8_t dk_log2_index_bytes;
    uint8_t dk_kind;
    uint32_t dk_version;
    Py_ssize_t dk_usable;
    Py_ssize_t dk_nentries;
    char dk_indices[];
} kv_dict_keys;

/* DICT_KEYS_GENERAL: entries of (hash, key, value), any key type. */
#define KV_DICT_KEYS_GENERAL 0

static inline kv_dict_keys *kv_dict_keys_of(PyObject *dict) {
    return (kv_dict_keys *)((PyDictObject *)dict)->ma_keys;
}

/* The hash a dict lookup of ``key`` uses, for an exact bytes key (cached in the object; no
 * Python code runs), else -1. */
static inline Py_hash_t kv_bytes_hash(PyObject *key) {
    if (!PyBytes_CheckExact(key)) return -1;
    Py_hash_t hash = PyObject_Hash(key);
    if (hash == -1) PyErr_Clear();
    return hash;
}

/* The index slot of the first probe for ``hash`` (in the table's bounds). */
static inline const char *kv_dict_first_slot(const kv_dict_keys *keys, Py_hash_t hash,
                                             unsigned *width_log2) {
    unsigned log2_size = keys->dk_log2_size;
    *width_log2 = (unsigned)keys->dk_log2_index_bytes - log2_size;
    size_t mask = ((size_t)1 << log2_size) - 1;
    return keys->dk_indices + (((size_t)hash & mask) << *width_log2);
}

static inline void kv_prefetch_dict_index(PyObject *dict, PyObject *key) {
    if (!kv_dict_layout_known || !PyDict_CheckExact(dict)) return;
    Py_hash_t hash = kv_bytes_hash(key);
    if (hash == -1) return;
    unsigned width_log2;
    __builtin_prefetch(kv_dict_first_slot(kv_dict_keys_of(dict), hash, &width_log2));
}

/* The entry the first probe for ``key`` names (read from the index slot, asked for earlier
 * by kv_prefetch_dict_index). */
static inline void kv_prefetch_dict_entry(PyObject *dict, PyObject *key) {
    if (!kv_dict_layout_known || !PyDict_CheckExact(dict)) return;
    Py_hash_t hash = kv_bytes_hash(key);
    if (hash == -1) return;
    const kv_dict_keys *keys = kv_dict_keys_of(dict);
    if (keys->dk_kind != KV_DICT_KEYS_GENERAL) return;
    unsigned width_log2;
    const char *slot = kv_dict_first_slot(keys, hash, &width_log2);
    int64_t index;
    switch (width_log2) {
        case 0: index = *(const int8_t *)slot; break;
        case 1: index = *(const int16_t *)slot; break;
        case 2: index = *(const int32_t *)slot; break;
        default: index = *(const int64_t *)slot; break;
    }
    if (index < 0 || index >= keys->dk_nentries) return; /* empty, dummy */
    const char *entries = keys->dk_indices + ((size_t)1 << keys->dk_log2_index_bytes);
    __builtin_prefetch(entries + (size_t)index * 3 * sizeof(void *));
}

#else

static inline void kv_prefetch_dict_index(PyObject *dict, PyObject *key) {
    (void)dict, (void)key;
}
static inline void kv_prefetch_dict_entry(PyObject *dict, PyObject *key) {
    (void)dict, (void)key;
}

#endif

#endif
