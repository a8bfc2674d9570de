/* The vLLM fence's prefix-cache records in C (kvfence.vllm.records holds the pure-Python equivalent and
 * says when each is used).
 *
 *   Record(parent, tokens, start, stop, namespace, root=False)
 *       what a cached block holds: tokens[start:stop] of a request's token list packed as native
 *       int32 bytes (stop clamped to the list, as slicing does), the record of the block before it
 *       (a Record or None), the cache namespace (roots) or extra keys (None for plain text), and
 *       whether the request's namespace enters the chain here (always when parent is None).
 *       Read-only attributes: parent, tokens, namespace, root.
 *       ``tokens`` may also be bytes from pack(): then start and stop count tokens in it and the
 *       record copies them (no int object is read).
 *   equal(packed, tokens, start) -> bool
 *       whether a record's packed tokens are exactly tokens[start:start + n] of a token list.
 *   pack(tokens) -> bytes
 *       a whole token list packed as a record packs it (the scheduler packs each prompt once, when
 *       the request arrives and its token ids were just read by vLLM's block hasher).
 *   verify_chain(records, block_ids, tokens, packed, namespace, block_size) -> int
 *       how many leading blocks of a prefix hit verify by the plain-text rule (TenantFence.verify's
 *       fast path): block i's record holds tokens[i*block_size:(i+1)*block_size]; block 0's is a
 *       root without parent whose namespace == namespace; every later one has no namespace and the
 *       previous block's record, the very object, as parent. ``packed`` (bytes from pack(), or None)
 *       holds the first tokens of ``tokens``: where it reaches, blocks compare with memcmp.
 *   record_chain(records, blocks, start, stop, parent, tokens, packed, block_size, root, namespace)
 *       the records of vLLM blocks[start:stop] a request just filled, in one call (the scheduler's
 *       cache_full_blocks for plain text; kvfence.vllm.records.py_record_chain is the same loop in
 *       Python): see records_record_chain below.
 *   slot_tokens() -> int
 *       the token count of the records that come from cache-line slots (see slot_take below).
 *
 * Why (docs/engine.md, "What the plugin costs inside vLLM"): vLLM's scheduler thread runs Python's
 * cyclic garbage collector every 700 net allocations of container objects, and each young collection
 * walks the token lists of the requests that arrived since the last one. A record is created for every
 * block vLLM caches, so records as Python objects (and their token lists) made the fenced scheduler
 * collect about twice as often as vLLM alone. This Record is not a container the collector knows
 * about: records form a tree (a parent always exists before its children, and nothing is ever
 * reassigned), so no cycle can pass through one, and the objects a record refers to (its namespace
 * tuple) stay tracked on their own. Packed tokens also keep none of the request's int objects alive,
 * and equal() reads each token once, copying and writing nothing.
 *
 * Token ids are Python ints; anything else, or an int outside int32, raises (TypeError,
 * OverflowError) rather than compare unequal: a token list that is not one is a bug, never a miss. */
#define PY_SSIZE_T_CLEAN
/* The stable ABI of CPython 3.11 (setup.py builds with Py_LIMITED_API): one abi3 wheel loads in CPython
 * 3.11 and every later release, so the GPU vLLM image, whose Python is vLLM's, runs this module, and the
 * build benchmarked and tested on CPU is the very one it ships. Nothing below reaches into an object's
 * layout: list items and int values are read through the API's functions, and Record is a heap type. */
#ifndef Py_LIMITED_API
#error "_records.c is built against the stable ABI: setup.py defines Py_LIMITED_API"
#endif
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef Py_SETREF
#define Py_SETREF(dst, src)                                                                                  \
    do {                                                                                                     \
        PyObject *_old = (PyObject *)(dst);                                                                  \
        (dst) = (src);                                                                                       \
        Py_DECREF(_old);                                                                                     \
    } while (0)
#endif

/* Token ids are stored as int32, vLLM's own type for them (its input batch holds them in int32 arrays,
 * and its input processor refuses ids outside the vocabulary before the scheduler sees them): a record
 * of 16 tokens is then 40 bytes of header and one cache line of tokens (104 bytes, 176 as int64), and
 * a packed prompt half the size. Verifying a hit reads the records of every block it reuses, long out
 * of the CPU's caches, so each line saved is a miss saved. */
typedef int32_t token_t;

/* The tokens live in the record itself (one allocation, not a record and a bytes object), and records
 * come from slots of their own (see slot_take) or the C heap, not from CPython's small-object pools,
 * where vLLM's own short-lived objects live: a record lives as long as its block stays cached. Timed,
 * recording cost the plugin about two points, many times what callgrind counts for it; this layout
 * took part of that off (docs/engine.md, "What the plugin costs inside vLLM"). */
typedef struct {
    PyObject_HEAD
    PyObject *parent;    /* Record or None */
    PyObject *namespace; /* anything, None for plain text */
    int32_t ntokens;
    char root;
    char slotted;        /* from the slabs below, not malloc */
    token_t tokens[];    /* ntokens token ids */
} RecordObject;

static PyTypeObject *RecordType; /* a heap type, made by PyInit__records */

/* The records of full blocks (all but a few made by hand) come from slabs of their own: slots of one
 * size, each starting on a cache line (a record of 16 tokens is then exactly two lines, where malloc's
 * 16-byte alignment often puts it across three), taken and given back through a free list. Records
 * live as long as their blocks stay cached and are freed in the order blocks are evicted: from malloc
 * (PyMem_RawMalloc is outside the stable ABI before 3.13) they were scattered through the heap vLLM's
 * own lists grow in, and under callgrind the fenced scheduler's list reallocations copied more than
 * stock vLLM's (bench/results/engine.jsonl). Slab memory is never returned: it peaks with the number
 * of cached blocks, which the pool bounds. The size is the block size of the first record_chain call
 * (one engine, one block size); records of other sizes come from malloc. */
#define SLOT_ALIGN 64
#define SLAB_SLOTS 256
static Py_ssize_t slab_ntokens = -1;
static size_t slot_size;
static void *free_slot; /* each free slot's first word points to the next */

static void
slab_size_for(Py_ssize_t ntokens)
{
    if (slab_ntokens >= 0 || ntokens <= 0 || ntokens > 65536)
        return;
    size_t need = sizeof(RecordObject) + (size_t)ntokens * sizeof(token_t);
    slot_size = (need + SLOT_ALIGN - 1) / SLOT_ALIGN * SLOT_ALIGN;
    slab_ntokens = ntokens;
}

static RecordObject *
slot_take(void)
{
    if (free_slot == NULL) {
        char *slab = aligned_alloc(SLOT_ALIGN, SLAB_SLOTS * slot_size);
        if (slab == NULL)
            return NULL;
        for (Py_ssize_t k = SLAB_SLOTS - 1; k >= 0; k--) {
            void *slot = slab + (size_t)k * slot_size;
            *(void **)slot = free_slot;
            free_slot = slot;
        }
    }
    void *slot = free_slot;
    free_slot = *(void **)slot;
    return (RecordObject *)slot;
}

static void
slot_give(RecordObject *r)
{
    *(void **)r = free_slot;
    free_slot = r;
}

/* One token id as int32; -1 with an exception set on error. Token ids are exact ints (a pointer
 * comparison), their value read with one call; an int subclass takes the same path, anything else is a
 * TypeError (never its __index__: a token list that holds other objects is a bug). The caller has
 * checked that i is inside the list. */
static inline int
token_at(PyObject *list, Py_ssize_t i, token_t *out)
{
    PyObject *o = PyList_GetItem(list, i); /* borrowed */
    if (o == NULL)
        return -1;
    if (!PyLong_CheckExact(o) && !PyLong_Check(o)) {
        PyObject *name = PyType_GetName(Py_TYPE(o));
        if (name != NULL) {
            PyErr_Format(PyExc_TypeError, "token %zd is %U, not an int", i, name);
            Py_DECREF(name);
        }
        return -1;
    }
    int overflow = 0;
    long v = PyLong_AsLongAndOverflow(o, &overflow);
    if (v == -1 && !overflow && PyErr_Occurred())
        return -1;
    if (overflow || v < INT32_MIN || v > INT32_MAX) {
        PyErr_Format(PyExc_OverflowError, "token %zd is outside int32 (vLLM's token id type)", i);
        return -1;
    }
    *out = (token_t)v;
    return 0;
}

/* start and stop (tokens) of a slice of len tokens, clamped as slicing does; -1 with ValueError set if
 * either is negative. */
static int
clamp_slice(Py_ssize_t *start, Py_ssize_t *stop, Py_ssize_t len)
{
    if (*start < 0 || *stop < 0) {
        PyErr_SetString(PyExc_ValueError, "Record: start and stop must not be negative");
        return -1;
    }
    if (*stop > len)
        *stop = len;
    if (*start > *stop)
        *start = *stop;
    return 0;
}

/* The number of int32 token ids in packed bytes; -1 with ValueError set if it is not a whole number. */
static Py_ssize_t
packed_count(PyObject *packed, const char *who)
{
    Py_ssize_t size = PyBytes_Size(packed);
    if (size < 0)
        return -1;
    if (size % (Py_ssize_t)sizeof(token_t) != 0) {
        PyErr_Format(PyExc_ValueError, "%s: packed tokens are not a whole number of int32 token ids", who);
        return -1;
    }
    return size / (Py_ssize_t)sizeof(token_t);
}

/* Whether the n packed tokens at buf are exactly list[start:start + n] (False where the list ends
 * first, as comparing with a shorter slice gives). 1 equal, 0 not, -1 error. */
static int
list_holds(const char *buf, Py_ssize_t n, PyObject *list, Py_ssize_t start)
{
    Py_ssize_t len = PyList_Size(list);
    if (len < 0)
        return -1;
    if (start > len || n > len - start)
        return 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        token_t v, want;
        if (token_at(list, start + k, &v) < 0)
            return -1;
        memcpy(&want, buf + k * sizeof(token_t), sizeof want);
        if (v != want)
            return 0;
    }
    return 1;
}

static PyObject *
pack(PyObject *list, Py_ssize_t start, Py_ssize_t stop)
{
    if (!PyList_Check(list)) {
        PyErr_SetString(PyExc_TypeError, "Record: tokens must be a list");
        return NULL;
    }
    if (clamp_slice(&start, &stop, PyList_Size(list)) < 0)
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (stop - start) * (Py_ssize_t)sizeof(token_t));
    if (out == NULL)
        return NULL;
    char *buf = PyBytes_AsString(out); /* a new bytes object, written before anyone else sees it */
    if (buf == NULL) {
        Py_DECREF(out);
        return NULL;
    }
    for (Py_ssize_t i = start; i < stop; i++) {
        token_t v;
        if (token_at(list, i, &v) < 0) {
            Py_DECREF(out);
            return NULL;
        }
        memcpy(buf + (i - start) * sizeof(token_t), &v, sizeof v);
    }
    return out;
}

/* A new record of n token ids from buf (or, buf NULL, from list[lo:lo + n], which must hold them). */
static PyObject *
record_make(PyObject *parent, const char *buf, PyObject *list, Py_ssize_t lo, Py_ssize_t n, PyObject *namespace,
            int root)
{
    if (n > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "Record: too many tokens for one block");
        return NULL;
    }
    int slotted = n == slab_ntokens;
    RecordObject *self = slotted ? slot_take()
                                 : (RecordObject *)malloc(sizeof(RecordObject) + (size_t)n * sizeof(token_t));
    if (self == NULL)
        return PyErr_NoMemory();
    if (buf != NULL) {
        memcpy(self->tokens, buf, (size_t)n * sizeof(token_t));
    } else {
        for (Py_ssize_t k = 0; k < n; k++) {
            if (token_at(list, lo + k, &self->tokens[k]) < 0) {
                if (slotted)
                    slot_give(self);
                else
                    free(self);
                return NULL;
            }
        }
    }
    PyObject_Init((PyObject *)self, RecordType); /* a heap type: the record holds a reference to it */
    self->parent = Py_NewRef(parent);
    self->namespace = Py_NewRef(namespace);
    self->ntokens = (int32_t)n;
    self->root = (char)(root || parent == Py_None);
    self->slotted = (char)slotted;
    return (PyObject *)self;
}

static PyObject *
record_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"parent", "tokens", "start", "stop", "namespace", "root", NULL};
    PyObject *parent, *list, *namespace;
    Py_ssize_t start, stop;
    int root = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOnnO|p:Record", kwlist, &parent, &list, &start, &stop,
                                     &namespace, &root))
        return NULL;
    if (parent != Py_None && !Py_IS_TYPE(parent, RecordType)) {
        PyErr_SetString(PyExc_TypeError, "Record: parent must be a Record or None");
        return NULL;
    }
    if (PyBytes_Check(list)) {
        Py_ssize_t len = packed_count(list, "Record");
        if (len < 0 || clamp_slice(&start, &stop, len) < 0)
            return NULL;
        return record_make(parent, PyBytes_AsString(list) + start * (Py_ssize_t)sizeof(token_t), NULL, 0,
                           stop - start, namespace, root);
    }
    if (!PyList_Check(list)) {
        PyErr_SetString(PyExc_TypeError, "Record: tokens must be a list");
        return NULL;
    }
    if (clamp_slice(&start, &stop, PyList_Size(list)) < 0)
        return NULL;
    return record_make(parent, NULL, list, start, stop - start, namespace, root);
}

static void
record_clear_fields(RecordObject *r)
{
    Py_CLEAR(r->namespace);
}

/* A record's memory, and the reference to its (heap) type that PyObject_Init gave it. */
static void
record_free(RecordObject *r)
{
    PyTypeObject *type = Py_TYPE((PyObject *)r);
    if (r->slotted)
        slot_give(r);
    else
        free(r);
    Py_DECREF(type);
}

/* Iterative over the parent chain: freeing the last record of a long chain (a 128k-token context is
 * 8,000 blocks) must not recurse once per block. A parent held by nothing else is freed here, in the
 * loop; the first one still referenced elsewhere just loses this reference. */
static void
record_dealloc(RecordObject *self)
{
    PyObject *parent = self->parent;
    self->parent = NULL;
    record_clear_fields(self);
    record_free(self);
    while (parent != NULL && Py_IS_TYPE(parent, RecordType) && Py_REFCNT(parent) == 1) {
        RecordObject *p = (RecordObject *)parent;
        parent = p->parent;
        p->parent = NULL;
        record_clear_fields(p);
        record_free(p);
    }
    Py_XDECREF(parent);
}

static PyObject *
record_repr(RecordObject *self)
{
    return PyUnicode_FromFormat("Record(%d tokens, root=%s)", self->ntokens, self->root ? "True" : "False");
}

/* The tokens as packed int32 bytes (a copy: what pack() gives for the same token ids). */
static PyObject *
record_get_tokens(RecordObject *self, void *closure)
{
    return PyBytes_FromStringAndSize((const char *)self->tokens, self->ntokens * (Py_ssize_t)sizeof(token_t));
}

static PyObject *
record_get_root(RecordObject *self, void *closure)
{
    return PyBool_FromLong(self->root);
}

static PyMemberDef record_members[] = {
    {"parent", T_OBJECT, offsetof(RecordObject, parent), READONLY, "the record of the block before, or None"},
    {"namespace", T_OBJECT, offsetof(RecordObject, namespace), READONLY, "namespace or extra keys, or None"},
    {NULL},
};

static PyGetSetDef record_getset[] = {
    {"root", (getter)record_get_root, NULL, "whether the request's namespace enters the chain here", NULL},
    {"tokens", (getter)record_get_tokens, NULL, "the block's token ids, packed int32 (a copy)", NULL},
    {NULL},
};

static PyType_Slot record_slots[] = {
    {Py_tp_dealloc, (void *)record_dealloc},
    {Py_tp_repr, (void *)record_repr},
    {Py_tp_doc, (void *)"What a cached block holds (see kvfence.vllm.records)."},
    {Py_tp_members, record_members},
    {Py_tp_getset, record_getset},
    {Py_tp_new, (void *)record_new},
    {0, NULL},
};

/* The basic size counts no tokens: they are allocated with the record by record_make, from the C heap.
 * Not Py_TPFLAGS_HAVE_GC, on purpose: see the top of this file. Not a base type either: a subclass could
 * add what makes a cycle. Immutable, as a static type is. */
static PyType_Spec record_spec = {
    "kvfence.vllm._records.Record",
    sizeof(RecordObject),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    record_slots,
};

static PyObject *
records_equal(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "equal(packed, tokens, start)");
        return NULL;
    }
    PyObject *packed = args[0], *list = args[1];
    if (!PyBytes_Check(packed) || !PyList_Check(list)) {
        PyErr_SetString(PyExc_TypeError, "equal: packed must be bytes and tokens a list");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[2]);
    if (start == -1 && PyErr_Occurred())
        return NULL;
    if (start < 0) {
        PyErr_SetString(PyExc_ValueError, "equal: start must not be negative");
        return NULL;
    }
    Py_ssize_t n = packed_count(packed, "equal");
    if (n < 0)
        return NULL;
    int held = list_holds(PyBytes_AsString(packed), n, list, start);
    if (held < 0)
        return NULL;
    return PyBool_FromLong(held);
}

static PyObject *
records_pack(PyObject *self, PyObject *list)
{
    if (!PyList_Check(list)) {
        PyErr_SetString(PyExc_TypeError, "pack: tokens must be a list");
        return NULL;
    }
    return pack(list, 0, PyList_Size(list));
}

/* Whether record r's tokens are tokens[lo:lo + n], n its token count: from packed where it reaches
 * (memcmp), else from the list. len: the list's length (list_holds reads it again before it reads the
 * list). 1 equal, 0 not, -1 error. */
static int
record_holds(RecordObject *r, PyObject *list, Py_ssize_t len, const char *packed, Py_ssize_t npacked, Py_ssize_t lo)
{
    Py_ssize_t n = r->ntokens;
    size_t size = (size_t)n * sizeof(token_t);
    const char *buf = (const char *)r->tokens;
    if (packed != NULL && lo <= len && n <= len - lo && lo + n <= npacked)
        return memcmp(buf, packed + lo * (Py_ssize_t)sizeof(token_t), size) == 0;
    return list_holds(buf, n, list, lo);
}

static PyObject *
records_verify_chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "verify_chain(records, block_ids, tokens, packed, namespace, block_size)");
        return NULL;
    }
    PyObject *records = args[0], *ids = args[1], *list = args[2], *packed_obj = args[3], *ns = args[4];
    if (!PyList_Check(records) || !PyList_Check(ids) || !PyList_Check(list)) {
        PyErr_SetString(PyExc_TypeError, "verify_chain: records, block_ids and tokens must be lists");
        return NULL;
    }
    const char *packed = NULL;
    Py_ssize_t npacked = 0;
    if (packed_obj != Py_None) {
        if (!PyBytes_Check(packed_obj) || PyBytes_Size(packed_obj) % (Py_ssize_t)sizeof(token_t) != 0) {
            PyErr_SetString(PyExc_TypeError, "verify_chain: packed must be bytes from pack() or None");
            return NULL;
        }
        packed = PyBytes_AsString(packed_obj);
        npacked = PyBytes_Size(packed_obj) / (Py_ssize_t)sizeof(token_t);
    }
    Py_ssize_t bs = PyLong_AsSsize_t(args[5]);
    if (bs == -1 && PyErr_Occurred())
        return NULL;
    if (bs <= 0) {
        PyErr_SetString(PyExc_ValueError, "verify_chain: block_size must be positive");
        return NULL;
    }
    /* Both lengths are read once: PyList_GetItem checks every index against the list as it is. */
    Py_ssize_t nids = PyList_Size(ids), nrec = PyList_Size(records), len = PyList_Size(list), i;
    PyObject *parent = Py_None;
    for (i = 0; i < nids; i++) {
        PyObject *id_obj = PyList_GetItem(ids, i);
        if (id_obj == NULL)
            return NULL;
        Py_ssize_t bid = PyLong_AsSsize_t(id_obj);
        if (bid == -1 && PyErr_Occurred())
            return NULL;
        if (bid < 0 || bid >= nrec) {
            PyErr_Format(PyExc_IndexError, "verify_chain: block id %zd has no record slot", bid);
            return NULL;
        }
        PyObject *o = PyList_GetItem(records, bid);
        if (o == NULL)
            return NULL;
        if (!Py_IS_TYPE(o, RecordType))
            break; /* None (no record) or not a compiled record: not verified here */
        RecordObject *r = (RecordObject *)o;
        if (r->parent != parent || r->ntokens != bs)
            break;
        if (i == 0) {
            if (!r->root)
                break;
            int same = PyObject_RichCompareBool(r->namespace, ns, Py_EQ);
            if (same < 0)
                return NULL;
            if (!same)
                break;
        } else if (r->namespace != Py_None) {
            break;
        }
        int held = record_holds(r, list, len, packed, npacked, i * bs);
        if (held < 0)
            return NULL;
        if (!held)
            break;
        parent = o;
    }
    return PyLong_FromSsize_t(i);
}

/* A block attribute read for record_chain: 1 true, 0 false, -1 error. */
static int
attr_is_true(PyObject *block, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(block, name);
    if (v == NULL)
        return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

static PyObject *str_is_null, *str_block_hash, *str_block_id;

/* record_chain(records, blocks, start, stop, parent, tokens, packed, block_size, root, namespace)
 *
 * The plain-text loop of the scheduler's cache_full_blocks (FencedBlockPool), in one call: for i in
 * [start, stop), vLLM's block blocks[i] (just cached by vLLM):
 *   - a null block, or one without a block hash, records nothing and ends the chain (parent None);
 *   - block i < root (a declared shared block computed again), or one whose parent has no record
 *     (i > 0), gets no record: records[block_id] = None, which never verifies;
 *   - otherwise records[block_id] = Record(parent, tokens, i*bs, (i+1)*bs, namespace if i == root
 *     else None, root=i == root), its tokens copied from packed where packed holds the whole block.
 * parent: the record of blocks[start - 1] (None at 0). Errors only for inputs that are a bug. */
static PyObject *
records_record_chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "record_chain(records, blocks, start, stop, parent, tokens, packed, "
                                         "block_size, root, namespace)");
        return NULL;
    }
    PyObject *records = args[0], *blocks = args[1], *parent = args[4], *list = args[5];
    PyObject *packed_obj = args[6], *ns = args[9];
    if (!PyList_Check(records) || !PyList_Check(blocks) || !PyList_Check(list)) {
        PyErr_SetString(PyExc_TypeError, "record_chain: records, blocks and tokens must be lists");
        return NULL;
    }
    if (parent != Py_None && !Py_IS_TYPE(parent, RecordType)) {
        PyErr_SetString(PyExc_TypeError, "record_chain: parent must be a Record or None");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[2]), stop = PyLong_AsSsize_t(args[3]);
    Py_ssize_t bs = PyLong_AsSsize_t(args[7]), root = PyLong_AsSsize_t(args[8]);
    if (PyErr_Occurred())
        return NULL;
    if (start < 0 || bs <= 0 || stop > PyList_Size(blocks)) {
        PyErr_SetString(PyExc_ValueError, "record_chain: start, stop or block_size out of range");
        return NULL;
    }
    Py_ssize_t npacked = 0;
    const char *packed = NULL;
    if (packed_obj != Py_None) {
        if (!PyBytes_Check(packed_obj) || (npacked = packed_count(packed_obj, "record_chain")) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "record_chain: packed must be bytes from pack() or None");
            return NULL;
        }
        packed = PyBytes_AsString(packed_obj);
    }
    slab_size_for(bs);
    Py_INCREF(parent);
    for (Py_ssize_t i = start; i < stop; i++) {
        PyObject *block = PyList_GetItem(blocks, i); /* borrowed */
        if (block == NULL)
            goto fail;
        int null = attr_is_true(block, str_is_null);
        if (null < 0)
            goto fail;
        PyObject *h = null ? NULL : PyObject_GetAttr(block, str_block_hash);
        if (!null && h == NULL)
            goto fail;
        int unhashed = h == Py_None;
        Py_XDECREF(h);
        if (null || unhashed) {
            Py_SETREF(parent, Py_NewRef(Py_None));
            continue;
        }
        PyObject *id_obj = PyObject_GetAttr(block, str_block_id);
        if (id_obj == NULL)
            goto fail;
        Py_ssize_t bid = PyLong_AsSsize_t(id_obj);
        Py_DECREF(id_obj);
        if (bid == -1 && PyErr_Occurred())
            goto fail;
        if (bid < 0 || bid >= PyList_Size(records)) {
            PyErr_Format(PyExc_IndexError, "record_chain: block id %zd has no record slot", bid);
            goto fail;
        }
        PyObject *rec;
        if (i < root || (i > 0 && parent == Py_None)) {
            rec = Py_NewRef(Py_None);
        } else {
            Py_ssize_t lo = i * bs, hi = lo + bs, len = PyList_Size(list);
            if (hi > len)
                hi = len > lo ? len : lo; /* clamped, as slicing does */
            const char *buf = hi <= npacked ? packed + lo * (Py_ssize_t)sizeof(token_t) : NULL;
            rec = record_make(parent, buf, list, lo, hi - lo, i == root ? ns : Py_None, i == root);
            if (rec == NULL)
                goto fail;
        }
        /* PyList_SetItem steals the new reference (also when it fails) and drops the old record. */
        if (PyList_SetItem(records, bid, Py_NewRef(rec)) < 0) {
            Py_DECREF(rec);
            goto fail;
        }
        Py_SETREF(parent, rec);
    }
    Py_DECREF(parent);
    Py_RETURN_NONE;
fail:
    Py_DECREF(parent);
    return NULL;
}

static PyObject *
records_slot_tokens(PyObject *self, PyObject *unused)
{
    return PyLong_FromSsize_t(slab_ntokens);
}

static PyMethodDef methods[] = {
    {"equal", (PyCFunction)(void (*)(void))records_equal, METH_FASTCALL,
     "equal(packed, tokens, start) -> bool: whether packed holds exactly tokens[start:start + n]"},
    {"pack", (PyCFunction)records_pack, METH_O, "pack(tokens) -> bytes: a token list packed as int32"},
    {"verify_chain", (PyCFunction)(void (*)(void))records_verify_chain, METH_FASTCALL,
     "verify_chain(records, block_ids, tokens, packed, namespace, block_size) -> int: the leading blocks "
     "of a hit that verify by the plain-text rule"},
    {"record_chain", (PyCFunction)(void (*)(void))records_record_chain, METH_FASTCALL,
     "record_chain(records, blocks, start, stop, parent, tokens, packed, block_size, root, namespace): the "
     "records of the vLLM blocks[start:stop] a request filled (plain text)"},
    {"slot_tokens", (PyCFunction)records_slot_tokens, METH_NOARGS,
     "slot_tokens() -> int: the token count of the records that come from cache-line slots (-1 before the "
     "first record_chain call)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvfence.vllm._records",
    "The vLLM fence's prefix-cache records, compiled (see _records.c and kvfence.vllm.records).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__records(void)
{
    RecordType = (PyTypeObject *)PyType_FromSpec(&record_spec);
    if (RecordType == NULL)
        return NULL;
    str_is_null = PyUnicode_InternFromString("is_null");
    str_block_hash = PyUnicode_InternFromString("block_hash");
    str_block_id = PyUnicode_InternFromString("block_id");
    if (str_is_null == NULL || str_block_hash == NULL || str_block_id == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "TOKEN_BYTES", (long)sizeof(token_t)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    /* The module holds one reference to the type, RecordType (for the module's life) another. */
    if (PyModule_AddObjectRef(m, "Record", (PyObject *)RecordType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
