/* xinfra._records: the per-record work of the read path, in C (and ``Record``, and the
 * producer's pass over a send's records: see their sections below).
 *
 * Why C.  Reading a record costs the broker's client its accessor calls; a
 * pure Python layer on top added a named tuple per record (4.5k instructions
 * with C ``map``/``zip``/``tuple.__new__``) and then made each field read a
 * descriptor call (CPython 3.11 does not specialise ``_tuplegetter``), for
 * 12.6k instructions per record against a bare loop's 8.9k (callgrind, bench
 * read loop).  Two functions close that gap:
 *
 * ``fast_fields(cls)`` swaps a named tuple's ``_tuplegetter`` fields for
 * member descriptors (``T_OBJECT_EX``, ``READONLY``) at the offsets of the
 * tuple's items, which 3.11 specialises to ``LOAD_ATTR_SLOT`` (one load).
 *
 * ``kafka_records(messages, cls, prefix)`` makes ``cls(*prefix, partition,
 * offset, timestamp_ms, key, value, headers)`` of each confluent-kafka
 * ``Message`` without an error, through the ``Message`` methods (the normal
 * C API: no librdkafka linking), and hands back the messages with an error.
 *
 * The invariant fast_fields relies on (memory safety).  A member descriptor
 * reads a fixed offset with no bounds check, so every instance of a class
 * given to ``fast_fields`` must hold at least ``len(cls._fields)`` items.
 * The named tuple's own constructors enforce it (``cls(...)`` takes exactly
 * the fields, defaults filling the rest; ``_make`` checks the length; copy
 * and pickle go through them), and ``kafka_records`` checks the width it
 * builds against ``len(cls._fields)``.  Only an explicit
 * ``tuple.__new__(cls, shorter)`` can break it: code building these records
 * with ``tuple.__new__`` must pass full rows (``xinfra.model.prefixed`` does:
 * its rows come whole from the decoders).
 *
 * Garbage collection.  A record whose items are all atomic for the collector
 * (objects that are not GC-tracked: int, str, bytes, None, an untracked exact
 * tuple such as ``()``) cannot be part of a reference cycle, and a tuple's
 * items never change, so it is untracked at birth, as CPython untracks exact
 * tuples during collections (it never does for subclasses).  Only for classes
 * with no ``__dict__`` and no slots beyond the tuple's (named tuples), whose
 * instances hold nothing but their items and their (heap) type: a record
 * stored on its own class would then keep that class alive after it is
 * dropped (a leak, never a crash).  Held records are then never rescanned
 * by collections.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <string.h>
#include <structmember.h>

/* -- fast_fields -------------------------------------------------------------------------- */

static PyObject *tuplegetter_type = NULL; /* collections' _tuplegetter, found at import */

static char *
copy_utf8(PyObject *text)
{
    Py_ssize_t size;
    const char *utf8 = PyUnicode_AsUTF8AndSize(text, &size);
    if (utf8 == NULL) {
        return NULL;
    }
    /* Never freed: a member descriptor keeps a pointer to its PyMemberDef and its name. */
    char *copy = PyMem_RawMalloc((size_t)size + 1);
    if (copy == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(copy, utf8, (size_t)size + 1);
    return copy;
}

static int
is_plain_named_tuple_type(PyTypeObject *type)
{
    return PyType_IsSubtype(type, &PyTuple_Type)
        && type->tp_basicsize == PyTuple_Type.tp_basicsize
        && type->tp_itemsize == PyTuple_Type.tp_itemsize
        && type->tp_dictoffset == 0;
}

static PyObject *
fields_of(PyTypeObject *type)
{
    PyObject *fields = PyObject_GetAttrString((PyObject *)type, "_fields");
    if (fields == NULL) {
        return NULL;
    }
    if (!PyTuple_CheckExact(fields)) {
        Py_DECREF(fields);
        PyErr_Format(PyExc_TypeError, "%s._fields is not a tuple", type->tp_name);
        return NULL;
    }
    return fields;
}

static PyObject *
fast_fields(PyObject *module, PyObject *arg)
{
    if (!PyType_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "fast_fields takes a named tuple class");
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)arg;
    if (!(type->tp_flags & Py_TPFLAGS_HEAPTYPE) || !is_plain_named_tuple_type(type)) {
        PyErr_Format(PyExc_TypeError,
                     "fast_fields: %s is not a named tuple (a tuple subclass with no "
                     "__dict__ and no slots of its own)", type->tp_name);
        return NULL;
    }
    PyObject *fields = fields_of(type);
    if (fields == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(fields); i++) {
        PyObject *name = PyTuple_GET_ITEM(fields, i);
        Py_ssize_t offset = offsetof(PyTupleObject, ob_item) + i * (Py_ssize_t)sizeof(PyObject *);
        if (!PyUnicode_Check(name)) {
            PyErr_Format(PyExc_TypeError, "%s._fields[%zd] is not a str", type->tp_name, i);
            goto error;
        }
        PyObject *current = PyDict_GetItemWithError(type->tp_dict, name); /* borrowed */
        if (current == NULL) {
            if (!PyErr_Occurred()) {
                PyErr_Format(PyExc_TypeError, "%s has no field %R of its own", type->tp_name,
                             name);
            }
            goto error;
        }
        if (Py_IS_TYPE(current, &PyMemberDescr_Type)) { /* done already: check it is ours */
            PyMemberDescrObject *member = (PyMemberDescrObject *)current;
            if (member->d_common.d_type == type && member->d_member->type == T_OBJECT_EX
                && member->d_member->offset == offset) {
                continue;
            }
        }
        if ((PyObject *)Py_TYPE(current) != tuplegetter_type) {
            PyErr_Format(PyExc_TypeError, "%s.%U is not a named tuple field (%s)",
                         type->tp_name, name, Py_TYPE(current)->tp_name);
            goto error;
        }
        /* (type, (index, doc)): the getter must read item i, as the member will. */
        PyObject *reduced = PyObject_CallMethod(current, "__reduce__", NULL);
        if (reduced == NULL) {
            goto error;
        }
        PyObject *state = PyTuple_Check(reduced) && PyTuple_GET_SIZE(reduced) == 2
                              ? PyTuple_GET_ITEM(reduced, 1) : NULL;
        Py_ssize_t index = -1;
        PyObject *doc = Py_None;
        if (state != NULL && PyTuple_Check(state) && PyTuple_GET_SIZE(state) == 2) {
            index = PyLong_AsSsize_t(PyTuple_GET_ITEM(state, 0));
            doc = PyTuple_GET_ITEM(state, 1);
        }
        if (index != i) {
            Py_DECREF(reduced);
            if (!PyErr_Occurred()) {
                PyErr_Format(PyExc_TypeError, "%s.%U does not read item %zd", type->tp_name,
                             name, i);
            }
            goto error;
        }
        PyMemberDef *def = PyMem_RawCalloc(2, sizeof(PyMemberDef)); /* never freed, see above */
        if (def == NULL) {
            Py_DECREF(reduced);
            PyErr_NoMemory();
            goto error;
        }
        def->name = copy_utf8(name);
        def->type = T_OBJECT_EX;
        def->offset = offset;
        def->flags = READONLY;
        def->doc = PyUnicode_Check(doc) ? copy_utf8(doc) : NULL;
        Py_DECREF(reduced);
        if (def->name == NULL || PyErr_Occurred()) {
            goto error;
        }
        PyObject *descriptor = PyDescr_NewMember(type, def);
        if (descriptor == NULL) {
            goto error;
        }
        int set = PyObject_SetAttr((PyObject *)type, name, descriptor);
        Py_DECREF(descriptor);
        if (set < 0) {
            goto error;
        }
    }
    Py_DECREF(fields);
    Py_INCREF(arg);
    return arg;
error:
    Py_DECREF(fields);
    return NULL;
}

/* -- kafka_records ------------------------------------------------------------------------ */

enum { A_ERROR, A_PARTITION, A_OFFSET, A_TIMESTAMP, A_KEY, A_VALUE, A_HEADERS, A_COUNT };
static const char *const accessor_names[A_COUNT] = {
    "error", "partition", "offset", "timestamp", "key", "value", "headers",
};
/* The accessors of the last message type seen (strong references), looked up once. */
static PyTypeObject *bound_type = NULL;
static PyObject *accessors[A_COUNT];

static int
bind(PyTypeObject *type)
{
    PyObject *found[A_COUNT];
    for (int i = 0; i < A_COUNT; i++) {
        found[i] = PyObject_GetAttrString((PyObject *)type, accessor_names[i]);
        if (found[i] == NULL) {
            while (--i >= 0) {
                Py_DECREF(found[i]);
            }
            return -1;
        }
    }
    for (int i = 0; i < A_COUNT; i++) {
        Py_XSETREF(accessors[i], found[i]);
    }
    Py_INCREF(type);
    Py_XSETREF(bound_type, type);
    return 0;
}

static inline PyObject *
call(int accessor, PyObject *message)
{
    return PyObject_Vectorcall(accessors[accessor], &message, 1, NULL);
}

/* Not GC-tracked, so never part of a cycle: CPython's own rule for untracking exact tuples. */
static inline int
is_atomic(PyObject *item)
{
    if (!PyObject_IS_GC(item)) {
        return 1;
    }
    return PyTuple_CheckExact(item) && !PyObject_GC_IsTracked(item);
}

/* One record of a message without an error, or NULL with an exception set. */
static PyObject *
record_of(PyObject *message, PyTypeObject *cls, PyObject *prefix, int untrack)
{
    Py_ssize_t at = PyTuple_GET_SIZE(prefix);
    PyObject *record = cls->tp_alloc(cls, at + 6);
    if (record == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < at; i++) {
        PyObject *item = PyTuple_GET_ITEM(prefix, i);
        Py_INCREF(item);
        PyTuple_SET_ITEM(record, i, item);
    }
    PyObject *item;
    if ((item = call(A_PARTITION, message)) == NULL) {
        goto error;
    }
    PyTuple_SET_ITEM(record, at, item);
    if ((item = call(A_OFFSET, message)) == NULL) {
        goto error;
    }
    PyTuple_SET_ITEM(record, at + 1, item);
    PyObject *timestamp = call(A_TIMESTAMP, message); /* (type, milliseconds) */
    if (timestamp == NULL) {
        goto error;
    }
    if (!PyTuple_Check(timestamp) || PyTuple_GET_SIZE(timestamp) != 2) {
        Py_DECREF(timestamp);
        PyErr_SetString(PyExc_TypeError, "Message.timestamp() is not a (type, ms) pair");
        goto error;
    }
    item = PyTuple_GET_ITEM(timestamp, 1);
    Py_INCREF(item);
    Py_DECREF(timestamp);
    PyTuple_SET_ITEM(record, at + 2, item);
    if ((item = call(A_KEY, message)) == NULL) {
        goto error;
    }
    PyTuple_SET_ITEM(record, at + 3, item);
    if ((item = call(A_VALUE, message)) == NULL) {
        goto error;
    }
    PyTuple_SET_ITEM(record, at + 4, item);
    PyObject *headers = call(A_HEADERS, message); /* None, or a list of (name, value) */
    if (headers == NULL) {
        goto error;
    }
    if (headers == Py_None || (PyList_Check(headers) && PyList_GET_SIZE(headers) == 0)) {
        item = PyTuple_New(0);
    }
    else if (PyList_CheckExact(headers)) {
        item = PyList_AsTuple(headers);
    }
    else {
        item = PySequence_Tuple(headers);
    }
    Py_DECREF(headers);
    if (item == NULL) {
        goto error;
    }
    PyTuple_SET_ITEM(record, at + 5, item);
    if (untrack) {
        for (Py_ssize_t i = at; i < at + 6; i++) {
            if (!is_atomic(PyTuple_GET_ITEM(record, i))) {
                return record;
            }
        }
        PyObject_GC_UnTrack(record);
    }
    return record;
error:
    Py_DECREF(record); /* items not yet set are NULL: the tuple's dealloc skips them */
    return NULL;
}

/* The arity check of a METH_FASTCALL function: ``signature`` names it and its arguments. */
static int
check_nargs(const char *signature, Py_ssize_t nargs, Py_ssize_t expected)
{
    if (nargs == expected) {
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "%s, got %zd arguments", signature, nargs);
    return -1;
}

static PyObject *
kafka_records(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("kafka_records takes (messages, cls, prefix)", nargs, 3) < 0) {
        return NULL;
    }
    PyObject *messages = args[0];
    PyObject *cls_arg = args[1];
    PyObject *prefix = args[2];
    if (!PyType_Check(cls_arg) || !PyType_IsSubtype((PyTypeObject *)cls_arg, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "kafka_records: cls must be a tuple subclass");
        return NULL;
    }
    if (!PyTuple_Check(prefix)) {
        PyErr_SetString(PyExc_TypeError, "kafka_records: prefix must be a tuple");
        return NULL;
    }
    PyTypeObject *cls = (PyTypeObject *)cls_arg;
    Py_ssize_t width = PyTuple_GET_SIZE(prefix) + 6;
    if (PyObject_HasAttrString(cls_arg, "_fields")) { /* what fast_fields' members rely on */
        PyObject *fields = fields_of(cls);
        if (fields == NULL) {
            return NULL;
        }
        Py_ssize_t count = PyTuple_GET_SIZE(fields);
        Py_DECREF(fields);
        if (count != width) {
            PyErr_Format(PyExc_ValueError, "kafka_records: %s has %zd fields, the prefix and a "
                         "message make %zd", cls->tp_name, count, width);
            return NULL;
        }
    }
    int untrack = is_plain_named_tuple_type(cls);
    for (Py_ssize_t i = 0; untrack && i < PyTuple_GET_SIZE(prefix); i++) {
        untrack = is_atomic(PyTuple_GET_ITEM(prefix, i));
    }
    PyObject *sequence = PySequence_Fast(messages, "kafka_records: messages must be a sequence");
    if (sequence == NULL) {
        return NULL;
    }
    Py_ssize_t size = PySequence_Fast_GET_SIZE(sequence);
    PyObject **items = PySequence_Fast_ITEMS(sequence);
    PyObject *records = PyList_New(size); /* NULL slots past `made` until the end */
    PyObject *failed = NULL;
    Py_ssize_t made = 0;
    if (records == NULL) {
        goto error;
    }
    for (Py_ssize_t i = 0; i < size; i++) {
        PyObject *message = items[i];
        if (Py_TYPE(message) != bound_type && bind(Py_TYPE(message)) < 0) {
            goto error;
        }
        PyObject *error = call(A_ERROR, message);
        if (error == NULL) {
            goto error;
        }
        if (error != Py_None) {
            Py_DECREF(error);
            if (failed == NULL && (failed = PyList_New(0)) == NULL) {
                goto error;
            }
            if (PyList_Append(failed, message) < 0) {
                goto error;
            }
            continue;
        }
        Py_DECREF(error);
        PyObject *record = record_of(message, cls, prefix, untrack);
        if (record == NULL) {
            goto error;
        }
        PyList_SET_ITEM(records, made, record);
        made++;
    }
    Py_DECREF(sequence);
    if (made < size) { /* some failed: the records made, in a list of their own */
        PyObject *shorter = PyList_GetSlice(records, 0, made);
        Py_DECREF(records);
        records = shorter;
        if (records == NULL) {
            Py_XDECREF(failed);
            return NULL;
        }
    }
    if (failed == NULL && (failed = PyList_New(0)) == NULL) {
        Py_DECREF(records);
        return NULL;
    }
    PyObject *result = PyTuple_Pack(2, records, failed);
    Py_DECREF(records);
    Py_DECREF(failed);
    return result;
error:
    Py_DECREF(sequence);
    Py_XDECREF(records); /* its dealloc skips the NULL slots */
    Py_XDECREF(failed);
    return NULL;
}

/* -- Record ------------------------------------------------------------------------------- */

/* What a producer writes, made once per record by every application: a C type so that
 * ``Record(value=v)`` is one vectorcall (the slotted dataclass it replaces ran a Python
 * ``__init__``: 3.5k instructions).  Mutable as the dataclass was (a record is not to be
 * changed once sent, by convention), equal and hashable by value, fields as T_OBJECT_EX
 * members (specialised reads in the producer's loops). */
typedef struct {
    PyObject_HEAD
    PyObject *value;
    PyObject *key;
    PyObject *headers;
    PyObject *timestamp_ms;
} RecordObject;

enum { F_VALUE, F_KEY, F_HEADERS, F_TIMESTAMP, F_COUNT };
static const char *const field_names[F_COUNT] = {"value", "key", "headers", "timestamp_ms"};
static PyObject *field_strings[F_COUNT]; /* interned */
static PyObject *empty_tuple = NULL;

static PyTypeObject RecordType;

#define RECORD_FIELD(self, i) ((&((RecordObject *)(self))->value)[i])

/* Every field atomic (see ``is_atomic``): bytes, str, int or None, or an untracked tuple. */
static int
record_is_atomic(RecordObject *self)
{
    for (int f = 0; f < F_COUNT; f++) {
        PyObject *item = RECORD_FIELD(self, f);
        if (item != NULL && !is_atomic(item)) {
            return 0;
        }
    }
    return 1;
}

static PyObject *
record_make(PyTypeObject *type, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *given[F_COUNT] = {NULL, NULL, NULL, NULL};
    if (nargs > F_COUNT) {
        PyErr_Format(PyExc_TypeError, "Record() takes at most 4 positional arguments (%zd given)",
                     nargs);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        given[i] = args[i];
    }
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        int found = -1;
        for (int f = 0; f < F_COUNT && found < 0; f++) {
            if (name == field_strings[f]) {
                found = f;
            }
        }
        for (int f = 0; f < F_COUNT && found < 0; f++) {
            int equal = PyUnicode_Check(name) ? PyUnicode_Compare(name, field_strings[f]) : -1;
            if (equal == 0) {
                found = f;
            }
        }
        if (found < 0) {
            PyErr_Format(PyExc_TypeError, "Record() got an unexpected keyword argument '%S'", name);
            return NULL;
        }
        if (given[found] != NULL) {
            PyErr_Format(PyExc_TypeError, "Record() got multiple values for argument '%s'",
                         field_names[found]);
            return NULL;
        }
        given[found] = args[nargs + k];
    }
    if (given[F_VALUE] == NULL) {
        PyErr_SetString(PyExc_TypeError,
                        "Record() missing 1 required positional argument: 'value'");
        return NULL;
    }
    RecordObject *self = (RecordObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->value = Py_NewRef(given[F_VALUE]);
    self->key = Py_NewRef(given[F_KEY] != NULL ? given[F_KEY] : Py_None);
    self->headers = Py_NewRef(given[F_HEADERS] != NULL ? given[F_HEADERS] : empty_tuple);
    self->timestamp_ms = Py_NewRef(given[F_TIMESTAMP] != NULL ? given[F_TIMESTAMP] : Py_None);
    if (Py_IS_TYPE(self, &RecordType) && record_is_atomic(self)) {
        /* Nothing it holds can lead back to it: no cycle can pass through it, so the collector
         * need not scan it (an application builds thousands per send and each one was scanned
         * by every young collection while alive).  ``record_setattro`` tracks it again when a
         * field is given an object that could. */
        PyObject_GC_UnTrack(self);
    }
    return (PyObject *)self;
}

static PyObject *
record_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    return record_make((PyTypeObject *)type, args, PyVectorcall_NARGS(nargsf), kwnames);
}

static PyObject *
record_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    /* Subclasses (tp_vectorcall is not inherited) and the odd caller: the same parsing. */
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    Py_ssize_t nkw = kwargs == NULL ? 0 : PyDict_GET_SIZE(kwargs);
    PyObject **stack = PyMem_Malloc((size_t)(nargs + nkw + 1) * sizeof(PyObject *));
    if (stack == NULL) {
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        stack[i] = PyTuple_GET_ITEM(args, i);
    }
    PyObject *kwnames = NULL;
    if (nkw > 0) {
        kwnames = PyTuple_New(nkw);
        if (kwnames == NULL) {
            PyMem_Free(stack);
            return NULL;
        }
        Py_ssize_t pos = 0, k = 0;
        PyObject *name, *item;
        while (PyDict_Next(kwargs, &pos, &name, &item)) {
            PyTuple_SET_ITEM(kwnames, k, Py_NewRef(name));
            stack[nargs + k] = item;
            k++;
        }
    }
    PyObject *made = record_make(type, stack, nargs, kwnames);
    Py_XDECREF(kwnames);
    PyMem_Free(stack);
    return made;
}

static int
record_traverse(RecordObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->value);
    Py_VISIT(self->key);
    Py_VISIT(self->headers);
    Py_VISIT(self->timestamp_ms);
    return 0;
}

static int
record_clear(RecordObject *self)
{
    Py_CLEAR(self->value);
    Py_CLEAR(self->key);
    Py_CLEAR(self->headers);
    Py_CLEAR(self->timestamp_ms);
    return 0;
}

static void
record_dealloc(RecordObject *self)
{
    /* A subclass's instance comes through subtype_dealloc, which releases its type. */
    PyObject_GC_UnTrack(self);
    record_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Fields stay settable as the dataclass's were; a record the collector does not scan (built
 * atomic, see ``record_make``) is tracked again once a field holds an object that could lead
 * back to it, so a cycle made later is still collected. */
static int
record_setattro(PyObject *self, PyObject *name, PyObject *value)
{
    int result = PyObject_GenericSetAttr(self, name, value);
    if (result == 0 && value != NULL && !PyObject_GC_IsTracked(self) && !is_atomic(value)) {
        PyObject_GC_Track(self);
    }
    return result;
}

/* The four fields as a new tuple, or NULL (AttributeError) when one was deleted. */
static PyObject *
record_astuple(PyObject *self)
{
    PyObject *fields = PyTuple_New(F_COUNT);
    if (fields == NULL) {
        return NULL;
    }
    for (int f = 0; f < F_COUNT; f++) {
        PyObject *item = RECORD_FIELD(self, f);
        if (item == NULL) {
            Py_DECREF(fields);
            PyErr_Format(PyExc_AttributeError, "'Record' object has no attribute '%s'",
                         field_names[f]);
            return NULL;
        }
        PyTuple_SET_ITEM(fields, f, Py_NewRef(item));
    }
    return fields;
}

static PyObject *
record_richcompare(PyObject *self, PyObject *other, int op)
{
    /* As the dataclass: equal by value to an object of the very same class. */
    if ((op != Py_EQ && op != Py_NE) || Py_TYPE(other) != Py_TYPE(self)) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *mine = record_astuple(self);
    PyObject *theirs = mine == NULL ? NULL : record_astuple(other);
    PyObject *result = theirs == NULL ? NULL : PyObject_RichCompare(mine, theirs, op);
    Py_XDECREF(mine);
    Py_XDECREF(theirs);
    return result;
}

static Py_hash_t
record_hash(PyObject *self)
{
    PyObject *fields = record_astuple(self); /* hash((value, key, headers, timestamp_ms)) */
    if (fields == NULL) {
        return -1;
    }
    Py_hash_t hash = PyObject_Hash(fields);
    Py_DECREF(fields);
    return hash;
}

static PyObject *
record_repr(PyObject *self)
{
    int entered = Py_ReprEnter(self);
    if (entered != 0) {
        return entered > 0 ? PyUnicode_FromString("...") : NULL;
    }
    PyObject *fields = record_astuple(self);
    PyObject *repr = NULL;
    if (fields != NULL) {
        PyObject *name = PyType_GetQualName(Py_TYPE(self));
        if (name != NULL) {
            repr = PyUnicode_FromFormat("%U(value=%R, key=%R, headers=%R, timestamp_ms=%R)", name,
                                        PyTuple_GET_ITEM(fields, 0), PyTuple_GET_ITEM(fields, 1),
                                        PyTuple_GET_ITEM(fields, 2), PyTuple_GET_ITEM(fields, 3));
            Py_DECREF(name);
        }
        Py_DECREF(fields);
    }
    Py_ReprLeave(self);
    return repr;
}

static Py_ssize_t
length_or_zero(PyObject *item)
{
    if (item == Py_None) {
        return 0;
    }
    int truth = PyObject_IsTrue(item); /* ``item or b""`` */
    return truth < 0 ? -1 : truth == 0 ? 0 : PyObject_Length(item);
}

/* Payload size for batching limits and RecordTooLarge checks, or -1 with an exception, of
 * fields the caller holds (a ``__bool__`` or ``__len__`` may change the record meanwhile). */
static Py_ssize_t
payload_size(PyObject *key_item, PyObject *value_item, PyObject *headers_item)
{
    Py_ssize_t key = length_or_zero(key_item);
    Py_ssize_t value = key < 0 ? -1 : length_or_zero(value_item);
    if (value < 0) {
        return -1;
    }
    Py_ssize_t size = key + value;
    if (headers_item == empty_tuple) {
        return size;
    }
    PyObject *headers = PySequence_Fast(headers_item, "Record.headers must be a sequence");
    if (headers == NULL) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(headers); i++) {
        PyObject *header = PySequence_Fast_GET_ITEM(headers, i);
        PyObject *pair = PySequence_Fast(header, "a header must be a (name, value) pair");
        if (pair == NULL) {
            Py_DECREF(headers);
            return -1;
        }
        if (PySequence_Fast_GET_SIZE(pair) != 2) {
            Py_DECREF(pair);
            Py_DECREF(headers);
            PyErr_SetString(PyExc_ValueError, "a header must be a (name, value) pair");
            return -1;
        }
        Py_ssize_t name = PyObject_Length(PySequence_Fast_GET_ITEM(pair, 0));
        Py_ssize_t data = name < 0 ? -1 : PyObject_Length(PySequence_Fast_GET_ITEM(pair, 1));
        Py_DECREF(pair);
        if (data < 0) {
            Py_DECREF(headers);
            return -1;
        }
        size += name + data;
    }
    Py_DECREF(headers);
    return size;
}

/* Payload size for batching limits and RecordTooLarge checks, or -1 with an exception. */
static Py_ssize_t
record_size(RecordObject *self)
{
    if (self->key == NULL || self->value == NULL || self->headers == NULL) {
        PyObject *fields = record_astuple((PyObject *)self);
        Py_XDECREF(fields);
        return -1;
    }
    PyObject *key = Py_NewRef(self->key);
    PyObject *value = Py_NewRef(self->value);
    PyObject *headers = Py_NewRef(self->headers);
    Py_ssize_t size = payload_size(key, value, headers);
    Py_DECREF(key);
    Py_DECREF(value);
    Py_DECREF(headers);
    return size;
}

static PyObject *
record_size_bytes(PyObject *self, PyObject *unused)
{
    Py_ssize_t size = record_size((RecordObject *)self);
    return size < 0 ? NULL : PyLong_FromSsize_t(size);
}

static PyObject *
record_reduce(PyObject *self, PyObject *unused)
{
    PyObject *fields = record_astuple(self);
    if (fields == NULL) {
        return NULL;
    }
    PyObject *reduced = PyTuple_Pack(2, (PyObject *)Py_TYPE(self), fields);
    Py_DECREF(fields);
    return reduced;
}

static PyMethodDef record_methods[] = {
    {"size_bytes", record_size_bytes, METH_NOARGS,
     "size_bytes() -> int: payload size (key, value, header names and values) used for "
     "batching limits and RecordTooLarge checks."},
    {"__reduce__", record_reduce, METH_NOARGS, "Pickled as Record(value, key, headers, ts)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef record_members[] = {
    {"value", T_OBJECT_EX, offsetof(RecordObject, value), 0, "The payload: bytes or None."},
    {"key", T_OBJECT_EX, offsetof(RecordObject, key), 0, "bytes or None (no key)."},
    {"headers", T_OBJECT_EX, offsetof(RecordObject, headers), 0, "(name, value) pairs."},
    {"timestamp_ms", T_OBJECT_EX, offsetof(RecordObject, timestamp_ms), 0,
     "Milliseconds since the epoch; None: the producer stamps the send time."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject RecordType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "xinfra.model.Record",
    .tp_basicsize = sizeof(RecordObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Record(value, key=None, headers=(), timestamp_ms=None)\n--\n\n"
              "What a producer writes: key, value and header values are opaque bytes.",
    .tp_new = record_new,
    .tp_vectorcall = record_vectorcall,
    .tp_dealloc = (destructor)record_dealloc,
    .tp_traverse = (traverseproc)record_traverse,
    .tp_clear = (inquiry)record_clear,
    .tp_richcompare = record_richcompare,
    .tp_hash = record_hash,
    .tp_repr = record_repr,
    .tp_methods = record_methods,
    .tp_members = record_members,
    .tp_setattro = record_setattro,
};

/* -- the producer's pass ------------------------------------------------------------------ */

/* A producer's ``send`` takes every record twice: once to check the call (sizes, the largest,
 * whether all are plain) before anything is queued, once to hand each record to
 * ``Producer.produce``.  As two Python loops they took ~1.1k instructions per record (callgrind,
 * bench produce loop: 12.3k per record, 11.2k with these, a bare confluent-kafka loop 10.5k);
 * here each is one C loop reading the C ``Record``'s fields directly.  Anything else that has the four fields (a subclass of
 * Record, a duck) takes the generic attribute path with the same results.
 *
 * Every record is held (a strong reference) while it is read and its fields while they are
 * passed on: a ``__len__``, ``__bool__``, attribute or ``produce`` call may run Python code that
 * changes the sequence or the record, so items are fetched again at each step, never through a
 * saved item array. */

static PyObject *size_bytes_string = NULL; /* interned "size_bytes" */
static PyObject *records_queued_string = NULL; /* interned "records_queued" */
static PyObject *zero = NULL;

/* ``0 if item is None else len(item)``, or -1 with an exception. */
static inline Py_ssize_t
length_or_none(PyObject *item)
{
    if (item == Py_None) {
        return 0;
    }
    if (PyBytes_CheckExact(item)) {
        return PyBytes_GET_SIZE(item);
    }
    return PyObject_Length(item);
}

/* The four fields of a record as new references in fields[], or -1 with an exception. */
static int
fields_of_record(PyObject *record, PyObject *fields[F_COUNT])
{
    if (Py_IS_TYPE(record, &RecordType)) {
        for (int f = 0; f < F_COUNT; f++) {
            PyObject *item = RECORD_FIELD(record, f);
            if (item == NULL) {
                PyErr_Format(PyExc_AttributeError, "'Record' object has no attribute '%s'",
                             field_names[f]);
                while (--f >= 0) {
                    Py_CLEAR(fields[f]);
                }
                return -1;
            }
            fields[f] = Py_NewRef(item);
        }
        return 0;
    }
    for (int f = 0; f < F_COUNT; f++) {
        fields[f] = PyObject_GetAttr(record, field_strings[f]);
        if (fields[f] == NULL) {
            while (--f >= 0) {
                Py_CLEAR(fields[f]);
            }
            return -1;
        }
    }
    return 0;
}

static inline void
release_fields(PyObject *fields[F_COUNT])
{
    for (int f = 0; f < F_COUNT; f++) {
        Py_CLEAR(fields[f]);
    }
}

/* Whether a record with these fields is plain (no headers, no timestamp): 1, 0, or -1. */
static inline int
is_plain(PyObject *fields[F_COUNT])
{
    PyObject *headers = fields[F_HEADERS];
    if (headers != empty_tuple) {
        int truth = PyObject_IsTrue(headers);
        if (truth != 0) {
            return truth < 0 ? -1 : 0;
        }
    }
    return fields[F_TIMESTAMP] == Py_None;
}

/* The size of one record, as ``send`` counts it, or -1 with an exception; *plain is set. */
static Py_ssize_t
size_of(PyObject *record, int *plain)
{
    PyObject *fields[F_COUNT] = {NULL, NULL, NULL, NULL};
    if (fields_of_record(record, fields) < 0) {
        return -1;
    }
    Py_ssize_t size = -1;
    int record_plain = is_plain(fields);
    if (record_plain > 0) {
        Py_ssize_t value = length_or_none(fields[F_VALUE]);
        Py_ssize_t key = value < 0 ? -1 : length_or_none(fields[F_KEY]);
        size = key < 0 ? -1 : value + key;
    }
    else if (record_plain == 0) {
        *plain = 0;
        if (Py_IS_TYPE(record, &RecordType)) {
            size = payload_size(fields[F_KEY], fields[F_VALUE], fields[F_HEADERS]);
        }
        else {
            PyObject *sized = PyObject_CallMethodNoArgs(record, size_bytes_string);
            if (sized != NULL) {
                size = PyLong_AsSsize_t(sized);
                Py_DECREF(sized);
                if (size < 0 && !PyErr_Occurred()) {
                    PyErr_Format(PyExc_ValueError, "%s.size_bytes() returned %zd, a negative size",
                                 Py_TYPE(record)->tp_name, size);
                    size = -1;
                }
            }
        }
    }
    release_fields(fields);
    return size;
}

static PyObject *
record_sizes(PyObject *module, PyObject *records)
{
    PyObject *sequence = PySequence_Fast(records, "record_sizes: records must be a sequence");
    if (sequence == NULL) {
        return NULL;
    }
    Py_ssize_t total = 0, largest = 0;
    int plain = 1;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(sequence); i++) {
        PyObject *record = Py_NewRef(PySequence_Fast_GET_ITEM(sequence, i));
        Py_ssize_t size = size_of(record, &plain);
        Py_DECREF(record);
        if (size < 0) {
            Py_DECREF(sequence);
            return NULL;
        }
        if (size > PY_SSIZE_T_MAX - total) {
            Py_DECREF(sequence);
            PyErr_SetString(PyExc_OverflowError, "record_sizes: the records' sizes overflow");
            return NULL;
        }
        total += size;
        if (size > largest) {
            largest = size;
        }
    }
    Py_DECREF(sequence);
    PyObject *result = PyTuple_New(3);
    if (result == NULL) {
        return NULL;
    }
    PyObject *item;
    if ((item = PyLong_FromSsize_t(total)) == NULL) {
        goto error;
    }
    PyTuple_SET_ITEM(result, 0, item);
    if ((item = PyLong_FromSsize_t(largest)) == NULL) {
        goto error;
    }
    PyTuple_SET_ITEM(result, 1, item);
    PyTuple_SET_ITEM(result, 2, Py_NewRef(plain ? Py_True : Py_False));
    return result;
error:
    Py_DECREF(result); /* items not yet set are NULL: the tuple's dealloc skips them */
    return NULL;
}

/* The exception being raised gets ``records_queued = queued``, then propagates unchanged. */
static void
note_queued(Py_ssize_t queued)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    if (type == NULL) {
        return;
    }
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback != NULL && value != NULL) {
        PyException_SetTraceback(value, traceback);
    }
    PyObject *count = PyLong_FromSsize_t(queued);
    if (count == NULL || value == NULL
        || PyObject_SetAttr(value, records_queued_string, count) < 0) {
        /* Cannot say: the caller's default applies.  The original exception matters more. */
        PyErr_Clear();
    }
    Py_XDECREF(count);
    PyErr_Restore(type, value, traceback);
}

static PyObject *
produce_records(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("produce_records takes (produce, topic, partition, on_delivery, records, "
                    "plain)",
                    nargs, 6) < 0) {
        return NULL;
    }
    PyObject *produce = args[0];
    int plain = PyObject_IsTrue(args[5]);
    if (plain < 0) {
        return NULL;
    }
    PyObject *sequence = PySequence_Fast(args[4], "produce_records: records must be a sequence");
    if (sequence == NULL) {
        return NULL;
    }
    /* (topic, value, key, partition, on_delivery, callback, timestamp, headers): positional,
     * as keyword parsing would cost a third of the call. */
    PyObject *stack[8] = {args[1], NULL, NULL, args[2], args[3], Py_None, NULL, NULL};
    Py_ssize_t queued = 0;
    for (; queued < PySequence_Fast_GET_SIZE(sequence); queued++) {
        PyObject *record = Py_NewRef(PySequence_Fast_GET_ITEM(sequence, queued));
        PyObject *fields[F_COUNT] = {NULL, NULL, NULL, NULL};
        int got = fields_of_record(record, fields);
        Py_DECREF(record);
        if (got < 0) {
            goto error;
        }
        stack[1] = fields[F_VALUE];
        stack[2] = fields[F_KEY];
        PyObject *done;
        if (plain) { /* librdkafka stamps the send time, as a None timestamp asks */
            done = PyObject_Vectorcall(produce, stack, 5, NULL);
        }
        else {
            PyObject *timestamp = fields[F_TIMESTAMP];
            int truth = PyObject_IsTrue(timestamp); /* ``timestamp_ms or 0`` */
            PyObject *headers = NULL; /* ``list(headers) if headers else None`` */
            int has_headers = truth < 0 ? -1 : PyObject_IsTrue(fields[F_HEADERS]);
            if (has_headers > 0) {
                headers = PySequence_List(fields[F_HEADERS]);
            }
            if (has_headers < 0 || (has_headers > 0 && headers == NULL)) {
                release_fields(fields);
                goto error;
            }
            stack[6] = truth ? timestamp : zero;
            stack[7] = headers != NULL ? headers : Py_None;
            done = PyObject_Vectorcall(produce, stack, 8, NULL);
            Py_XDECREF(headers);
        }
        release_fields(fields);
        if (done == NULL) {
            goto error;
        }
        Py_DECREF(done);
    }
    Py_DECREF(sequence);
    return PyLong_FromSsize_t(queued);
error:
    Py_DECREF(sequence);
    note_queued(queued);
    return NULL;
}

/* -- the module --------------------------------------------------------------------------- */

static PyObject *
record_fields(PyObject *module, PyObject *fields)
{
    if (PyDict_SetItemString(RecordType.tp_dict, "__dataclass_fields__", fields) < 0) {
        return NULL;
    }
    PyType_Modified(&RecordType);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"fast_fields", fast_fields, METH_O,
     "fast_fields(cls) -> cls: a named tuple's fields as member descriptors, which CPython "
     "3.11 specialises (its _tuplegetter it does not). Every instance must hold all fields."},
    {"kafka_records", (PyCFunction)(void (*)(void))kafka_records, METH_FASTCALL,
     "kafka_records(messages, cls, prefix) -> (records, failed): cls(*prefix, partition, "
     "offset, timestamp_ms, key, value, headers) of each message without an error, in order, "
     "and the messages carrying an error."},
    {"record_fields", record_fields, METH_O,
     "record_fields(fields): Record's __dataclass_fields__, so the dataclasses functions "
     "(replace, fields, asdict) take a Record as they took the dataclass it replaces."},
    {"record_sizes", record_sizes, METH_O,
     "record_sizes(records) -> (total, largest, plain): the sizes send checks before queueing "
     "(size_bytes() for a record with headers or a timestamp, key and value lengths otherwise) "
     "and whether every record is plain (no headers, no timestamp)."},
    {"produce_records", (PyCFunction)(void (*)(void))produce_records, METH_FASTCALL,
     "produce_records(produce, topic, partition, on_delivery, records, plain) -> int: "
     "produce(topic, value, key, partition, on_delivery) per record (not plain: also None, "
     "timestamp_ms or 0, list(headers) or None); the count queued. If a call raises, the "
     "exception propagates with records_queued set to the count queued before it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "xinfra._records",
    .m_doc = "The per-record work of the read and produce paths in C: see xinfra/_records.c.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__records(void)
{
    PyObject *collections = PyImport_ImportModule("_collections");
    if (collections == NULL) {
        return NULL;
    }
    Py_XSETREF(tuplegetter_type, PyObject_GetAttrString(collections, "_tuplegetter"));
    Py_DECREF(collections);
    if (tuplegetter_type == NULL) {
        return NULL;
    }
    empty_tuple = PyTuple_New(0);
    if (empty_tuple == NULL) {
        return NULL;
    }
    for (int f = 0; f < F_COUNT; f++) {
        field_strings[f] = PyUnicode_InternFromString(field_names[f]);
        if (field_strings[f] == NULL) {
            return NULL;
        }
    }
    size_bytes_string = PyUnicode_InternFromString("size_bytes");
    records_queued_string = PyUnicode_InternFromString("records_queued");
    zero = PyLong_FromLong(0);
    if (size_bytes_string == NULL || records_queued_string == NULL || zero == NULL) {
        return NULL;
    }
    if (PyType_Ready(&RecordType) < 0) {
        return NULL;
    }
    PyObject *match_args = PyTuple_New(F_COUNT);
    if (match_args == NULL) {
        return NULL;
    }
    for (int f = 0; f < F_COUNT; f++) {
        PyTuple_SET_ITEM(match_args, f, Py_NewRef(field_strings[f]));
    }
    int set = PyDict_SetItemString(RecordType.tp_dict, "__match_args__", match_args);
    Py_DECREF(match_args);
    if (set < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(module, "Record", (PyObject *)&RecordType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
