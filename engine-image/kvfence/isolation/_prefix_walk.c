/* The prefix cache's verified walk in C: what PrefixCache.lookup's fast path does per block, without
 * the interpreter between blocks (issue 16: the lookup within 1.2x of the chained-hash floor).
 *
 *   walk(index, raw, pos, end, block_bytes, key, matched, ctx, parent, fenced, blocks)
 *     -> (pos, key, matched, parent, candidate)
 *
 * From byte offset `pos`, for each whole block of `block_bytes` bytes of `raw` that ends at or before
 * `end`: key = SHA-256(key || block) (the digest hashlib gives, through OpenSSL's libcrypto, which
 * hashlib uses too; SHA-256's own functions, not EVP: in OpenSSL 3 EVP's per-digest set-up costs as
 * much as hashing a block, and BLAKE2b through EVP was slower than hashlib's, so BLAKE2b keeps the
 * Python walk); look the key
 * up in `index` (dict bytes -> KVBlock); take the block only if the fast path proves it is the block
 * asked for: its `context` is `ctx` (the interned context, by identity), its `parent` is `parent` (the
 * very handle object the previous block carries), its `tokens` equal the block's bytes, and its `state`
 * is not `fenced`. A taken block is appended to `blocks`; `matched` becomes its key and `parent` its
 * `cache_handle`.
 *
 * It returns at the end, at a key with no entry (candidate None), or at an entry the fast path cannot
 * take (the candidate, with `pos` and `key` of that block): the caller then runs the full verification
 * (PrefixCache.verify, which compares by value and counts collisions and cross-namespace refusals) and
 * either takes the block and calls walk again, or stops. Nothing here decides a refusal; nothing is
 * counted here. The GIL is held throughout (nothing here is shared between calls but interned names). */
#define PY_SSIZE_T_CLEAN
#define OPENSSL_SUPPRESS_DEPRECATED
/* The stable ABI of CPython 3.11 (setup.py builds with Py_LIMITED_API): one abi3 wheel for CPython 3.11
 * and every later release. Bytes are read through PyBytes_AsStringAndSize, never their layout. */
#ifndef Py_LIMITED_API
#error "_prefix_walk.c is built against the stable ABI: setup.py defines Py_LIMITED_API"
#endif
#include <Python.h>
#include <string.h>
#include <openssl/sha.h>

#ifndef Py_SETREF
#define Py_SETREF(dst, src)                                                                                  \
    do {                                                                                                     \
        PyObject *_old = (PyObject *)(dst);                                                                  \
        (dst) = (src);                                                                                       \
        Py_DECREF(_old);                                                                                     \
    } while (0)
#endif

static PyObject *s_context, *s_parent, *s_tokens, *s_state, *s_cache_handle;

/* 1: the fast path takes `cand`; 0: it does not; -1: error. */
static int
takes(PyObject *cand, PyObject *ctx, PyObject *parent, PyObject *fenced, const char *block, Py_ssize_t blen)
{
    int ok = 0;
    PyObject *c = NULL, *p = NULL, *t = NULL, *s = NULL;
    if (!(c = PyObject_GetAttr(cand, s_context)))
        goto error;
    if (c != ctx)
        goto done;
    if (!(p = PyObject_GetAttr(cand, s_parent)))
        goto error;
    if (p != parent)
        goto done;
    if (!(t = PyObject_GetAttr(cand, s_tokens)))
        goto error;
    if (!PyBytes_CheckExact(t))
        goto done;
    char *tbuf;
    Py_ssize_t tlen;
    if (PyBytes_AsStringAndSize(t, &tbuf, &tlen) < 0)
        goto error;
    if (tlen != blen || memcmp(tbuf, block, (size_t)blen) != 0)
        goto done;
    if (!(s = PyObject_GetAttr(cand, s_state)))
        goto error;
    ok = s != fenced;
done:
    Py_XDECREF(c);
    Py_XDECREF(p);
    Py_XDECREF(t);
    Py_XDECREF(s);
    return ok;
error:
    Py_XDECREF(c);
    Py_XDECREF(p);
    Py_XDECREF(t);
    Py_XDECREF(s);
    return -1;
}

static PyObject *
walk(PyObject *Py_UNUSED(self), PyObject *args)
{
    PyObject *index, *raw, *key, *matched, *ctx, *parent, *fenced, *blocks;
    Py_ssize_t pos, end, bb;
    if (!PyArg_ParseTuple(args, "O!O!nnnO!OOOOO!", &PyDict_Type, &index, &PyBytes_Type, &raw, &pos,
                          &end, &bb, &PyBytes_Type, &key, &matched, &ctx, &parent, &fenced, &PyList_Type,
                          &blocks))
        return NULL;
    char *data;
    Py_ssize_t raw_len;
    if (PyBytes_AsStringAndSize(raw, &data, &raw_len) < 0)
        return NULL;
    if (bb <= 0 || pos < 0 || end > raw_len) {
        PyErr_SetString(PyExc_ValueError, "block_bytes must be positive and [pos, end) inside raw");
        return NULL;
    }
    unsigned char out[SHA256_DIGEST_LENGTH];
    SHA256_CTX sha;
    PyObject *cand = Py_None;
    Py_INCREF(key);
    Py_INCREF(matched);
    Py_INCREF(parent);
    while (pos + bb <= end) {
        char *kbuf;
        Py_ssize_t klen;
        if (PyBytes_AsStringAndSize(key, &kbuf, &klen) < 0)
            goto error;
        if (!SHA256_Init(&sha) || !SHA256_Update(&sha, kbuf, (size_t)klen)
            || !SHA256_Update(&sha, data + pos, (size_t)bb) || !SHA256_Final(out, &sha)) {
            PyErr_SetString(PyExc_RuntimeError, "OpenSSL SHA-256 failed");
            goto error;
        }
        PyObject *next = PyBytes_FromStringAndSize((const char *)out, SHA256_DIGEST_LENGTH);
        if (!next)
            goto error;
        Py_SETREF(key, next);
        PyObject *found = PyDict_GetItemWithError(index, key); /* borrowed */
        if (!found) {
            if (PyErr_Occurred())
                goto error;
            break;
        }
        int ok = takes(found, ctx, parent, fenced, data + pos, bb);
        if (ok < 0)
            goto error;
        if (!ok) {
            cand = found;
            break;
        }
        if (PyList_Append(blocks, found) < 0)
            goto error;
        PyObject *handle = PyObject_GetAttr(found, s_cache_handle);
        if (!handle)
            goto error;
        Py_SETREF(parent, handle);
        Py_INCREF(key);
        Py_SETREF(matched, key);
        pos += bb;
    }
    PyObject *res = Py_BuildValue("nNNNO", pos, key, matched, parent, cand);
    return res;
error:
    Py_DECREF(key);
    Py_DECREF(matched);
    Py_DECREF(parent);
    return NULL;
}

static PyMethodDef methods[] = {
    {"walk", walk, METH_VARARGS, "The prefix cache's verified walk (see the module's source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_prefix_walk", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC
PyInit__prefix_walk(void)
{
    if (!(s_context = PyUnicode_InternFromString("context")) || !(s_parent = PyUnicode_InternFromString("parent"))
        || !(s_tokens = PyUnicode_InternFromString("tokens")) || !(s_state = PyUnicode_InternFromString("state"))
        || !(s_cache_handle = PyUnicode_InternFromString("cache_handle")))
        return NULL;
    return PyModule_Create(&module);
}
