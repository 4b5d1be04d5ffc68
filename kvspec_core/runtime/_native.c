/* Optional compiled kernels of kvspec's runtime allocator.
 *
 * The pure-Python modules (hashing.py, pool.py) are the reference; every function here
 * computes exactly what its Python twin computes (tests compare them), only without the
 * interpreter's per-block cost. The extension is built when a C compiler is present
 * (pyproject.toml: optional = true); without it kvspec runs the Python code unchanged.
 *
 * BLAKE2b is implemented from RFC 7693 (unkeyed, no salt or personalisation, as
 * hashlib.blake2b(data, digest_size=n)); the digests are byte-identical to hashlib's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h> /* T_OBJECT_EX: the member type of __slots__ fields */
#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------------------ BLAKE2b */

static const uint64_t blake2b_iv[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
    0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
    0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t blake2b_sigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t rotr64(uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load64_le(const uint8_t *p) {
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16)
        | ((uint64_t)p[3] << 24) | ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40)
        | ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
}

#define G(a, b, c, d, x, y)            \
    do {                               \
        v[a] = v[a] + v[b] + (x);      \
        v[d] = rotr64(v[d] ^ v[a], 32); \
        v[c] = v[c] + v[d];            \
        v[b] = rotr64(v[b] ^ v[c], 24); \
        v[a] = v[a] + v[b] + (y);      \
        v[d] = rotr64(v[d] ^ v[a], 16); \
        v[c] = v[c] + v[d];            \
        v[b] = rotr64(v[b] ^ v[c], 63); \
    } while (0)

static void blake2b_compress(uint64_t h[8], const uint8_t block[128], uint64_t counter, int last) {
    uint64_t v[16], m[16];
    for (int i = 0; i < 16; i++) m[i] = load64_le(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = blake2b_iv[i];
    }
    v[12] ^= counter; /* messages here are far below 2**64 bytes: the high word stays 0 */
    if (last) v[14] = ~v[14];
    /* Rounds unrolled with constant message indices, so v and m stay in registers. */
#define ROUND(r)                                                                   \
    do {                                                                           \
        G(0, 4, 8, 12, m[blake2b_sigma[r][0]], m[blake2b_sigma[r][1]]);           \
        G(1, 5, 9, 13, m[blake2b_sigma[r][2]], m[blake2b_sigma[r][3]]);           \
        G(2, 6, 10, 14, m[blake2b_sigma[r][4]], m[blake2b_sigma[r][5]]);          \
        G(3, 7, 11, 15, m[blake2b_sigma[r][6]], m[blake2b_sigma[r][7]]);          \
        G(0, 5, 10, 15, m[blake2b_sigma[r][8]], m[blake2b_sigma[r][9]]);          \
        G(1, 6, 11, 12, m[blake2b_sigma[r][10]], m[blake2b_sigma[r][11]]);        \
        G(2, 7, 8, 13, m[blake2b_sigma[r][12]], m[blake2b_sigma[r][13]]);         \
        G(3, 4, 9, 14, m[blake2b_sigma[r][14]], m[blake2b_sigma[r][15]]);         \
    } while (0)
    ROUND(0); ROUND(1); ROUND(2); ROUND(3); ROUND(4); ROUND(5);
    ROUND(6); ROUND(7); ROUND(8); ROUND(9); ROUND(10); ROUND(11);
#undef ROUND
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

static inline void blake2b_output(const uint64_t h[8], uint8_t *out, size_t out_len) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(out, h, out_len);
#else
    for (size_t i = 0; i < out_len; i++) out[i] = (uint8_t)(h[i / 8] >> (8 * (i % 8)));
#endif
}

/* The digest of a message of ``len`` <= 128 bytes already zero-padded to one block. */
static inline void blake2b_one_block(const uint8_t block[128], size_t len, uint8_t *out,
                                     size_t out_len) {
    uint64_t h[8];
    memcpy(h, blake2b_iv, sizeof h);
    h[0] ^= 0x01010000ULL ^ (uint64_t)out_len;
    blake2b_compress(h, block, (uint64_t)len, 1);
    blake2b_output(h, out, out_len);
}

/* hashlib.blake2b(data, digest_size=out_len).digest() into out; 1 <= out_len <= 64. */
static void blake2b_digest(const uint8_t *data, size_t len, uint8_t *out, size_t out_len) {
    uint64_t h[8];
    uint8_t block[128];
    uint64_t counter = 0;
    memcpy(h, blake2b_iv, sizeof h);
    h[0] ^= 0x01010000ULL ^ (uint64_t)out_len;
    while (len > 128) {
        counter += 128;
        blake2b_compress(h, data, counter, 0);
        data += 128;
        len -= 128;
    }
    memset(block, 0, sizeof block);
    memcpy(block, data, len);
    counter += len;
    blake2b_compress(h, block, counter, 1);
    blake2b_output(h, out, out_len);
}

static PyObject *py_blake2b(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer data;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "blake2b(data, digest_size) takes 2 arguments");
        return NULL;
    }
    Py_ssize_t out_len = PyLong_AsSsize_t(args[1]);
    if (out_len == -1 && PyErr_Occurred()) return NULL;
    if (out_len < 1 || out_len > 64) {
        PyErr_SetString(PyExc_ValueError, "digest_size must be in [1, 64]");
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &data, PyBUF_SIMPLE) < 0) return NULL;
    uint8_t out[64];
    blake2b_digest((const uint8_t *)data.buf, (size_t)data.len, out, (size_t)out_len);
    PyBuffer_Release(&data);
    return PyBytes_FromStringAndSize((const char *)out, out_len);
}

/* ------------------------------------------------------------------ chained block hashes */

/* chain_hashes(parent, tokens, start, stop, block_tokens, out): append to ``out`` the
 * chained digests of tokens[start:stop] in blocks of ``block_tokens``:
 * d_i = BLAKE2b(d_{i-1} || uint32-LE tokens of block i), d_{-1} = parent, digest size
 * len(parent). All tokens are checked before anything is appended: a token that is not an
 * int in [0, 2**32) raises ValueError naming its position, and ``out`` is unchanged. */
static PyObject *py_chain_hashes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "chain_hashes(parent, tokens, start, stop, block_tokens, out)");
        return NULL;
    }
    PyObject *parent = args[0], *tokens = args[1], *out = args[5];
    if (!PyBytes_Check(parent) || PyBytes_GET_SIZE(parent) < 1 || PyBytes_GET_SIZE(parent) > 64) {
        PyErr_SetString(PyExc_TypeError, "parent must be bytes of length 1..64");
        return NULL;
    }
    if (!PyList_Check(tokens) || !PyList_Check(out)) {
        PyErr_SetString(PyExc_TypeError, "tokens and out must be lists");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[2]);
    Py_ssize_t stop = PyLong_AsSsize_t(args[3]);
    Py_ssize_t size = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (size < 1 || start < 0 || stop < start || stop > PyList_GET_SIZE(tokens)
        || (stop - start) % size) {
        PyErr_SetString(PyExc_ValueError,
                        "need 0 <= start <= stop <= len(tokens), whole blocks of block_tokens >= 1");
        return NULL;
    }
    size_t digest = (size_t)PyBytes_GET_SIZE(parent);
    Py_ssize_t count = stop - start;
    size_t message_len = digest + 4 * (size_t)size;
    uint8_t *packed = PyMem_Malloc(4 * (size_t)count + 1);
    uint8_t *message = PyMem_Malloc(message_len);
    if (packed == NULL || message == NULL) {
        PyMem_Free(packed);
        PyMem_Free(message);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (start + i >= PyList_GET_SIZE(tokens)) {
            /* An __index__ method below shortened the list. */
            PyErr_SetString(PyExc_ValueError, "token ids changed while they were hashed");
            PyMem_Free(packed);
            PyMem_Free(message);
            return NULL;
        }
        PyObject *item = PyList_GET_ITEM(tokens, start + i);
        Py_INCREF(item); /* held: an __index__ method below may drop it from the list */
        unsigned long long value;
        int bad = 0;
        if (PyLong_CheckExact(item)) {
            value = PyLong_AsUnsignedLongLong(item);
            bad = value == (unsigned long long)-1 && PyErr_Occurred();
        } else {
            PyObject *index = PyNumber_Index(item); /* as struct.pack: anything with __index__ */
            if (index == NULL) {
                bad = 1;
                value = 0;
            } else {
                value = PyLong_AsUnsignedLongLong(index);
                bad = value == (unsigned long long)-1 && PyErr_Occurred();
                Py_DECREF(index);
            }
        }
        if (bad || value > 0xFFFFFFFFULL) {
            PyErr_Clear();
            PyObject *repr = PyObject_Repr(item);
            PyErr_Format(PyExc_ValueError, "token %zd is %S, not an int in [0, 2**32)",
                         start + i, repr ? repr : Py_None);
            Py_XDECREF(repr);
            Py_DECREF(item);
            PyMem_Free(packed);
            PyMem_Free(message);
            return NULL;
        }
        uint8_t *p = packed + 4 * i;
        p[0] = (uint8_t)value;
        p[1] = (uint8_t)(value >> 8);
        p[2] = (uint8_t)(value >> 16);
        p[3] = (uint8_t)(value >> 24);
        Py_DECREF(item);
    }
    memcpy(message, PyBytes_AS_STRING(parent), digest);
    /* Parent and tokens fit one BLAKE2b block (16 tokens and a 32-byte parent do): build
     * it in place, zero padding written once. */
    uint8_t block[128];
    int one_block = message_len <= 128;
    if (one_block) {
        memset(block, 0, sizeof block);
        memcpy(block, message, digest);
    }
    for (Py_ssize_t offset = 0; offset < count; offset += size) {
        PyObject *item = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)digest);
        if (item == NULL) goto fail;
        uint8_t *digest_out = (uint8_t *)PyBytes_AS_STRING(item);
        if (one_block) {
            memcpy(block + digest, packed + 4 * offset, 4 * (size_t)size);
            blake2b_one_block(block, message_len, digest_out, digest);
            int appended = PyList_Append(out, item);
            Py_DECREF(item);
            if (appended < 0) goto fail;
            memcpy(block, digest_out, digest);
            continue;
        }
        memcpy(message + digest, packed + 4 * offset, 4 * (size_t)size);
        blake2b_digest(message, message_len, digest_out, digest);
        int appended = PyList_Append(out, item);
        Py_DECREF(item);
        if (appended < 0) goto fail;
        memcpy(message, digest_out, digest);
    }
    PyMem_Free(packed);
    PyMem_Free(message);
    Py_RETURN_NONE;
fail:
    PyMem_Free(packed);
    PyMem_Free(message);
    return NULL;
}

/* ------------------------------------------------------------------ BlockQueue
 *
 * An insertion-ordered set of block ids 0..capacity-1: the subset of OrderedDict[int, None]
 * the pool's eviction orders use (q[b] = None appends b unless present, del q[b], b in q,
 * len, iteration oldest first, popitem(last=False), clear), as an intrusive doubly linked
 * list over two int32 arrays allocated on first use (8 bytes per block), so no per-entry
 * object exists and the kernels below link and unlink blocks directly. */

typedef struct {
    PyObject_HEAD
    Py_ssize_t capacity;
    Py_ssize_t length;
    Py_ssize_t version; /* changes on every mutation: iterators refuse a changed queue */
    int32_t *prev;      /* prev[b] == -1: b is not queued; index capacity is the sentinel */
    int32_t *next;
} BlockQueue;

static PyTypeObject BlockQueue_Type;

static int queue_alloc(BlockQueue *q) {
    if (q->prev != NULL) return 0;
    size_t n = (size_t)q->capacity + 1;
    q->prev = PyMem_Malloc(n * sizeof(int32_t));
    q->next = PyMem_Malloc(n * sizeof(int32_t));
    if (q->prev == NULL || q->next == NULL) {
        PyMem_Free(q->prev);
        PyMem_Free(q->next);
        q->prev = q->next = NULL;
        PyErr_NoMemory();
        return -1;
    }
    memset(q->prev, 0xff, n * sizeof(int32_t));
    Py_ssize_t s = q->capacity;
    q->prev[s] = q->next[s] = (int32_t)s;
    return 0;
}

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

static int queue_block_arg(BlockQueue *q, PyObject *key, Py_ssize_t *block) {
    if (!PyLong_Check(key)) {
        PyErr_Format(PyExc_TypeError, "BlockQueue holds block ids (ints), not %R", key);
        return -1;
    }
    *block = PyLong_AsSsize_t(key);
    if (*block == -1 && PyErr_Occurred()) return -1;
    if (*block < 0 || *block >= q->capacity) {
        PyErr_Format(PyExc_KeyError, "block id %zd is not in 0..%zd", *block, q->capacity - 1);
        return -1;
    }
    return 0;
}

static PyObject *BlockQueue_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    Py_ssize_t capacity;
    static char *names[] = {"capacity", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n", names, &capacity)) return NULL;
    if (capacity < 1 || capacity > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "BlockQueue capacity must be in [1, 2**31 - 1]");
        return NULL;
    }
    BlockQueue *q = (BlockQueue *)type->tp_alloc(type, 0);
    if (q == NULL) return NULL;
    q->capacity = capacity;
    return (PyObject *)q;
}

static void BlockQueue_dealloc(BlockQueue *q) {
    PyMem_Free(q->prev);
    PyMem_Free(q->next);
    Py_TYPE(q)->tp_free((PyObject *)q);
}

static Py_ssize_t BlockQueue_len(BlockQueue *q) { return q->length; }

static int BlockQueue_contains(BlockQueue *q, PyObject *key) {
    if (!PyLong_Check(key)) return 0;
    Py_ssize_t b = PyLong_AsSsize_t(key);
    if (b == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return queue_has(q, b);
}

static int BlockQueue_ass_sub(BlockQueue *q, PyObject *key, PyObject *value) {
    Py_ssize_t b;
    if (queue_block_arg(q, key, &b) < 0) return -1;
    if (value == NULL) {
        if (!queue_has(q, b)) {
            PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        queue_unlink(q, b);
        return 0;
    }
    if (value != Py_None) {
        PyErr_SetString(PyExc_TypeError, "BlockQueue values are None (it is an ordered set)");
        return -1;
    }
    if (queue_alloc(q) < 0) return -1;
    if (!queue_has(q, b)) queue_push(q, b); /* as OrderedDict: present keys keep their place */
    return 0;
}

static PyObject *BlockQueue_subscript(BlockQueue *q, PyObject *key) {
    if (BlockQueue_contains(q, key)) Py_RETURN_NONE;
    PyErr_SetObject(PyExc_KeyError, key);
    return NULL;
}

static PyObject *BlockQueue_popitem(BlockQueue *q, PyObject *args, PyObject *kwargs) {
    int last = 1;
    static char *names[] = {"last", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|p", names, &last)) return NULL;
    if (q->length == 0) {
        PyErr_SetString(PyExc_KeyError, "popitem(): BlockQueue is empty");
        return NULL;
    }
    Py_ssize_t s = q->capacity;
    Py_ssize_t b = last ? q->prev[s] : q->next[s];
    queue_unlink(q, b);
    PyObject *key = PyLong_FromSsize_t(b);
    if (key == NULL) return NULL;
    PyObject *pair = PyTuple_Pack(2, key, Py_None);
    Py_DECREF(key);
    return pair;
}

static PyObject *BlockQueue_clear(BlockQueue *q, PyObject *unused) {
    PyMem_Free(q->prev);
    PyMem_Free(q->next);
    q->prev = q->next = NULL;
    q->length = 0;
    q->version++;
    Py_RETURN_NONE;
}

static PyObject *BlockQueue_sizeof(BlockQueue *q, PyObject *unused) {
    Py_ssize_t size = (Py_ssize_t)sizeof(BlockQueue);
    if (q->prev != NULL) size += 2 * (q->capacity + 1) * (Py_ssize_t)sizeof(int32_t);
    return PyLong_FromSsize_t(size);
}

static PyObject *BlockQueue_list(BlockQueue *q) {
    PyObject *items = PyList_New(q->length);
    if (items == NULL) return NULL;
    Py_ssize_t s = q->capacity, i = 0;
    for (Py_ssize_t b = q->length ? q->next[s] : s; b != s; b = q->next[b]) {
        PyObject *key = PyLong_FromSsize_t(b);
        if (key == NULL) {
            Py_DECREF(items);
            return NULL;
        }
        PyList_SET_ITEM(items, i++, key);
    }
    return items;
}

static PyObject *BlockQueue_repr(BlockQueue *q) {
    PyObject *items = BlockQueue_list(q);
    if (items == NULL) return NULL;
    PyObject *text = PyUnicode_FromFormat("BlockQueue(capacity=%zd, %R)", q->capacity, items);
    Py_DECREF(items);
    return text;
}

static PyObject *BlockQueue_richcompare(PyObject *a, PyObject *b, int op) {
    if ((op != Py_EQ && op != Py_NE) || !PyObject_TypeCheck(b, &BlockQueue_Type))
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *left = BlockQueue_list((BlockQueue *)a);
    if (left == NULL) return NULL;
    PyObject *right = BlockQueue_list((BlockQueue *)b);
    if (right == NULL) {
        Py_DECREF(left);
        return NULL;
    }
    int equal = ((BlockQueue *)a)->capacity == ((BlockQueue *)b)->capacity
        && PyObject_RichCompareBool(left, right, Py_EQ) == 1;
    Py_DECREF(left);
    Py_DECREF(right);
    if (op == Py_NE) equal = !equal;
    return PyBool_FromLong(equal);
}

typedef struct {
    PyObject_HEAD
    BlockQueue *queue;
    Py_ssize_t at;      /* next block to yield; the sentinel when done */
    Py_ssize_t version; /* the queue's version when the iterator was made */
} BlockQueueIter;

static PyTypeObject BlockQueueIter_Type;

static PyObject *BlockQueue_iter(BlockQueue *q) {
    BlockQueueIter *it = PyObject_New(BlockQueueIter, &BlockQueueIter_Type);
    if (it == NULL) return NULL;
    Py_INCREF(q);
    it->queue = q;
    it->at = q->length ? q->next[q->capacity] : q->capacity;
    it->version = q->version;
    return (PyObject *)it;
}

static void BlockQueueIter_dealloc(BlockQueueIter *it) {
    Py_DECREF(it->queue);
    PyObject_Free(it);
}

static PyObject *BlockQueueIter_next(BlockQueueIter *it) {
    BlockQueue *q = it->queue;
    if (it->version != q->version) {
        PyErr_SetString(PyExc_RuntimeError, "BlockQueue changed during iteration");
        return NULL;
    }
    if (it->at == q->capacity) return NULL;
    Py_ssize_t b = it->at;
    it->at = q->next[b];
    return PyLong_FromSsize_t(b);
}

static PyTypeObject BlockQueueIter_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvspec_core.runtime._native.BlockQueueIterator",
    .tp_basicsize = sizeof(BlockQueueIter),
    .tp_dealloc = (destructor)BlockQueueIter_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)BlockQueueIter_next,
};

static PyMappingMethods BlockQueue_mapping = {
    .mp_length = (lenfunc)BlockQueue_len,
    .mp_subscript = (binaryfunc)BlockQueue_subscript,
    .mp_ass_subscript = (objobjargproc)BlockQueue_ass_sub,
};

static PySequenceMethods BlockQueue_sequence = {
    .sq_contains = (objobjproc)BlockQueue_contains,
};

static PyMethodDef BlockQueue_methods[] = {
    {"popitem", (PyCFunction)(void (*)(void))BlockQueue_popitem, METH_VARARGS | METH_KEYWORDS,
     "popitem(last=True) -> (block, None): remove the newest (last=False: oldest) block"},
    {"clear", (PyCFunction)BlockQueue_clear, METH_NOARGS, "remove every block"},
    {"__sizeof__", (PyCFunction)BlockQueue_sizeof, METH_NOARGS, "bytes held"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject BlockQueue_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvspec_core.runtime._native.BlockQueue",
    .tp_doc = "BlockQueue(capacity): an insertion-ordered set of block ids 0..capacity-1 "
              "with OrderedDict[int, None]'s interface (8 bytes per block once used)",
    .tp_basicsize = sizeof(BlockQueue),
    .tp_dealloc = (destructor)BlockQueue_dealloc,
    .tp_repr = (reprfunc)BlockQueue_repr,
    .tp_as_sequence = &BlockQueue_sequence,
    .tp_as_mapping = &BlockQueue_mapping,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_richcompare = BlockQueue_richcompare,
    .tp_iter = (getiterfunc)BlockQueue_iter,
    .tp_methods = BlockQueue_methods,
    .tp_new = BlockQueue_new,
    .tp_hash = PyObject_HashNotImplemented,
};

/* The queue if ``object`` is a BlockQueue of at least ``size`` ids, else NULL. */
static inline BlockQueue *as_queue(PyObject *object, Py_ssize_t size) {
    if (Py_IS_TYPE(object, &BlockQueue_Type) && ((BlockQueue *)object)->capacity >= size)
        return (BlockQueue *)object;
    return NULL;
}

/* ------------------------------------------------------------------ pool kernels
 *
 * Twins of BlockPool's per-block loops, over the pool's own containers: ref counts (a list of
 * ints), cached hashes (a list of bytes or None), reused flags (a bytearray), group ids (an
 * array of uint16), the free stack (an array of int) and the two eviction orders
 * (OrderedDicts). Block ids are bounds-checked before anything changes. */

static PyObject *one; /* the int 1 */
static PyObject *str_extend, *str_request_id, *str_computed, *str_end_limit,
    *str_known_limit, *str_computed_limit;

static inline int block_in_range(Py_ssize_t block, Py_ssize_t size) {
    if (block < 0 || block >= size) {
        PyErr_Format(PyExc_IndexError, "block id %zd is not in this pool (0..%zd)", block,
                     size - 1);
        return 0;
    }
    return 1;
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
        Py_ssize_t block = PyLong_AsSsize_t(PyList_GET_ITEM(blocks, i));
        if ((block == -1 && PyErr_Occurred()) || !block_in_range(block, size)) {
            PyMem_Free(ids);
            return NULL;
        }
        ids[i] = block;
    }
    *count = n;
    return ids;
}

static inline Py_ssize_t ref_of(PyObject *refs, Py_ssize_t block) {
    return PyLong_AsSsize_t(PyList_GET_ITEM(refs, block));
}

static inline int set_ref(PyObject *refs, Py_ssize_t block, Py_ssize_t count) {
    PyObject *value = PyLong_FromSsize_t(count);
    if (value == NULL) return -1;
    PyObject *old = PyList_GET_ITEM(refs, block);
    PyList_SET_ITEM(refs, block, value);
    Py_DECREF(old);
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
static PyObject *py_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
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
    const char *flags = PyByteArray_AS_STRING(reused);
    PyObject *uncached = PyList_New(0);
    if (uncached == NULL) goto fail;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t block = ids[reverse ? count - 1 - i : i];
        if (!block) continue;
        Py_ssize_t refs_left = ref_of(refs, block) - 1;
        if (set_ref(refs, block, refs_left) < 0) goto fail;
        if (refs_left) continue;
        PyObject *key = PyList_GET_ITEM(args[0], reverse ? count - 1 - i : i);
        int failed;
        if (PyList_GET_ITEM(block_hash, block) == Py_None) {
            failed = PyList_Append(uncached, key);
        } else {
            PyObject *target = flags[block] ? protected_ : evictable;
            BlockQueue *queue = as_queue(target, PyList_GET_SIZE(refs));
            if (queue != NULL && (queue->prev != NULL || queue_alloc(queue) == 0)) {
                if (!queue_has(queue, block)) queue_push(queue, block);
                failed = 0;
            } else {
                failed = queue != NULL ? -1 : PyObject_SetItem(target, key, Py_None);
            }
        }
        if (failed < 0) goto fail;
    }
    if (PyList_GET_SIZE(uncached)) {
        PyObject *done = PyObject_CallMethodOneArg(fresh, str_extend, uncached);
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

/* touch(blocks, refs, reused, evictable, protected, segmented, check) -> int: add a
 * reference to each non-null block; a free one leaves its eviction order; ``segmented``
 * marks each reused. With ``check``, first finds a block that is neither in use nor a cached
 * free block: returns its position in ``blocks`` and changes nothing. Returns -1 when done.
 * BlockPool.touch. */
static PyObject *py_touch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "touch takes 7 arguments");
        return NULL;
    }
    PyObject *refs = args[1], *reused = args[2], *evictable = args[3], *protected_ = args[4];
    int segmented = PyObject_IsTrue(args[5]), check = PyObject_IsTrue(args[6]);
    if (segmented < 0 || check < 0) return NULL;
    if (!PyList_CheckExact(refs) || !PyByteArray_CheckExact(reused)
        || PyByteArray_GET_SIZE(reused) != PyList_GET_SIZE(refs) || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "touch: blocks and refs must be lists, reused a bytearray");
        return NULL;
    }
    PyObject *blocks = args[0];
    Py_ssize_t size = PyList_GET_SIZE(refs), count = PyList_GET_SIZE(blocks);
    if (check) {
        for (Py_ssize_t i = 0; i < count; i++) {
            PyObject *key = PyList_GET_ITEM(blocks, i);
            Py_ssize_t block = PyLong_AsSsize_t(key);
            if (block == -1 && PyErr_Occurred()) return NULL;
            if (!block) continue;
            if (block < 0 || block >= size) return PyLong_FromSsize_t(i);
            if (ref_of(refs, block)) continue;
            int found = PySequence_Contains(evictable, key);
            if (found == 0) found = PySequence_Contains(protected_, key);
            if (found < 0) return NULL;
            if (!found) return PyLong_FromSsize_t(i);
        }
    }
    char *flags = PyByteArray_AS_STRING(reused);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *key = PyList_GET_ITEM(blocks, i);
        Py_ssize_t block = PyLong_AsSsize_t(key);
        if (block == -1 && PyErr_Occurred()) return NULL;
        if (!block) continue;
        if (!block_in_range(block, size)) return NULL;
        Py_ssize_t refs_now = ref_of(refs, block);
        if (refs_now == 0) {
            PyObject *target = flags[block] ? protected_ : evictable;
            BlockQueue *queue = as_queue(target, size);
            if (queue != NULL && queue_has(queue, block))
                queue_unlink(queue, block);
            else if (PyObject_DelItem(target, key) < 0)
                return NULL;
        }
        if (segmented) flags[block] = 1;
        if (set_ref(refs, block, refs_now + 1) < 0) return NULL;
    }
    return PyLong_FromLong(-1);
}

/* evict_take(count, out, evictable, caches, block_group, block_hash, refs): pop ``count``
 * blocks from the front of ``evictable`` (never-reused cached free blocks, oldest first),
 * drop each from its group's cache (``caches[block_group[block]]``), give it ref count 1 and
 * append it to ``out``. BlockPool.take's one-pass eviction; the caller checked that
 * ``evictable`` holds ``count`` blocks. */
static PyObject *py_evict_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "evict_take takes 7 arguments");
        return NULL;
    }
    Py_ssize_t count = PyLong_AsSsize_t(args[0]);
    if (count == -1 && PyErr_Occurred()) return NULL;
    PyObject *out = args[1], *evictable = args[2], *caches = args[3], *block_hash = args[5],
             *refs = args[6];
    if (!PyList_Check(out) || !PyDict_Check(caches) || !PyList_CheckExact(block_hash)
        || !PyList_CheckExact(refs) || PyList_GET_SIZE(refs) != PyList_GET_SIZE(block_hash)) {
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
    PyObject *cache = NULL, *cache_gid; /* cache: borrowed, the last group's */
    long last_gid = -1;
    /* The oldest ``count`` keys in one pass of an iterator, then each deleted: cheaper than
     * ``count`` popitem calls (no method call, no result tuple per block). */
    Py_ssize_t first = PyList_GET_SIZE(out);
    BlockQueue *queue = as_queue(evictable, size);
    if (queue != NULL) {
        if (queue->length < count) {
            PyErr_SetString(PyExc_KeyError, "evict_take: too few blocks");
            goto fail;
        }
        Py_ssize_t sentinel = queue->capacity;
        for (Py_ssize_t i = 0; i < count; i++) {
            Py_ssize_t block = queue->next[sentinel];
            PyObject *key = PyLong_FromSsize_t(block);
            if (key == NULL) goto fail;
            int appended = PyList_Append(out, key);
            Py_DECREF(key);
            if (appended < 0) goto fail;
            queue_unlink(queue, block);
        }
    }
    PyObject *iterator = queue != NULL ? NULL : PyObject_GetIter(evictable);
    if (queue != NULL) goto evicted;
    if (iterator == NULL) goto fail;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *key = PyIter_Next(iterator);
        if (key == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "evict_take: too few blocks");
            Py_DECREF(iterator);
            goto fail;
        }
        int appended = PyList_Append(out, key);
        Py_DECREF(key);
        if (appended < 0) {
            Py_DECREF(iterator);
            goto fail;
        }
    }
    Py_DECREF(iterator);
evicted:
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *key = PyList_GET_ITEM(out, first + i);
        Py_INCREF(key);
        if (queue == NULL && PyObject_DelItem(evictable, key) < 0) {
            Py_DECREF(key);
            goto fail;
        }
        Py_ssize_t block = PyLong_AsSsize_t(key);
        if ((block == -1 && PyErr_Occurred()) || !block_in_range(block, size)) {
            Py_DECREF(key);
            goto fail;
        }
        if (group_of[block] != last_gid) {
            last_gid = group_of[block];
            cache_gid = PyLong_FromLong(last_gid);
            if (cache_gid == NULL) {
                Py_DECREF(key);
                goto fail;
            }
            cache = PyDict_GetItemWithError(caches, cache_gid);
            Py_DECREF(cache_gid);
            if (cache == NULL) {
                if (!PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "no cache of group %ld", last_gid);
                Py_DECREF(key);
                goto fail;
            }
        }
        PyObject *digest = PyList_GET_ITEM(block_hash, block);
        Py_INCREF(Py_None);
        PyList_SET_ITEM(block_hash, block, Py_None);
        int failed = PyDict_DelItem(cache, digest);
        Py_DECREF(digest);
        if (failed < 0 || set_ref(refs, block, 1) < 0) {
            Py_DECREF(key);
            goto fail;
        }
        Py_DECREF(key);
    }
    PyBuffer_Release(&groups);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&groups);
    return NULL;
}

/* cache_blocks(gid, digests, blocks, cache, block_hash, block_group, move_hash) -> int: for
 * each (digest, block) pair of a non-null block with no cached hash: map ``digest`` to it in
 * ``cache`` (an entry naming another block calls ``move_hash(cache, digest, old, block)``),
 * record the hash and, with ``block_group`` not None, the group. Returns how many blocks were
 * newly cached. BlockPool.cache_blocks. */
static PyObject *py_cache_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
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
    Py_ssize_t n = PyList_GET_SIZE(digests);
    if (PyList_GET_SIZE(blocks) < n) n = PyList_GET_SIZE(blocks);
    Py_ssize_t stored = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(blocks, i);
        Py_ssize_t block = PyLong_AsSsize_t(key);
        if ((block == -1 && PyErr_Occurred()) || !block_in_range(block, size)) goto fail;
        if (!block || PyList_GET_ITEM(block_hash, block) != Py_None) continue;
        PyObject *digest = PyList_GET_ITEM(digests, i);
        PyObject *old = PyDict_SetDefault(cache, digest, key); /* borrowed */
        if (old == NULL) goto fail;
        if (old != key) {
            Py_ssize_t old_block = PyLong_AsSsize_t(old);
            if (old_block == -1 && PyErr_Occurred()) goto fail;
            if (old_block != block) {
                Py_INCREF(old);
                PyObject *call[4] = {cache, digest, old, key};
                PyObject *done = PyObject_Vectorcall(move_hash, call, 4, NULL);
                Py_DECREF(old);
                if (done == NULL) goto fail;
                Py_DECREF(done);
            }
        }
        Py_INCREF(digest);
        PyObject *previous = PyList_GET_ITEM(block_hash, block);
        PyList_SET_ITEM(block_hash, block, digest);
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

/* longest_hit(digests, cache, max_blocks) -> list: the blocks ``cache`` maps the first
 * digests to, up to the first digest it lacks, at most ``max_blocks``.
 * FullAttentionRules.longest_hit. */
static PyObject *py_longest_hit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "longest_hit(digests, cache, max_blocks)");
        return NULL;
    }
    PyObject *digests = args[0], *cache = args[1];
    Py_ssize_t max_blocks = PyLong_AsSsize_t(args[2]);
    if (max_blocks == -1 && PyErr_Occurred()) return NULL;
    if (!PyList_Check(digests) || !PyDict_Check(cache)) {
        PyErr_SetString(PyExc_TypeError, "longest_hit: digests must be a list, cache a dict");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(digests);
    if (max_blocks < n) n = max_blocks < 0 ? 0 : max_blocks;
    PyObject *found = PyList_New(0);
    if (found == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n && i < PyList_GET_SIZE(digests); i++) {
        /* Held: a key's __eq__ may change the list. */
        PyObject *digest = PyList_GET_ITEM(digests, i);
        Py_INCREF(digest);
        PyObject *block = PyDict_GetItemWithError(cache, digest);
        Py_DECREF(digest);
        if (block == NULL) {
            if (PyErr_Occurred()) {
                Py_DECREF(found);
                return NULL;
            }
            break;
        }
        if (PyList_Append(found, block) < 0) {
            Py_DECREF(found);
            return NULL;
        }
    }
    return found;
}

/* ------------------------------------------------------------------ allocator step kernel */

/* The allocator's per-request state class (``_Running``, a __slots__ class) and where its
 * four step fields sit in its instances, from its member descriptors: reading a slot there
 * skips the attribute lookup. Set by register_state_type; other objects take getattr. */
static PyTypeObject *state_type, *request_type;
static Py_ssize_t state_offsets[4]; /* computed, end_limit, known_limit, computed_limit */

/* register_types(state_class, request_class): the allocator's per-request state class (its
 * step fields are read in place) and the Request class (a bare Request in a step is one
 * new token). */
static PyObject *py_register_types(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyType_Check(args[0]) || !PyType_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "register_types(state_class, request_class)");
        return NULL;
    }
    PyObject *type = args[0];
    PyObject *names[4] = {str_computed, str_end_limit, str_known_limit, str_computed_limit};
    Py_ssize_t offsets[4];
    for (int i = 0; i < 4; i++) {
        PyObject *descr = PyObject_GetAttr(type, names[i]);
        if (descr == NULL) return NULL;
        int is_slot = Py_IS_TYPE(descr, &PyMemberDescr_Type)
            && ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX;
        if (is_slot) offsets[i] = ((PyMemberDescrObject *)descr)->d_member->offset;
        Py_DECREF(descr);
        if (!is_slot) {
            PyErr_Format(PyExc_TypeError, "%R.%U must be a __slots__ field", type, names[i]);
            return NULL;
        }
    }
    Py_INCREF(type);
    Py_XSETREF(state_type, (PyTypeObject *)type);
    Py_INCREF(args[1]);
    Py_XSETREF(request_type, (PyTypeObject *)args[1]);
    memcpy(state_offsets, offsets, sizeof offsets);
    Py_RETURN_NONE;
}

/* Field ``index`` of a state as an int; -1 with an exception if unset or not an int. */
static inline int state_int(PyObject *state, int index, Py_ssize_t *value) {
    static PyObject **names[4] = {&str_computed, &str_end_limit, &str_known_limit,
                                  &str_computed_limit};
    PyObject *item;
    if (Py_TYPE(state) == state_type) {
        item = *(PyObject **)((char *)state + state_offsets[index]);
        if (item == NULL) {
            PyErr_SetObject(PyExc_AttributeError, *names[index]);
            return -1;
        }
        Py_INCREF(item);
    } else {
        item = PyObject_GetAttr(state, *names[index]);
        if (item == NULL) return -1;
    }
    *value = PyLong_AsSsize_t(item);
    Py_DECREF(item);
    return (*value == -1 && PyErr_Occurred()) ? -1 : 0;
}

static inline int set_state_computed(PyObject *state, PyObject *value) {
    if (Py_TYPE(state) == state_type) {
        PyObject **slot = (PyObject **)((char *)state + state_offsets[0]);
        Py_INCREF(value);
        Py_XSETREF(*slot, value);
        return 0;
    }
    return PyObject_SetAttr(state, str_computed, value);
}

/* allocate_slots(request, count_object, lookahead)'s first test, for a running request:
 * 1: the step needs no new block, caches and frees nothing, and its tokens were counted as
 * computed (the answer is no_new_blocks); 2: a running or new request whose step needs the
 * general path; 0: not an exact int count >= 0 or no hashable request_id (the general path
 * says what is wrong); -1: an error. */
static int fast_step(PyObject *running, PyObject *request, PyObject *count_object,
                     Py_ssize_t lookahead) {
    if (!PyLong_CheckExact(count_object)) return 0;
    Py_ssize_t count = PyLong_AsSsize_t(count_object);
    if (count == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (count < 0) return 0;
    PyObject *rid = PyObject_GetAttr(request, str_request_id);
    if (rid == NULL) {
        PyErr_Clear();
        return 0;
    }
    PyObject *state = PyDict_GetItemWithError(running, rid);
    Py_DECREF(rid);
    if (state == NULL) {
        if (!PyErr_Occurred()) return 2; /* not running yet: an admission */
        PyErr_Clear(); /* an unhashable id */
        return 0;
    }
    Py_INCREF(state);
    Py_ssize_t computed, end_limit, known_limit, computed_limit;
    int result = 2;
    if (state_int(state, 0, &computed) < 0 || state_int(state, 1, &end_limit) < 0
        || state_int(state, 2, &known_limit) < 0 || state_int(state, 3, &computed_limit) < 0) {
        result = -1;
    } else {
        Py_ssize_t known = computed + count;
        if (known + lookahead < end_limit && known < known_limit && computed < computed_limit) {
            PyObject *value = PyLong_FromSsize_t(known);
            result = (value == NULL || set_state_computed(state, value) < 0) ? -1 : 1;
            Py_XDECREF(value);
        }
    }
    Py_DECREF(state);
    return result;
}

/* step(pairs, running, lookahead, no_new_blocks, allocate_slots, one_pair, results): for
 * each item of ``pairs``, a 2-tuple (request, n) or a bare Request (n = 1), of a running
 * request whose n new tokens need no new block, no newly cacheable block and free nothing
 * (its state's end_limit, known_limit and computed_limit, as allocate_slots' first test) just
 * counts them as computed and appends ``no_new_blocks``; another such item (a request with a
 * hashable request_id, an int n) appends ``allocate_slots(request, n, lookahead)``; any other
 * item appends ``one_pair(item, position)``. The loop of KVCacheAllocator.allocate_step. */
static PyObject *py_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "step takes 7 arguments");
        return NULL;
    }
    PyObject *running = args[1], *no_new_blocks = args[3], *allocate_slots = args[4],
             *one_pair = args[5], *results = args[6];
    Py_ssize_t lookahead = PyLong_AsSsize_t(args[2]);
    if (lookahead == -1 && PyErr_Occurred()) return NULL;
    if (!PyDict_Check(running) || !PyList_Check(results)) {
        PyErr_SetString(PyExc_TypeError, "step: running must be a dict, results a list");
        return NULL;
    }
    PyObject *iterator = PyObject_GetIter(args[0]);
    if (iterator == NULL) return NULL;
    PyObject *pair;
    while ((pair = PyIter_Next(iterator)) != NULL) {
        int done = 0, well_formed = 0;
        PyObject *request = NULL, *count_object = NULL; /* borrowed */
        if (PyTuple_CheckExact(pair) && PyTuple_GET_SIZE(pair) == 2
            && PyLong_CheckExact(PyTuple_GET_ITEM(pair, 1))) {
            request = PyTuple_GET_ITEM(pair, 0);
            count_object = PyTuple_GET_ITEM(pair, 1);
        } else if (request_type != NULL && PyObject_TypeCheck(pair, request_type)) {
            request = pair;
            count_object = one;
        }
        if (request != NULL) {
            int fast = fast_step(running, request, count_object, lookahead);
            if (fast < 0) goto fail_pair;
            if (fast == 1) {
                if (PyList_Append(results, no_new_blocks) < 0) goto fail_pair;
                done = 1;
            }
            well_formed = fast == 2;
        }
        if (!done) {
            PyObject *result;
            if (well_formed) {
                PyObject *call[3] = {request, count_object, args[2]};
                result = PyObject_Vectorcall(allocate_slots, call, 3, NULL);
            } else {
                PyObject *position = PyLong_FromSsize_t(PyList_GET_SIZE(results));
                if (position == NULL) goto fail_pair;
                PyObject *call[2] = {pair, position};
                result = PyObject_Vectorcall(one_pair, call, 2, NULL);
                Py_DECREF(position);
            }
            if (result == NULL) goto fail_pair;
            int failed = PyList_Append(results, result);
            Py_DECREF(result);
            if (failed < 0) goto fail_pair;
        }
        Py_DECREF(pair);
    }
    Py_DECREF(iterator);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
fail_pair:
    Py_DECREF(pair);
    Py_DECREF(iterator);
    return NULL;
}

/* ------------------------------------------------------------------ SlotsFastPath
 *
 * SlotsFastPath(running, no_new_blocks, general): a callable taking allocate_slots'
 * arguments. A call (request, n[, lookahead]) with exact ints n, lookahead >= 0, for a
 * running request whose step needs no new block, caches nothing and frees nothing (as
 * allocate_slots' first test) counts the tokens as computed and returns no_new_blocks, with
 * no Python frame; every other call is general(*args, **kwargs). An allocator built with the
 * kernels holds one as its allocate_slots. */

typedef struct {
    PyObject_HEAD
    PyObject *running;
    PyObject *no_new_blocks;
    PyObject *general;
    vectorcallfunc vectorcall;
} SlotsFastPath;

static PyTypeObject SlotsFastPath_Type;

static PyObject *SlotsFastPath_vectorcall(PyObject *callable, PyObject *const *args,
                                          size_t nargsf, PyObject *kwnames) {
    SlotsFastPath *self = (SlotsFastPath *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (kwnames == NULL && (nargs == 2 || nargs == 3)) {
        Py_ssize_t lookahead = 0;
        int valid = 1;
        if (nargs == 3) {
            valid = PyLong_CheckExact(args[2]);
            if (valid) {
                lookahead = PyLong_AsSsize_t(args[2]);
                if (lookahead == -1 && PyErr_Occurred()) {
                    PyErr_Clear();
                    valid = 0;
                }
                valid = valid && lookahead >= 0;
            }
        }
        if (valid) {
            int fast = fast_step(self->running, args[0], args[1], lookahead);
            if (fast < 0) return NULL;
            if (fast == 1) {
                Py_INCREF(self->no_new_blocks);
                return self->no_new_blocks;
            }
        }
    }
    return PyObject_Vectorcall(self->general, args, nargsf, kwnames);
}

static PyObject *SlotsFastPath_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *running, *no_new_blocks, *general;
    static char *names[] = {"running", "no_new_blocks", "general", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!OO", names, &PyDict_Type, &running,
                                     &no_new_blocks, &general))
        return NULL;
    if (!PyCallable_Check(general)) {
        PyErr_SetString(PyExc_TypeError, "SlotsFastPath: general must be callable");
        return NULL;
    }
    SlotsFastPath *self = (SlotsFastPath *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    Py_INCREF(running);
    Py_INCREF(no_new_blocks);
    Py_INCREF(general);
    self->running = running;
    self->no_new_blocks = no_new_blocks;
    self->general = general;
    self->vectorcall = SlotsFastPath_vectorcall;
    return (PyObject *)self;
}

static int SlotsFastPath_traverse(SlotsFastPath *self, visitproc visit, void *arg) {
    Py_VISIT(self->running);
    Py_VISIT(self->no_new_blocks);
    Py_VISIT(self->general);
    return 0;
}

static int SlotsFastPath_clear(SlotsFastPath *self) {
    Py_CLEAR(self->running);
    Py_CLEAR(self->no_new_blocks);
    Py_CLEAR(self->general);
    return 0;
}

static void SlotsFastPath_dealloc(SlotsFastPath *self) {
    PyObject_GC_UnTrack(self);
    SlotsFastPath_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *SlotsFastPath_get_doc(SlotsFastPath *self, void *closure) {
    return PyObject_GetAttrString(self->general, "__doc__");
}

static PyObject *SlotsFastPath_get_wrapped(SlotsFastPath *self, void *closure) {
    Py_INCREF(self->general);
    return self->general;
}

static PyGetSetDef SlotsFastPath_getset[] = {
    {"__doc__", (getter)SlotsFastPath_get_doc, NULL, "the general path's docstring", NULL},
    {"__wrapped__", (getter)SlotsFastPath_get_wrapped, NULL, "the general path", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SlotsFastPath_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvspec_core.runtime._native.SlotsFastPath",
    .tp_basicsize = sizeof(SlotsFastPath),
    .tp_dealloc = (destructor)SlotsFastPath_dealloc,
    .tp_vectorcall_offset = offsetof(SlotsFastPath, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_traverse = (traverseproc)SlotsFastPath_traverse,
    .tp_clear = (inquiry)SlotsFastPath_clear,
    .tp_getset = SlotsFastPath_getset,
    .tp_new = SlotsFastPath_new,
};

/* ------------------------------------------------------------------ module */

static PyMethodDef native_methods[] = {
    {"blake2b", (PyCFunction)(void (*)(void))py_blake2b, METH_FASTCALL,
     "blake2b(data, digest_size) -> bytes: hashlib.blake2b(data, digest_size=n).digest()"},
    {"chain_hashes", (PyCFunction)(void (*)(void))py_chain_hashes, METH_FASTCALL,
     "chain_hashes(parent, tokens, start, stop, block_tokens, out): append chained digests"},
    {"release", (PyCFunction)(void (*)(void))py_release, METH_FASTCALL,
     "release(blocks, reverse, refs, block_hash, reused, fresh, evictable, protected)"},
    {"touch", (PyCFunction)(void (*)(void))py_touch, METH_FASTCALL,
     "touch(blocks, refs, reused, evictable, protected, segmented, check) -> int"},
    {"evict_take", (PyCFunction)(void (*)(void))py_evict_take, METH_FASTCALL,
     "evict_take(count, out, evictable, caches, block_group, block_hash, refs)"},
    {"cache_blocks", (PyCFunction)(void (*)(void))py_cache_blocks, METH_FASTCALL,
     "cache_blocks(gid, digests, blocks, cache, block_hash, block_group, move_hash) -> int"},
    {"longest_hit", (PyCFunction)(void (*)(void))py_longest_hit, METH_FASTCALL,
     "longest_hit(digests, cache, max_blocks) -> list of the cached prefix's blocks"},
    {"register_types", (PyCFunction)(void (*)(void))py_register_types, METH_FASTCALL,
     "register_types(state_class, request_class): the classes step reads directly"},
    {"step", (PyCFunction)(void (*)(void))py_step, METH_FASTCALL,
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
        {&str_extend, "extend"}, {&str_request_id, "request_id"},
        {&str_computed, "computed"}, {&str_end_limit, "end_limit"},
        {&str_known_limit, "known_limit"}, {&str_computed_limit, "computed_limit"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        *names[i].slot = PyUnicode_InternFromString(names[i].text);
        if (*names[i].slot == NULL) return NULL;
    }
    one = PyLong_FromLong(1);
    if (one == NULL) return NULL;
    if (PyType_Ready(&BlockQueue_Type) < 0 || PyType_Ready(&BlockQueueIter_Type) < 0
        || PyType_Ready(&SlotsFastPath_Type) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&native_module);
    if (module == NULL) return NULL;
    Py_INCREF(&BlockQueue_Type);
    if (PyModule_AddObject(module, "BlockQueue", (PyObject *)&BlockQueue_Type) < 0) {
        Py_DECREF(&BlockQueue_Type);
        Py_DECREF(module);
        return NULL;
    }
    Py_INCREF(&SlotsFastPath_Type);
    if (PyModule_AddObject(module, "SlotsFastPath", (PyObject *)&SlotsFastPath_Type) < 0) {
        Py_DECREF(&SlotsFastPath_Type);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
