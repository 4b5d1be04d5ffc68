/* What the kernel files of kvspec_core.runtime._native share: the interned attribute names,
 * the int 1, and each file's Python-facing functions (registered in module.c). */
#ifndef KVSPEC_KERNELS_H
#define KVSPEC_KERNELS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Set by module.c when the module is created. */
extern PyObject *kv_one; /* the int 1 */
extern PyObject *kv_str_extend, *kv_str_request_id, *kv_str_computed, *kv_str_end_limit,
    *kv_str_known_limit, *kv_str_computed_limit;

/* hashing.c */
PyObject *kv_py_blake2b(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *kv_py_chain_hashes(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
/* chain_hashes with C arguments: 0, or -1 with an exception. ``*code_ran`` (may be NULL)
 * is set when a token needed a call (its __index__ may have run Python code). */
int kv_chain_hashes(PyObject *parent, PyObject *tokens, Py_ssize_t start, Py_ssize_t stop,
                    Py_ssize_t size, PyObject *out, int *code_ran);
/* repr(value) of an exact str, bytes, bytearray, int or None, else "<a TYPE>" (a hostile
 * object's repr could run its code): hashing.py's _describe. NULL with an exception. */
PyObject *kv_describe(PyObject *value);
/* PrefixHasher.hashes(request, upto) for a registered Request without multimodal inputs,
 * hash blocks of ``tokens`` tokens: 0 (``*hashes_out`` borrows its block_hashes), 1: leave
 * it to the Python method (another kind of request, a salt of another type, a request that
 * changed under PrefixHasher.root: no hash was added; or a token whose __index__ was called,
 * which may have changed anything the caller planned on: the hashes were added, so the
 * method runs no such code again), -1: an error (a token it cannot hash:
 * the AllocatorError the method raises, nothing added). On 0 the request still holds the
 * token list and hash list it held before, the token list with its length and, where code
 * ran, the very objects it held: what the caller read from it before stays true. */
int kv_hash_request(PyObject *hasher, PyObject *request, Py_ssize_t upto, Py_ssize_t tokens,
                    PyObject **hashes_out);

/* pool.c */
PyObject *kv_py_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *kv_py_touch(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *kv_py_evict_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *kv_py_cache_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *kv_py_longest_hit(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *kv_py_count_unreferenced(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *kv_py_split_held(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
/* split_held's loop (store_victims' too) over exact lists ``hashes`` / ``sources`` and exact
 * dicts ``cache`` / ``in_flight`` (held by the caller): the slots ``cache`` holds some hashes
 * in onto ``held`` (with ``slot_limit`` >= 0 each must be an exact int in 1 .. slot_limit - 1,
 * else ValueError; with a set ``held_seen`` (else NULL) each goes on once), the others, less
 * those in flight and repeats (``seen``, a set), onto ``kept_hashes`` / ``kept_sources``.
 * Code a key runs may change the lists: the loop stops at their new length. -1 with an
 * exception. */
int kv_sort_victims(PyObject *cache, PyObject *in_flight, PyObject *hashes, PyObject *sources,
                    Py_ssize_t slot_limit, PyObject *held, PyObject *held_seen,
                    PyObject *kept_hashes, PyObject *kept_sources, PyObject *seen);
/* The position in ``blocks`` (a list) of the first non-null block a prefix hit cannot revive
 * (out of the pool's range, or neither in use nor in one of its eviction orders), -1 if none,
 * -2 with an exception. ``refs``: the pool's ref counts (a list); ``num_real`` and
 * ``num_unreferenced`` (may be NULL) get the non-null blocks and those with ref count 0. */
Py_ssize_t kv_first_unrevivable(PyObject *blocks, PyObject *refs, PyObject *evictable,
                                PyObject *protected_, Py_ssize_t *num_real,
                                Py_ssize_t *num_unreferenced);

/* pool_access.c: a BlockPool's containers and operations for the block-boundary kernels. */
enum {
    POOL_FRESH, POOL_REF_COUNTS, POOL_EVICTABLE, POOL_PROTECTED, POOL_CACHES,
    POOL_BLOCK_GROUP, POOL_BLOCK_HASH, POOL_REUSED, POOL_EPOCH, POOL_TAKE, POOL_MOVE_HASH,
    POOL_SEGMENTED, POOL_ON_EVICT, POOL_FIELDS
};
/* The pool's __dict__ (a new reference), or NULL with an exception. */
PyObject *kv_pool_dict(PyObject *pool);
/* Its attribute ``field`` (borrowed), or NULL with AttributeError. */
PyObject *kv_pool_get(PyObject *pool_dict, int field);
/* Its attributes ``fields[0..count)`` into ``out`` as new references, each taken as soon as
 * it is read (a later lookup may run a hostile key's __eq__, which may replace an attribute
 * already read); 0, or -1 with an exception and nothing held. Release with
 * kv_release_all. */
int kv_pool_get_all(PyObject *pool_dict, const int *fields, int count, PyObject **out);
/* Py_XDECREF of ``objects[0..count)``. */
void kv_release_all(PyObject **objects, int count);
/* BlockPool.num_free_blocks; -1 with an exception. */
int kv_pool_num_free(PyObject *pool_dict, Py_ssize_t *num_free);
/* BlockPool.take(count) for a pool recording no events (a new list), or NULL with an
 * exception. The caller checked that ``count`` blocks are free. */
PyObject *kv_pool_take(PyObject *pool, PyObject *pool_dict, Py_ssize_t count);
/* kv_pool_take, the blocks also appended to the block table ``table`` (a list). */
PyObject *kv_pool_take_onto(PyObject *pool, PyObject *pool_dict, Py_ssize_t count,
                            PyObject *table);
/* BlockPool._release_unchecked(blocks) for a list; -1 with an exception. */
int kv_pool_release(PyObject *pool_dict, PyObject *blocks);
/* BlockPool.cache_blocks(gid, digests, blocks) for lists; -1 with an exception. */
int kv_pool_cache(PyObject *pool, PyObject *pool_dict, PyObject *gid, PyObject *digests,
                  PyObject *blocks);
/* The same for blocks ``table[start:stop]`` of group ``gid``, digests
 * ``hashes[start:stop]`` (a group block is one hash block); -1 with an exception. */
int kv_pool_cache_range(PyObject *pool, PyObject *pool_dict, Py_ssize_t gid, PyObject *hashes,
                        PyObject *table, Py_ssize_t start, Py_ssize_t stop);

/* tier_store.c: store_victims, the store of one group's victims into a tier pool. */
PyObject *kv_py_store_victims(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* grow.c: the block-boundary step of a one-group full-attention allocator. */
typedef struct {
    PyObject *pool, *hasher; /* borrowed from the config tuple */
    Py_ssize_t block_tokens, cap, max_len;
    int cacheable;
} DenseConfig;
/* Parse SlotsFastPath's ``dense`` tuple; -1 with an exception. */
int kv_dense_config(PyObject *config, DenseConfig *out);
/* The step's result (new reference); NULL without an exception: leave the step to the
 * Python method (nothing changed); NULL with one: an error. */
PyObject *kv_dense_grow(const DenseConfig *config, PyObject *state, PyObject *request,
                        Py_ssize_t count, Py_ssize_t lookahead, PyObject *no_new_blocks);


/* group_step.c: the block-boundary step of an allocator whose groups all have one of the
 * core's parametric rule shapes (full attention, trailing window, state checkpoints). */
typedef struct {
    Py_ssize_t gid, shape, block_tokens, cap, retained;
    int is_state;
    int pool_slot;   /* index of the first group with this group's pool */
    PyObject *pool;  /* borrowed from the config tuple */
} GroupShape;
#define KV_STEP_GROUPS 8
typedef struct {
    PyObject *hasher; /* borrowed from the config tuple */
    Py_ssize_t max_len, hash_tokens, num_groups;
    int count; /* holding groups; -1: more than KV_STEP_GROUPS (never compiled) */
    int cacheable;
    GroupShape groups[KV_STEP_GROUPS];
} GroupsConfig;
enum { SHAPE_FULL, SHAPE_WINDOW, SHAPE_STATE, SHAPES };
/* Parse SlotsFastPath's ``groups`` tuple; -1 with an exception. */
int kv_groups_config(PyObject *config, GroupsConfig *out);
/* What one group's step does (FamilyRules.skipped_tokens, blocks_needed of its shape). */
typedef struct {
    PyObject *table; /* held */
    Py_ssize_t done, skip, nulls, real, dropped;
    int planned;
} GroupPlan;
/* The plan of a step of ``group`` from ``computed`` to ``known`` tokens (``total`` with the
 * lookahead) over a table of ``length`` entries, ``plan->done`` of them skipped already. */
void kv_plan_group(const GroupShape *group, Py_ssize_t computed, Py_ssize_t known,
                   Py_ssize_t total, Py_ssize_t length, GroupPlan *plan);
/* The blocks ``[start, stop)`` a step to ``known`` tokens caches, ``available`` tokens
 * appended (FamilyRules.cache_range of the group's shape up to the known tokens; a state
 * group's step past the appended tokens caches none). */
void kv_cache_range(const GroupShape *group, Py_ssize_t num_cached, Py_ssize_t known,
                    Py_ssize_t available, Py_ssize_t *start, Py_ssize_t *stop);
/* FamilyRules.next_skip_position of the group's shape. */
Py_ssize_t kv_next_skip(const GroupShape *group, Py_ssize_t num_skipped);
/* The __dict__ of ``group``'s pool, fetched once per step per pool (borrowed from
 * ``pool_dicts``, which holds it); NULL with an exception. */
PyObject *kv_pool_dict_of(PyObject **pool_dicts, const GroupShape *group);
/* An Allocated's new_block_ids: per group, tuple(taken[i]) of the holding group i that is
 * it, () where nothing was taken (taken[i] NULL). NULL with an exception. */
PyObject *kv_new_block_ids(const GroupsConfig *config, PyObject *const *taken);
/* As kv_dense_grow. */
PyObject *kv_groups_grow(const GroupsConfig *config, PyObject *state, PyObject *request,
                         Py_ssize_t count, Py_ssize_t lookahead, PyObject *no_new_blocks);

/* admit.c: the admission of a request to an allocator whose holding groups all have one
 * of those shapes. */
typedef struct {
    PyObject *freed, *prefix_type, *pools, *handed; /* borrowed from the config tuple */
    GroupsConfig groups;
} AdmitConfig;
/* Parse SlotsFastPath's ``admit`` tuple; -1 with an exception. */
int kv_admit_config(PyObject *config, AdmitConfig *out);
/* The admission (``running``: the allocator's running states; ``prefix``: the CachedPrefix
 * passed, or None). As kv_dense_grow. */
PyObject *kv_admit(const AdmitConfig *config, PyObject *running, PyObject *request,
                   Py_ssize_t count, Py_ssize_t lookahead, PyObject *prefix);

/* find.c: find_prefix(config, method, request), find_cached_prefix of a one-group
 * full-attention allocator. */
PyObject *kv_py_find_prefix(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* step.c */
extern PyTypeObject kv_SlotsFastPath_Type;
PyObject *kv_py_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *kv_py_decode_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif
