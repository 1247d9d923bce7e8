/* The verbs library's compiled data path: post a list of send WRs, decode CQEs.
 *
 * The ring and WQE declarations (wire/shm.py's CDEF) are put in front of
 * this file when it is built, so both sides use one layout.
 *
 * post_send writes WQEs only for work requests it is sure of: every field
 * an int in the range the Python path packs, the SGE list a list, the ring
 * not full.  At the first work request it is not sure of it stops, and the
 * Python path takes that one (and raises the exact error, or posts it), so
 * errors stay per work request and are raised in one place.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

static PyObject *S_wr_id, *S_opcode, *S_send_flags, *S_num_sge, *S_imm_data, *S_rkey, *S_remote_addr,
    *S_compare_add, *S_swap, *S_sg, *S_next_wr, *S_addr, *S_length, *S_lkey;

/* `o.name` as a 64-bit value: masked from any int (as `& 0xFFFF...`) if `masked`,
 * else an int in [0, limit] (what struct packs unmasked); -1 otherwise. */
static int get_int(PyObject *o, PyObject *name, int masked, uint64_t limit, uint64_t *out)
{
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL) {
        PyErr_Clear();
        return -1;
    }
    int ok = PyLong_Check(v);
    if (ok) /* unmasked, a negative or too large value raises OverflowError */
        *out = masked ? PyLong_AsUnsignedLongLongMask(v) : PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    if (!ok || PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return *out <= limit ? 0 : -1;
}

#define get_masked(o, name, out) get_int(o, name, 1, UINT64_MAX, out)
#define get_ranged(o, name, limit, out) get_int(o, name, 0, limit, out)

typedef struct {
    uint8_t *slots;
    uint32_t prod, mask, room;
    uint32_t max_sge, max_inline, inline_flag;
} send_queue;

/* SGEs 0..n-1 of `sg` into the WQE's SGE array. */
static int put_sges(const send_queue *q, struct uv_send_wqe *w, PyObject *sg, uint64_t n)
{
    if (n > q->max_sge || n > 16)
        return -1;
    for (uint64_t i = 0; i < n; i++) {
        PyObject *s = PyList_GET_ITEM(sg, (Py_ssize_t)i);
        uint64_t addr, length, lkey;
        if (get_ranged(s, S_addr, UINT64_MAX, &addr) || get_ranged(s, S_length, UINT32_MAX, &length)
            || get_ranged(s, S_lkey, UINT32_MAX, &lkey))
            return -1;
        w->sg[i].addr = addr;
        w->sg[i].length = (uint32_t)length;
        w->sg[i].lkey = (uint32_t)lkey;
    }
    return 0;
}

/* The bytes SGEs 0..n-1 of `sg` name, gathered into the WQE; their total length, or -1. */
static int64_t put_inline(const send_queue *q, struct uv_send_wqe *w, PyObject *sg, uint64_t n)
{
    uint64_t addr[16], length[16], total = 0;
    uint64_t room = q->max_inline < sizeof w->inline_data ? q->max_inline : sizeof w->inline_data;
    if (n > 16)
        return -1;
    for (uint64_t i = 0; i < n; i++) {
        PyObject *s = PyList_GET_ITEM(sg, (Py_ssize_t)i);
        if (get_ranged(s, S_addr, UINT64_MAX, &addr[i]) || get_ranged(s, S_length, room, &length[i]))
            return -1;
        total += length[i];
        if (total > room)
            return -1;
    }
    uint8_t *to = w->inline_data;
    for (uint64_t i = 0; i < n; i++) {
        memcpy(to, (const void *)(uintptr_t)addr[i], length[i]); /* the application's own memory */
        to += length[i];
    }
    return (int64_t)total;
}

/* One send WR into the next slot: 0, or -1 if the Python path must take it. */
static int put_send_wr(send_queue *q, PyObject *wr)
{
    uint64_t wr_id, raddr, opcode, flags, n, imm, rkey, cadd, swap;
    if (q->room == 0)
        return -1;
    if (get_masked(wr, S_wr_id, &wr_id) || get_ranged(wr, S_remote_addr, UINT64_MAX, &raddr)
        || get_ranged(wr, S_opcode, UINT32_MAX, &opcode) || get_ranged(wr, S_send_flags, UINT32_MAX, &flags)
        || get_ranged(wr, S_num_sge, UINT32_MAX, &n) || get_masked(wr, S_imm_data, &imm)
        || get_ranged(wr, S_rkey, UINT32_MAX, &rkey) || get_masked(wr, S_compare_add, &cadd)
        || get_masked(wr, S_swap, &swap))
        return -1;
    PyObject *sg = PyObject_GetAttr(wr, S_sg);
    if (sg == NULL) {
        PyErr_Clear();
        return -1;
    }
    struct uv_send_wqe *w = (struct uv_send_wqe *)(q->slots + (size_t)(q->prod & q->mask) * sizeof *w);
    int64_t inline_len = 0;
    int rc = -1;
    if (PyList_CheckExact(sg) && n <= (uint64_t)PyList_GET_SIZE(sg)) {
        if (flags & q->inline_flag) {
            inline_len = put_inline(q, w, sg, n);
            rc = inline_len < 0 ? -1 : 0;
        } else {
            rc = put_sges(q, w, sg, n);
        }
    }
    Py_DECREF(sg);
    if (rc)
        return -1;
    w->wr_id = wr_id;
    w->remote_addr = raddr;
    w->opcode = (uint32_t)opcode;
    w->send_flags = (uint32_t)flags;
    w->num_sge = (flags & q->inline_flag) ? 0 : (uint32_t)n;
    w->imm_data = (uint32_t)imm;
    w->rkey = (uint32_t)rkey;
    w->inline_len = (uint32_t)inline_len;
    w->compare_add = cadd;
    w->swap = swap;
    q->prod++;
    q->room--;
    return 0;
}

/* Make the WQEs written visible (the producer index after the slots), then
 * fence: the caller reads need_wakeup next, and the daemon must not miss
 * the index while we miss its flag. */
static void publish(struct uv_ring_hdr *hdr, uint32_t prod)
{
    __atomic_store_n(&hdr->producer, prod, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

static PyObject *post_send(PyObject *self, PyObject *args)
{
    PyObject *first;
    unsigned long long hdr_addr, slots_addr;
    send_queue q;
    unsigned int entries;
    if (!PyArg_ParseTuple(args, "OI(KKIIIII)", &first, &q.prod, &hdr_addr, &slots_addr, &q.mask, &entries,
                          &q.max_sge, &q.max_inline, &q.inline_flag))
        return NULL;
    struct uv_ring_hdr *hdr = (struct uv_ring_hdr *)(uintptr_t)hdr_addr;
    uint32_t used = q.prod - __atomic_load_n(&hdr->consumer, __ATOMIC_ACQUIRE);
    q.room = used > entries ? 0 : entries - used; /* a lying consumer: the Python path says so */
    q.slots = (uint8_t *)(uintptr_t)slots_addr;
    uint32_t start = q.prod;
    PyObject *rest;
    if (PyList_CheckExact(first) || PyTuple_CheckExact(first)) {
        Py_ssize_t i = 0, len = PySequence_Fast_GET_SIZE(first);
        while (i < len && put_send_wr(&q, PySequence_Fast_GET_ITEM(first, i)) == 0)
            i++;
        if (i < len) {
            rest = PyLong_FromSsize_t(i);
        } else {
            Py_INCREF(Py_None);
            rest = Py_None;
        }
    } else {
        /* next_wr is read before a WR is written: where it is missing, the
         * Python path posts that WR and then raises, as it would alone */
        Py_INCREF(first);
        rest = first;
        while (rest != Py_None) {
            PyObject *next = PyObject_GetAttr(rest, S_next_wr);
            if (next == NULL) {
                PyErr_Clear();
                break;
            }
            if (put_send_wr(&q, rest)) {
                Py_DECREF(next);
                break;
            }
            Py_DECREF(rest);
            rest = next;
        }
    }
    uint32_t posted = q.prod - start;
    if (posted)
        publish(hdr, q.prod);
    if (rest == NULL)
        return NULL;
    return Py_BuildValue("IN", posted, rest);
}

/* WC objects are built here: its type and where each field's slot is. */
static PyTypeObject *wc_type;
static Py_ssize_t wc_off[13];
static PyObject *wc_status, *wc_opcode, *wc_flags; /* value -> enum member */

enum { F_WR_ID, F_STATUS, F_OPCODE, F_VENDOR_ERR, F_BYTE_LEN, F_QP_NUM, F_SRC_QP, F_IMM_DATA, F_WC_FLAGS,
       F_PKEY_INDEX, F_SLID, F_SL, F_DLID_PATH_BITS };

static PyObject *setup_wc(PyObject *self, PyObject *args)
{
    PyObject *type, *names;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!", &PyType_Type, &type, &PyTuple_Type, &names, &PyDict_Type, &wc_status,
                          &PyDict_Type, &wc_opcode, &PyDict_Type, &wc_flags))
        return NULL;
    if (PyTuple_GET_SIZE(names) != 13) {
        PyErr_SetString(PyExc_ValueError, "setup_wc needs the 13 WC fields");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < 13; i++) {
        PyObject *d = PyDict_GetItemWithError(((PyTypeObject *)type)->tp_dict, PyTuple_GET_ITEM(names, i));
        if (d == NULL || Py_TYPE(d) != &PyMemberDescr_Type
            || ((PyMemberDescrObject *)d)->d_member->type != T_OBJECT_EX) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "a WC field is not a __slots__ member");
            return NULL;
        }
        wc_off[i] = ((PyMemberDescrObject *)d)->d_member->offset;
    }
    Py_INCREF(type);
    Py_XSETREF(wc_type, (PyTypeObject *)type);
    Py_INCREF(wc_status);
    Py_INCREF(wc_opcode);
    Py_INCREF(wc_flags);
    Py_RETURN_NONE;
}

/* `map[v]` if there, else the int `v` (as `dict.get(v, v)`). */
static PyObject *named(PyObject *map, uint32_t v)
{
    PyObject *key = PyLong_FromUnsignedLong(v);
    if (key == NULL)
        return NULL;
    PyObject *m = PyDict_GetItemWithError(map, key);
    if (m == NULL) {
        if (PyErr_Occurred()) {
            Py_DECREF(key);
            return NULL;
        }
        return key;
    }
    Py_DECREF(key);
    Py_INCREF(m);
    return m;
}

static PyObject *new_wc(const struct uv_cqe *c)
{
    PyObject *v[13];
    v[F_WR_ID] = PyLong_FromUnsignedLongLong(c->wr_id);
    v[F_STATUS] = named(wc_status, c->status);
    v[F_OPCODE] = named(wc_opcode, c->opcode);
    v[F_VENDOR_ERR] = PyLong_FromUnsignedLong(c->vendor_err);
    v[F_BYTE_LEN] = PyLong_FromUnsignedLong(c->byte_len);
    v[F_QP_NUM] = PyLong_FromUnsignedLong(c->qp_num);
    v[F_SRC_QP] = PyLong_FromUnsignedLong(c->src_qp);
    v[F_IMM_DATA] = PyLong_FromUnsignedLong(c->imm_data);
    v[F_WC_FLAGS] = named(wc_flags, c->wc_flags);
    for (int i = F_PKEY_INDEX; i <= F_DLID_PATH_BITS; i++)
        v[i] = PyLong_FromLong(0);
    PyObject *wc = wc_type->tp_alloc(wc_type, 0);
    for (int i = 0; i < 13; i++) {
        if (v[i] == NULL || wc == NULL) {
            for (int j = 0; j < 13; j++)
                Py_XDECREF(v[j]);
            Py_XDECREF(wc);
            return NULL;
        }
    }
    for (int i = 0; i < 13; i++)
        *(PyObject **)((char *)wc + wc_off[i]) = v[i]; /* what the slot's descriptor does */
    return wc;
}

/* poll(slots_addr, cons, mask, n): WC objects for the n CQEs from index cons. */
static PyObject *poll(PyObject *self, PyObject *args)
{
    unsigned long long slots_addr;
    unsigned int cons, mask, n;
    if (!PyArg_ParseTuple(args, "KIII", &slots_addr, &cons, &mask, &n))
        return NULL;
    if (wc_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "setup_wc first");
        return NULL;
    }
    const struct uv_cqe *slots = (const struct uv_cqe *)(uintptr_t)slots_addr;
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the caller read the producer index: CQEs after it */
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (unsigned int i = 0; i < n; i++) {
        PyObject *wc = new_wc(&slots[(cons + i) & mask]);
        if (wc == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, wc);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"post_send", post_send, METH_VARARGS,
     "post_send(wrs, prod, (hdr_addr, slots_addr, mask, entries, max_sge, max_inline, inline_flag))"
     " -> (posted, rest): write and publish WQEs up to the first WR the Python path must take:"
     " rest is that WR (of a chain), its index (in a list or tuple), or None"},
    {"setup_wc", setup_wc, METH_VARARGS, "setup_wc(WC, field_names, status, opcode, flags)"},
    {"poll", poll, METH_VARARGS, "poll(slots_addr, cons, mask, n) -> [WC]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, FASTPATH_NAME, NULL, -1, methods};

PyMODINIT_FUNC FASTPATH_INIT(void)
{
#define INTERN(x) if ((S_##x = PyUnicode_InternFromString(#x)) == NULL) return NULL
    INTERN(wr_id); INTERN(opcode); INTERN(send_flags); INTERN(num_sge); INTERN(imm_data); INTERN(rkey);
    INTERN(remote_addr); INTERN(compare_add); INTERN(swap); INTERN(sg); INTERN(next_wr); INTERN(addr);
    INTERN(length); INTERN(lkey);
#undef INTERN
    return PyModule_Create(&module);
}
