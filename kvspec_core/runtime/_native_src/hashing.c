/* blake2b(data, digest_size) and chain_hashes: the prefix cache's chained block hashes
 * (PrefixHasher.hashes' loop). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "blake2b.h"
#include "kernels.h"
#include "records.h"

/* A non-negative int that fits one digit of CPython's int representation (every token id
 * of a real vocabulary): its value without a call. 0 for any other int. */
static inline int small_int(PyObject *item, unsigned long long *value) {
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)item)) {
        Py_ssize_t compact = PyUnstable_Long_CompactValue((PyLongObject *)item);
        if (compact >= 0) {
            *value = (unsigned long long)compact;
            return 1;
        }
    }
    return 0;
#else
    Py_ssize_t size = Py_SIZE(item);
    if (size == 0 || size == 1) {
        *value = size ? (unsigned long long)((PyLongObject *)item)->ob_digit[0] : 0;
        return 1;
    }
    return 0;
#endif
}

static inline void store_uint32_le(uint8_t *p, uint32_t value) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(p, &value, 4);
#else
    p[0] = (uint8_t)value;
    p[1] = (uint8_t)(value >> 8);
    p[2] = (uint8_t)(value >> 16);
    p[3] = (uint8_t)(value >> 24);
#endif
}

PyObject *kv_py_blake2b(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
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
    kv_blake2b_digest((const uint8_t *)data.buf, (size_t)data.len, out, (size_t)out_len);
    PyBuffer_Release(&data);
    return PyBytes_FromStringAndSize((const char *)out, out_len);
}

PyObject *kv_describe(PyObject *value) {
    if (value == Py_None || PyUnicode_CheckExact(value) || PyBytes_CheckExact(value)
        || PyLong_CheckExact(value) || PyByteArray_CheckExact(value))
        return PyObject_Repr(value);
    /* The type's __name__, as the Python twin names it (tp_name after its last dot: a static
     * type's tp_name holds its module too; read without calling any code). */
    const char *name = Py_TYPE(value)->tp_name, *dot = strrchr(name, '.');
    return PyUnicode_FromFormat("<a %s>", dot == NULL ? name : dot + 1);
}

/* The int value of a token that is not a small exact int, as struct.pack reads it (an int,
 * or anything with __index__, which may run any code): 0, or -1 (an exception set). */
static int token_value(PyObject *item, unsigned long long *value) {
    PyObject *index = PyNumber_Index(item);
    if (index == NULL) return -1;
    *value = PyLong_AsUnsignedLongLong(index);
    Py_DECREF(index);
    return *value == (unsigned long long)-1 && PyErr_Occurred() ? -1 : 0;
}

/* kv_chain_hashes(parent, tokens, start, stop, block_tokens, out), 0 or -1 with an
 * exception; chain_hashes(...) from Python: append to ``out`` the
 * chained digests of tokens[start:stop] in blocks of ``block_tokens``:
 * d_i = BLAKE2b(d_{i-1} || uint32-LE tokens of block i), d_{-1} = parent, digest size
 * len(parent). All tokens are checked before anything is appended: a token that is not an
 * int in [0, 2**32) raises ValueError naming its position, and ``out`` is unchanged. A token
 * that is no exact small int is read once (its __index__ may run code); if any was, the list
 * must afterwards still have its length and hold the very objects it held in [0, stop) (the
 * tokens hashed before ``start`` too: their digests chain into these), else ValueError
 * "token ids changed while they were hashed": the digests are always of the tokens the list
 * holds. */
int kv_chain_hashes(PyObject *parent, PyObject *tokens, Py_ssize_t start, Py_ssize_t stop,
                    Py_ssize_t size, PyObject *out, int *code_ran) {
    if (!PyBytes_Check(parent) || PyBytes_GET_SIZE(parent) < 1 || PyBytes_GET_SIZE(parent) > 64) {
        PyErr_SetString(PyExc_TypeError, "parent must be bytes of length 1..64");
        return -1;
    }
    if (!PyList_Check(tokens) || !PyList_Check(out)) {
        PyErr_SetString(PyExc_TypeError, "tokens and out must be lists");
        return -1;
    }
    if (size < 1 || start < 0 || stop < start || stop > PyList_GET_SIZE(tokens)
        || (stop - start) % size) {
        PyErr_SetString(PyExc_ValueError,
                        "need 0 <= start <= stop <= len(tokens), whole blocks of "
                        "block_tokens >= 1");
        return -1;
    }
    /* No block to hash: nothing is allocated, so a huge block_tokens cannot wrap the message
     * size below (with a block to hash, block_tokens <= len(tokens) bounds it). */
    if (stop == start) return 0;
    size_t digest = (size_t)PyBytes_GET_SIZE(parent);
    Py_ssize_t count = stop - start, length = PyList_GET_SIZE(tokens);
    size_t message_len = digest + 4 * (size_t)size;
    uint8_t *packed = PyMem_Malloc(4 * (size_t)count + 1);
    uint8_t *message = PyMem_Malloc(message_len);
    /* Once a token needed a call, every object of tokens[0:stop] (held), else NULL. */
    PyObject **read = NULL;
    int status = -1;
    Py_INCREF(parent); /* held: the code of a token may drop the caller's reference */
    if (packed == NULL || message == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (start + i >= PyList_GET_SIZE(tokens)) {
            /* An __index__ method below shortened the list. */
            PyErr_SetString(PyExc_ValueError, "token ids changed while they were hashed");
            goto done;
        }
        PyObject *item = PyList_GET_ITEM(tokens, start + i);
        unsigned long long value;
        if (read == NULL && PyLong_CheckExact(item) && small_int(item, &value)) {
            /* The common case: no call, so no Python code can touch the list. */
            store_uint32_le(packed + 4 * i, (uint32_t)value);
            continue;
        }
        if (read == NULL) {
            /* Code may run from here on: every object of tokens[0:stop] is held as it is now
             * (no code ran so far), to check the list afterwards. */
            read = PyMem_Calloc((size_t)stop, sizeof(PyObject *));
            if (read == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            for (Py_ssize_t j = 0; j < stop; j++) {
                read[j] = PyList_GET_ITEM(tokens, j);
                Py_INCREF(read[j]);
            }
        }
        item = read[start + i]; /* the object as it was before any code ran */
        int bad;
        if (PyLong_CheckExact(item) && small_int(item, &value)) {
            bad = 0;
        } else {
            bad = token_value(item, &value) < 0;
        }
        if (bad || value > 0xFFFFFFFFULL) {
            PyErr_Clear();
            PyObject *described = kv_describe(item);
            if (described != NULL)
                PyErr_Format(PyExc_ValueError, "token %zd is %U, not an int in [0, 2**32)",
                             start + i, described);
            Py_XDECREF(described);
            goto done;
        }
        store_uint32_le(packed + 4 * i, (uint32_t)value);
    }
    if (read != NULL) {
        /* Code ran: the list must still hold what was read. */
        int same = PyList_GET_SIZE(tokens) == length;
        for (Py_ssize_t i = 0; same && i < stop; i++)
            same = PyList_GET_ITEM(tokens, i) == read[i];
        if (!same) {
            PyErr_SetString(PyExc_ValueError, "token ids changed while they were hashed");
            goto done;
        }
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
        if (item == NULL) goto done;
        uint8_t *digest_out = (uint8_t *)PyBytes_AS_STRING(item);
        uint8_t *input = one_block ? block : message; /* parent digest, then the tokens */
        memcpy(input + digest, packed + 4 * offset, 4 * (size_t)size);
        if (one_block)
            kv_blake2b_one_block(block, message_len, digest_out, digest);
        else
            kv_blake2b_digest(message, message_len, digest_out, digest);
        int appended = PyList_Append(out, item);
        Py_DECREF(item);
        if (appended < 0) goto done;
        memcpy(input, digest_out, digest); /* the next block's parent */
    }
    status = 0;
    if (code_ran != NULL) *code_ran = read != NULL;
done:
    if (read != NULL) {
        for (Py_ssize_t i = 0; i < stop; i++) Py_XDECREF(read[i]);
        PyMem_Free(read);
    }
    Py_DECREF(parent);
    PyMem_Free(packed);
    PyMem_Free(message);
    return status;
}

PyObject *kv_py_chain_hashes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "chain_hashes(parent, tokens, start, stop, block_tokens, out)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[2]);
    Py_ssize_t stop = PyLong_AsSsize_t(args[3]);
    Py_ssize_t size = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (kv_chain_hashes(args[0], args[1], start, stop, size, args[5], NULL) < 0) return NULL;
    Py_RETURN_NONE;
}

/* kvspec_core.errors.AllocatorError (imported once), or NULL with an exception. */
static PyObject *allocator_error(void) {
    static PyObject *error;
    if (error == NULL) {
        PyObject *module = PyImport_ImportModule("kvspec_core.errors");
        if (module == NULL) return NULL;
        error = PyObject_GetAttrString(module, "AllocatorError");
        Py_DECREF(module);
    }
    return error;
}

/* Raise the hasher's AllocatorError for tokens [start, stop) of ``request`` (worded as
 * hashing.py's _bad_tokens), ``detail`` the reason; -1. */
static int refuse_tokens(PyObject *request, Py_ssize_t start, Py_ssize_t stop,
                         PyObject *detail) {
    PyObject *error = allocator_error();
    PyObject *rid = record_get(request, kv_request_offsets[REQUEST_ID]);
    PyObject *described = error == NULL ? NULL : kv_describe(rid == NULL ? Py_None : rid);
    if (described != NULL)
        PyErr_Format(error, "request %U: token ids in [%zd, %zd) must be ints in [0, 2**32) "
                     "to be hashed: %S", described, start, stop, detail);
    Py_XDECREF(described);
    return -1;
}

/* Whether a cache salt / LoRA name is of a type the root is made of without running code of
 * the caller's (hashing.py's _root_key refuses the others). */
static int plain_salts(PyObject *request) {
    PyObject *salt = record_get(request, kv_request_offsets[REQUEST_CACHE_SALT]);
    PyObject *lora = record_get(request, kv_request_offsets[REQUEST_LORA_NAME]);
    return salt != NULL && lora != NULL
        && (salt == Py_None || PyUnicode_CheckExact(salt) || PyBytes_CheckExact(salt)
            || PyByteArray_CheckExact(salt))
        && (lora == Py_None || PyUnicode_CheckExact(lora));
}

int kv_hash_request(PyObject *hasher, PyObject *request, Py_ssize_t upto, Py_ssize_t tokens,
                    PyObject **hashes_out) {
    const Py_ssize_t *fields = kv_request_offsets;
    if (Py_TYPE(request) != kv_request_type) return 1;
    PyObject *mm_inputs = record_get(request, fields[REQUEST_MM_INPUTS]);
    PyObject *hashes = record_get(request, fields[REQUEST_BLOCK_HASHES]);
    PyObject *token_ids = record_get(request, fields[REQUEST_TOKEN_IDS]);
    if (mm_inputs == NULL || !PyTuple_CheckExact(mm_inputs) || PyTuple_GET_SIZE(mm_inputs) != 0
        || hashes == NULL || !PyList_CheckExact(hashes) || token_ids == NULL
        || !PyList_CheckExact(token_ids) || tokens < 1 || !plain_salts(request))
        return 1;
    if (record_get(request, fields[REQUEST_HASH_OWNER]) != hasher) {
        /* Hashes made by another hasher (another salt) are meaningless here. Releasing
         * them and the old owner may run code (a __del__): the lists are held meanwhile and
         * must still be the request's afterwards. */
        Py_INCREF(hashes);
        Py_INCREF(token_ids);
        int failed = PyList_SetSlice(hashes, 0, PyList_GET_SIZE(hashes), NULL) < 0;
        if (!failed) {
            Py_INCREF(hasher);
            record_set(request, fields[REQUEST_HASH_OWNER], hasher);
        }
        int changed = record_get(request, fields[REQUEST_BLOCK_HASHES]) != hashes
            || record_get(request, fields[REQUEST_TOKEN_IDS]) != token_ids;
        Py_DECREF(token_ids);
        Py_DECREF(hashes);
        if (failed) return -1;
        if (changed) return 1;
    }
    Py_ssize_t available = PyList_GET_SIZE(token_ids);
    Py_ssize_t done = PyList_GET_SIZE(hashes);
    Py_ssize_t target = (upto < available ? upto : available) / tokens;
    if (target > done) {
        /* Held, and the request checked to still own them after every call that may run
         * Python code (PrefixHasher.root, a token's __index__). */
        Py_INCREF(hashes);
        Py_INCREF(token_ids);
        int status = 0, code_ran = 0;
        PyObject *parent = done ? PyList_GET_ITEM(hashes, done - 1) : NULL;
        if (parent != NULL) {
            Py_INCREF(parent);
        } else if ((parent = PyObject_CallMethod(hasher, "root", "O", request)) == NULL) {
            PyErr_Clear(); /* the method raises it again, as its own error */
            status = 1;
        }
        if (status == 0
            && (record_get(request, fields[REQUEST_BLOCK_HASHES]) != hashes
                || record_get(request, fields[REQUEST_TOKEN_IDS]) != token_ids
                || record_get(request, fields[REQUEST_HASH_OWNER]) != hasher
                || PyList_GET_SIZE(hashes) != done || PyList_GET_SIZE(token_ids) != available))
            status = 1; /* the request changed under root(): the method's */
        if (status == 0
            && kv_chain_hashes(parent, token_ids, done * tokens, target * tokens, tokens,
                               hashes, &code_ran) < 0) {
            /* A token that cannot be hashed (nothing was appended): the method's error. */
            if (PyErr_ExceptionMatches(PyExc_ValueError)) {
                PyObject *type, *value, *traceback;
                PyErr_Fetch(&type, &value, &traceback);
                refuse_tokens(request, done * tokens, target * tokens,
                              value == NULL ? Py_None : value);
                Py_XDECREF(type);
                Py_XDECREF(value);
                Py_XDECREF(traceback);
            }
            status = -1;
        }
        if (status == 0
            && (record_get(request, fields[REQUEST_BLOCK_HASHES]) != hashes
                || record_get(request, fields[REQUEST_HASH_OWNER]) != hasher)) {
            /* A token's code replaced the request's hash list (hashing.py's
             * _check_unchanged). */
            PyObject *detail = PyUnicode_FromString("token ids changed while they were hashed");
            if (detail != NULL) refuse_tokens(request, done * tokens, target * tokens, detail);
            Py_XDECREF(detail);
            status = -1;
        }
        if (status == 0 && code_ran) status = 1; /* hashed; the caller re-plans as Python */
        Py_XDECREF(parent);
        Py_DECREF(token_ids);
        Py_DECREF(hashes);
        if (status != 0) return status;
    }
    *hashes_out = hashes;
    return 0;
}
