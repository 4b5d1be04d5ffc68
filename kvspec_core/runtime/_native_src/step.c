/* The allocator's per-step kernels: allocate_step's loop (step) and SlotsFastPath, the
 * compiled allocate_slots of an allocator built with the kernels. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <stddef.h>

#include "kernels.h"
#include "records.h"

/* A lookahead (an int >= 0, checked by the method's caller) as a C size: one too large for
 * it counts as PY_SSIZE_T_MAX / 4 (every step then reaches max_model_len, as the method's
 * ``min(known + lookahead, max_model_len)``); -1 with an exception if it is no int. */
static int lookahead_size(PyObject *object, Py_ssize_t *value) {
    *value = PyLong_AsSsize_t(object);
    if (*value == -1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError) || _PyLong_Sign(object) < 0) return -1;
        PyErr_Clear();
        *value = PY_SSIZE_T_MAX / 4;
    }
    return 0;
}

/* Field ``index`` of a state as an int; -1 with an exception if unset or not an int. */
static inline int state_int(PyObject *state, int index, Py_ssize_t *value) {
    PyObject *item;
    if (Py_TYPE(state) == kv_state_type) {
        item = record_get(state, kv_state_offsets[index]);
        if (item == NULL) {
            PyErr_SetObject(PyExc_AttributeError, kv_state_names[index]);
            return -1;
        }
        Py_INCREF(item);
    } else {
        static PyObject **names[4] = {&kv_str_computed, &kv_str_end_limit, &kv_str_known_limit,
                                      &kv_str_computed_limit};
        item = PyObject_GetAttr(state, *names[index]);
        if (item == NULL) return -1;
    }
    *value = PyLong_AsSsize_t(item);
    Py_DECREF(item);
    return (*value == -1 && PyErr_Occurred()) ? -1 : 0;
}

static inline int set_state_computed(PyObject *state, PyObject *value) {
    if (Py_TYPE(state) == kv_state_type) {
        Py_INCREF(value);
        record_set(state, kv_state_offsets[STATE_COMPUTED], value);
        return 0;
    }
    return PyObject_SetAttr(state, kv_str_computed, value);
}

/* allocate_slots' first test for a running request's state: 1: the step of ``count`` tokens
 * needs no new block, caches and frees nothing, and they were counted as computed; 2: it
 * needs the general path; -1: an error. */
static inline int fast_state(PyObject *state, Py_ssize_t count, Py_ssize_t lookahead) {
    Py_ssize_t computed, end_limit, known_limit, computed_limit;
    if (state_int(state, 0, &computed) < 0 || state_int(state, 1, &end_limit) < 0
        || state_int(state, 2, &known_limit) < 0 || state_int(state, 3, &computed_limit) < 0)
        return -1;
    /* Counts this large (past any max_model_len) would overflow the sums: the method's. */
    if (count > PY_SSIZE_T_MAX / 4 || lookahead > PY_SSIZE_T_MAX / 4
        || computed > PY_SSIZE_T_MAX / 4)
        return 2;
    Py_ssize_t known = computed + count;
    if (known + lookahead < end_limit && known < known_limit && computed < computed_limit) {
        PyObject *value = PyLong_FromSsize_t(known);
        int failed = value == NULL || set_state_computed(state, value) < 0;
        Py_XDECREF(value);
        return failed ? -1 : 1;
    }
    return 2;
}

/* allocate_slots(request, count_object, lookahead)'s first test, for a running request:
 * 1: the step needs no new block, caches and frees nothing, and its tokens were counted as
 * computed (the answer is no_new_blocks); 2: a running or new request whose step needs the
 * general path; 0: not an exact int count >= 0 or no hashable request_id (the general path
 * says what is wrong); -1: an error. With ``state_out``, a 2 for a running request also
 * gives its state (a new reference) and the count. */
static int fast_step(PyObject *running, PyObject *request, PyObject *count_object,
                     Py_ssize_t lookahead, PyObject **state_out, Py_ssize_t *count_out) {
    if (!PyLong_CheckExact(count_object)) return 0;
    Py_ssize_t count = PyLong_AsSsize_t(count_object);
    if (count == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (count < 0) return 0;
    PyObject *rid;
    if (Py_TYPE(request) == kv_request_type
        && (rid = record_get(request, kv_request_offsets[REQUEST_ID])) != NULL) {
        Py_INCREF(rid);
    } else if ((rid = PyObject_GetAttr(request, kv_str_request_id)) == NULL) {
        PyErr_Clear();
        return 0;
    }
    if (!kv_is_request_id(rid)) {
        /* Another id could run code in the lookup: the general path refuses it. */
        Py_DECREF(rid);
        return 0;
    }
    PyObject *state = PyDict_GetItemWithError(running, rid);
    Py_XINCREF(state); /* before the id is released (its release could run code) */
    Py_DECREF(rid);
    if (state == NULL) {
        if (!PyErr_Occurred()) return 2; /* not running yet: an admission */
        PyErr_Clear();
        return 0;
    }
    int result = fast_state(state, count, lookahead);
    if (result == 2 && state_out != NULL) {
        *state_out = state;
        *count_out = count;
        return result;
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
PyObject *kv_py_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "step takes 7 arguments");
        return NULL;
    }
    PyObject *running = args[1], *no_new_blocks = args[3], *allocate_slots = args[4],
             *one_pair = args[5], *results = args[6];
    Py_ssize_t lookahead;
    if (lookahead_size(args[2], &lookahead) < 0) return NULL;
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
        } else if (kv_request_type != NULL && PyObject_TypeCheck(pair, kv_request_type)) {
            request = pair;
            count_object = kv_one;
        }
        if (request != NULL) {
            int fast = fast_step(running, request, count_object, lookahead, NULL, NULL);
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

/* Remove ``token`` from the end of ``list`` where it still is, keeping the exception being
 * raised: the step that appended it was refused. */
static void take_back(PyObject *list, PyObject *token) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    Py_ssize_t length = PySequence_Size(list);
    PyObject *last = length > 0 ? PySequence_GetItem(list, length - 1) : NULL;
    if (last == token) PySequence_DelItem(list, length - 1);
    Py_XDECREF(last);
    PyErr_Clear();
    PyErr_Restore(type, value, traceback);
}

/* decode_step(request_ids, tokens, running, lookahead, no_new_blocks, allocate_slots,
 * results) -> int: for each position i of the two lists (or tuples) of one length, append
 * tokens[i] to the token_ids of running request request_ids[i] and append to ``results``
 * what allocate_slots(request, 1, lookahead) answers (no_new_blocks without a call when the
 * step needs no block, as allocate_slots' first test); when allocate_slots raises, the
 * token is taken back off the list and the error propagates. Returns -1 when every request was
 * stepped, else the position of the first id that names no running request (nothing was
 * done for it and those after it). KVCacheAllocator.decode_step's loop. */
PyObject *kv_py_decode_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "decode_step takes 7 arguments");
        return NULL;
    }
    PyObject *ids = args[0], *tokens = args[1], *running = args[2], *no_new_blocks = args[4],
             *allocate_slots = args[5], *results = args[6];
    Py_ssize_t lookahead;
    if (lookahead_size(args[3], &lookahead) < 0) return NULL;
    if (!(PyList_CheckExact(ids) || PyTuple_CheckExact(ids))
        || !(PyList_CheckExact(tokens) || PyTuple_CheckExact(tokens))
        || PySequence_Fast_GET_SIZE(ids) != PySequence_Fast_GET_SIZE(tokens)
        || !PyDict_Check(running) || !PyList_Check(results) || kv_state_type == NULL) {
        PyErr_SetString(PyExc_TypeError,
                        "decode_step: request_ids and tokens must be lists or tuples of one "
                        "length, running a dict, results a list, the records registered");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(ids); i++) {
        /* The lists may change under calls below: re-read them each time. */
        if (i >= PySequence_Fast_GET_SIZE(ids) || i >= PySequence_Fast_GET_SIZE(tokens)) {
            PyErr_SetString(PyExc_RuntimeError, "decode_step: the lists changed size");
            return NULL;
        }
        PyObject *rid = PySequence_Fast_GET_ITEM(ids, i);
        /* Only an exact str or int names a running request (looking one up runs no code). */
        PyObject *state = kv_is_request_id(rid) ? PyDict_GetItemWithError(running, rid) : NULL;
        if (state == NULL) {
            PyErr_Clear();
            return PyLong_FromSsize_t(i);
        }
        Py_INCREF(state);
        PyObject *request = Py_TYPE(state) == kv_state_type
            ? record_get(state, kv_state_offsets[STATE_REQUEST]) : NULL;
        if (request == NULL) {
            Py_DECREF(state);
            PyErr_SetString(PyExc_TypeError, "decode_step: running states must be registered");
            return NULL;
        }
        Py_INCREF(request);
        PyObject *token_ids = Py_TYPE(request) == kv_request_type
            ? record_get(request, kv_request_offsets[REQUEST_TOKEN_IDS]) : NULL;
        PyObject *token = PySequence_Fast_GET_ITEM(tokens, i);
        int fast;
        PyObject *list; /* held: the list the token went to */
        Py_INCREF(token);
        if (token_ids != NULL && PyList_CheckExact(token_ids)) {
            /* Appending to a list runs no Python code: the state stays this request's. */
            Py_INCREF(token_ids);
            list = token_ids;
            fast = PyList_Append(token_ids, token) < 0 ? -1 : fast_state(state, 1, lookahead);
        } else {
            /* A Request subclass: append as Python does, then the method's first test. */
            list = PyObject_GetAttrString(request, "token_ids");
            PyObject *done = list == NULL ? NULL : PyObject_CallMethod(list, "append", "O", token);
            Py_XDECREF(done);
            fast = done == NULL ? -1 : 2;
        }
        Py_DECREF(state);
        PyObject *result = NULL;
        if (fast == 1) {
            Py_INCREF(no_new_blocks);
            result = no_new_blocks;
        } else if (fast == 2) {
            PyObject *call[3] = {request, kv_one, args[3]};
            result = PyObject_Vectorcall(allocate_slots, call, 3, NULL);
            if (result == NULL) take_back(list, token); /* refused: nothing changes */
        }
        Py_XDECREF(list);
        Py_DECREF(token);
        Py_DECREF(request);
        if (result == NULL) return NULL;
        int failed = PyList_Append(results, result);
        Py_DECREF(result);
        if (failed < 0) return NULL;
    }
    return PyLong_FromLong(-1);
}

/* SlotsFastPath(running, no_new_blocks, general, dense=None, groups=None, admit=None): a
 * callable taking allocate_slots' arguments. A call (request, n[, lookahead]) with exact ints
 * n, lookahead >= 0, for a running request whose step needs no new block, caches nothing and
 * frees nothing (as allocate_slots' first test) counts the tokens as computed and returns
 * no_new_blocks, with no Python frame. With ``dense`` (an allocator of one full-attention
 * group, see grow.c), such a call that crosses a block boundary is done by kv_dense_grow
 * when it can; with ``groups`` (groups of the core's parametric rule shapes, see
 * group_step.c), by kv_groups_grow. With ``admit`` (such groups, the allocator's freed ids
 * and pools, see admit.c), the admission of a request (prefix= given or not) is done by
 * kv_admit when it can. Every other call is general(*args, **kwargs). An allocator built
 * with the kernels holds one as its allocate_slots. */

typedef struct {
    PyObject_HEAD
    PyObject *running;
    PyObject *no_new_blocks;
    PyObject *general;
    PyObject *dense; /* the config tuple, or None */
    DenseConfig dense_config;
    PyObject *groups; /* the config tuple, or None */
    GroupsConfig groups_config;
    PyObject *admit; /* the config tuple, or None */
    AdmitConfig admit_config;
    vectorcallfunc vectorcall;
} SlotsFastPath;


/* allocate_slots' arguments (request, num_new_tokens[, lookahead[, prefix]]), lookahead and
 * prefix also by keyword: 1 with ``*lookahead`` (an exact int >= 0) and ``*prefix`` (None
 * if not given) set, 0 for any other call (the general path says what is wrong). */
static int slots_arguments(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                           Py_ssize_t *lookahead, PyObject **prefix) {
    Py_ssize_t num_keywords = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    if (nargs < 2 || nargs + num_keywords > 4) return 0;
    PyObject *lookahead_object = nargs >= 3 ? args[2] : NULL;
    *prefix = nargs == 4 ? args[3] : Py_None;
    for (Py_ssize_t i = 0; i < num_keywords; i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i);
        if (nargs < 3 && lookahead_object == NULL
            && PyUnicode_CompareWithASCIIString(name, "lookahead") == 0)
            lookahead_object = args[nargs + i];
        else if (nargs < 4 && PyUnicode_CompareWithASCIIString(name, "prefix") == 0)
            *prefix = args[nargs + i];
        else
            return 0;
    }
    *lookahead = 0;
    if (lookahead_object != NULL) {
        if (!PyLong_CheckExact(lookahead_object)) return 0;
        *lookahead = PyLong_AsSsize_t(lookahead_object);
        if (*lookahead == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
    }
    return *lookahead >= 0;
}

/* 1: ``request`` is a registered Request whose id (an exact str or int: looking it up runs
 * no code) names no running request, and ``count_object`` an exact int >= 0 (stored in
 * ``*count``); 0 otherwise. */
static int admissible(PyObject *running, PyObject *request, PyObject *count_object,
                      Py_ssize_t *count) {
    if (Py_TYPE(request) != kv_request_type || !PyLong_CheckExact(count_object)) return 0;
    PyObject *rid = record_get(request, kv_request_offsets[REQUEST_ID]);
    if (!kv_is_request_id(rid)) return 0;
    *count = PyLong_AsSsize_t(count_object);
    int known = *count == -1 && PyErr_Occurred() ? -1 : PyDict_Contains(running, rid);
    if (known < 0) {
        PyErr_Clear();
        return 0;
    }
    return !known && *count >= 0;
}

static PyObject *SlotsFastPath_vectorcall(PyObject *callable, PyObject *const *args,
                                          size_t nargsf, PyObject *kwnames) {
    SlotsFastPath *self = (SlotsFastPath *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf), lookahead, count = 0;
    PyObject *prefix;
    if (self->running != NULL && slots_arguments(args, nargs, kwnames, &lookahead, &prefix)) {
        int dense = self->dense != NULL && self->dense != Py_None;
        int compiled = dense || (self->groups != NULL && self->groups != Py_None);
        int admit = self->admit != NULL && self->admit != Py_None;
        PyObject *result = NULL;
        if (prefix == Py_None) {
            PyObject *state = NULL;
            int fast = fast_step(self->running, args[0], args[1], lookahead,
                                 compiled ? &state : NULL, &count);
            if (fast < 0) return NULL;
            if (fast == 1) {
                Py_INCREF(self->no_new_blocks);
                return self->no_new_blocks;
            }
            if (state != NULL) {
                /* The running request's own record, as the method steps state.request (a
                 * Request object passed with a running request's id is not hashed or
                 * cached in its place). */
                PyObject *own = Py_TYPE(state) == kv_state_type
                    ? record_get(state, kv_state_offsets[STATE_REQUEST]) : NULL;
                if (own != NULL) {
                    Py_INCREF(own);
                    result = dense
                        ? kv_dense_grow(&self->dense_config, state, own, count, lookahead,
                                        self->no_new_blocks)
                        : kv_groups_grow(&self->groups_config, state, own, count, lookahead,
                                         self->no_new_blocks);
                    Py_DECREF(own);
                }
                Py_DECREF(state);
            } else if (fast == 2 && admit
                       && admissible(self->running, args[0], args[1], &count)) {
                result = kv_admit(&self->admit_config, self->running, args[0], count,
                                  lookahead, Py_None);
            }
        } else if (admit && admissible(self->running, args[0], args[1], &count)) {
            result = kv_admit(&self->admit_config, self->running, args[0], count, lookahead,
                              prefix);
        }
        if (result != NULL || PyErr_Occurred()) return result;
    }
    if (self->general == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "SlotsFastPath was cleared");
        return NULL;
    }
    return PyObject_Vectorcall(self->general, args, nargsf, kwnames);
}

static PyObject *SlotsFastPath_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *running, *no_new_blocks, *general, *dense = Py_None, *groups = Py_None,
             *admit = Py_None;
    static char *names[] = {"running", "no_new_blocks", "general", "dense", "groups", "admit",
                            NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!OO|OOO", names, &PyDict_Type, &running,
                                     &no_new_blocks, &general, &dense, &groups, &admit))
        return NULL;
    if (dense != Py_None && groups != Py_None) {
        PyErr_SetString(PyExc_TypeError, "SlotsFastPath: dense or groups, not both");
        return NULL;
    }
    if (!PyCallable_Check(general)) {
        PyErr_SetString(PyExc_TypeError, "SlotsFastPath: general must be callable");
        return NULL;
    }
    DenseConfig config = {0};
    if (dense != Py_None && kv_dense_config(dense, &config) < 0) return NULL;
    GroupsConfig groups_config = {0};
    if (groups != Py_None && kv_groups_config(groups, &groups_config) < 0) return NULL;
    AdmitConfig admit_config = {0};
    if (admit != Py_None && kv_admit_config(admit, &admit_config) < 0) return NULL;
    SlotsFastPath *self = (SlotsFastPath *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    Py_INCREF(running);
    Py_INCREF(no_new_blocks);
    Py_INCREF(general);
    Py_INCREF(dense);
    self->running = running;
    self->no_new_blocks = no_new_blocks;
    self->general = general;
    self->dense = dense; /* keeps the config's borrowed references alive */
    self->dense_config = config;
    Py_INCREF(groups);
    self->groups = groups; /* as dense */
    self->groups_config = groups_config;
    Py_INCREF(admit);
    self->admit = admit; /* as dense */
    self->admit_config = admit_config;
    self->vectorcall = SlotsFastPath_vectorcall;
    return (PyObject *)self;
}

static int SlotsFastPath_traverse(SlotsFastPath *self, visitproc visit, void *arg) {
    Py_VISIT(self->running);
    Py_VISIT(self->no_new_blocks);
    Py_VISIT(self->general);
    Py_VISIT(self->dense);
    Py_VISIT(self->groups);
    Py_VISIT(self->admit);
    return 0;
}

static int SlotsFastPath_clear(SlotsFastPath *self) {
    Py_CLEAR(self->running);
    Py_CLEAR(self->no_new_blocks);
    Py_CLEAR(self->general);
    /* The config's borrowed references die with the tuple: no dense steps after a clear. */
    Py_CLEAR(self->dense);
    Py_CLEAR(self->groups);
    Py_CLEAR(self->admit);
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

/* Copies and pickles rebuild it from what it refers to (a deep copy of an allocator gets a
 * fast path over the copy's own running requests). */
static PyObject *SlotsFastPath_reduce(SlotsFastPath *self, PyObject *unused) {
    return Py_BuildValue("O(OOOOOO)", (PyObject *)Py_TYPE(self), self->running,
                         self->no_new_blocks, self->general,
                         self->dense != NULL ? self->dense : Py_None,
                         self->groups != NULL ? self->groups : Py_None,
                         self->admit != NULL ? self->admit : Py_None);
}

static PyMethodDef SlotsFastPath_methods[] = {
    {"__reduce__", (PyCFunction)SlotsFastPath_reduce, METH_NOARGS, "copy and pickle support"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef SlotsFastPath_getset[] = {
    {"__doc__", (getter)SlotsFastPath_get_doc, NULL, "the general path's docstring", NULL},
    {"__wrapped__", (getter)SlotsFastPath_get_wrapped, NULL, "the general path", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject kv_SlotsFastPath_Type = {
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
    .tp_methods = SlotsFastPath_methods,
    .tp_new = SlotsFastPath_new,
};
