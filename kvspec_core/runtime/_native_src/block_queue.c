/* BlockQueue, the pools' eviction orders; see block_queue.h. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "block_queue.h"

int kv_queue_alloc(BlockQueue *q) {
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
    if (kv_queue_alloc(q) < 0) return -1;
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
    if ((op != Py_EQ && op != Py_NE) || !PyObject_TypeCheck(b, &kv_BlockQueue_Type))
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

/* Copies and pickles rebuild the queue from its capacity and its blocks in order. */
static PyObject *BlockQueue_reduce(BlockQueue *q, PyObject *unused) {
    PyObject *items = BlockQueue_list(q);
    if (items == NULL) return NULL;
    PyObject *result = Py_BuildValue("O(n)N", (PyObject *)Py_TYPE(q), q->capacity, items);
    return result;
}

static PyObject *BlockQueue_setstate(BlockQueue *q, PyObject *items) {
    PyObject *iterator = PyObject_GetIter(items);
    if (iterator == NULL) return NULL;
    PyObject *clear = BlockQueue_clear(q, NULL);
    Py_XDECREF(clear);
    PyObject *key;
    while ((key = PyIter_Next(iterator)) != NULL) {
        int failed = BlockQueue_ass_sub(q, key, Py_None);
        Py_DECREF(key);
        if (failed < 0) {
            Py_DECREF(iterator);
            return NULL;
        }
    }
    Py_DECREF(iterator);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef BlockQueue_methods[] = {
    {"popitem", (PyCFunction)(void (*)(void))BlockQueue_popitem, METH_VARARGS | METH_KEYWORDS,
     "popitem(last=True) -> (block, None): remove the newest (last=False: oldest) block"},
    {"clear", (PyCFunction)BlockQueue_clear, METH_NOARGS, "remove every block"},
    {"__sizeof__", (PyCFunction)BlockQueue_sizeof, METH_NOARGS, "bytes held"},
    {"__reduce__", (PyCFunction)BlockQueue_reduce, METH_NOARGS, "copy and pickle support"},
    {"__setstate__", (PyCFunction)BlockQueue_setstate, METH_O, "the blocks, in order"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject kv_BlockQueue_Type = {
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

int kv_block_queue_types_ready(void) {
    if (PyType_Ready(&BlockQueueIter_Type) < 0) return -1;
    return PyType_Ready(&kv_BlockQueue_Type);
}
