#ifndef KVSPEC_BLOCK_QUEUE_H
#define KVSPEC_BLOCK_QUEUE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* An insertion-ordered set of block ids 0..capacity-1: the subset of OrderedDict[int, None]
 * the pool's eviction orders use (q[b] = None appends b unless present, del q[b], b in q,
 * len, iteration oldest first, popitem(last=False), clear), as an intrusive doubly linked
 * list over two int32 arrays allocated on first use (8 bytes per block), so no per-entry
 * object exists and the pool kernels (pool.c) link and unlink blocks directly. */

typedef struct {
    PyObject_HEAD
    Py_ssize_t capacity;
    Py_ssize_t length;
    Py_ssize_t version; /* changes on every mutation: iterators refuse a changed queue */
    int32_t *prev;      /* prev[b] == -1: b is not queued; index capacity is the sentinel */
    int32_t *next;
} BlockQueue;

extern PyTypeObject kv_BlockQueue_Type;

/* PyType_Ready for BlockQueue and its iterator; -1 on error. */
int kv_block_queue_types_ready(void);

/* Allocate the arrays (on first use); -1 with MemoryError. */
int kv_queue_alloc(BlockQueue *q);

static inline int queue_has(const BlockQueue *q, Py_ssize_t b) {
    return q->prev != NULL && b >= 0 && b < q->capacity && q->prev[b] != -1;
}

/* Append b (0 <= b < capacity, not queued). */
static inline void queue_push(BlockQueue *q, Py_ssize_t b) {
    Py_ssize_t s = q->capacity;
    int32_t tail = q->prev[s];
    q->prev[b] = tail;
    q->next[b] = (int32_t)s;
    q->next[tail] = (int32_t)b;
    q->prev[s] = (int32_t)b;
    q->length++;
    q->version++;
}

/* Unlink queued b. */
static inline void queue_unlink(BlockQueue *q, Py_ssize_t b) {
    int32_t before = q->prev[b], after = q->next[b];
    q->next[before] = after;
    q->prev[after] = before;
    q->prev[b] = -1;
    q->length--;
    q->version++;
}

/* The queue if ``object`` is a BlockQueue of at least ``size`` ids, else NULL. */
static inline BlockQueue *as_queue(PyObject *object, Py_ssize_t size) {
    if (Py_IS_TYPE(object, &kv_BlockQueue_Type) && ((BlockQueue *)object)->capacity >= size)
        return (BlockQueue *)object;
    return NULL;
}

#endif
