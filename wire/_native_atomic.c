/* The atomic batch (see wire/native.py and daemon/atombatch.py): a GRO
 * batch of Atomic Requests applied and answered in one call.
 *
 * Compiled after _native.c and _native_batch.c, in the same unit (it uses
 * be32, be64, put32, put64).  The receive lane has checked the datagrams
 * (link header, CRC, envelope, DDP header, queue 1, MSN by MSN, the body's
 * size); this call reads each body, and while it names the one region the
 * caller checked (its STag, in bounds, 8-byte aligned: RFC 7306 §5.2) with
 * a known operation, applies it to its word in host byte order, as the
 * Python path does (daemon/responder.py apply_atomic), and builds its
 * Atomic Response (RFC 7306 §5.3) from the header Python packed, in the
 * place its link packet will have (transport/link.py run_slots).  It stops
 * at the first request that differs; that one and everything unusual
 * (errors included) is the Python path's.
 */

enum {
    AREQ_WORD0 = 0,
    AREQ_REQ_ID = 4,
    AREQ_STAG = 8,
    AREQ_TO = 12,
    AREQ_ADD_SWAP = 20,
    AREQ_ADD_SWAP_MASK = 28,
    AREQ_COMPARE = 36,
    AREQ_COMPARE_MASK = 44,
    WQE_COMPARE_ADD = 40, /* struct uv_send_wqe's atomic operands */
    WQE_SWAP = 48,
    AOP_FETCH_ADD = 0,
    AOP_SWAP = 1,
    AOP_CMP_SWAP = 2,
};

typedef struct {
    uint32_t stag;   /* the region every request must name */
    uint64_t base;   /* the TO of its first byte (0 for a zero-based one) */
    uint64_t len;    /* its length */
    uint8_t hdr[32]; /* an Atomic Response's segment header, Python-packed */
    uint32_t prefix; /* its bytes */
    uint32_t msn;    /* the first response's MSN (queue 3) */
} udpv_atomics;

static uint64_t udpv_masked_add(uint64_t a, uint64_t b, uint64_t mask) {
    /* a set mask bit ends a field: no carry leaves it */
    uint64_t out = 0, carry = 0;
    for (int bit = 0; bit < 64; bit++) {
        uint64_t s = ((a >> bit) & 1) + ((b >> bit) & 1) + carry;
        out |= (s & 1) << bit;
        carry = (mask >> bit) & 1 ? 0 : s >> 1;
    }
    return out;
}

size_t udpv_atomic_batch(udpv_atomics *a, const uint8_t *buf, size_t k, size_t seg, uint8_t *mem, uint8_t *out,
                         size_t spacing) {
    size_t i;
    for (i = 0; i < k; i++) {
        const uint8_t *q = buf + i * seg;
        uint32_t word0 = be32(q + AREQ_WORD0);
        uint64_t to = be64(q + AREQ_TO);
        if (word0 > AOP_CMP_SWAP || be32(q + AREQ_STAG) != a->stag) break;
        if (to & 7 || to < a->base || a->len < 8 || to - a->base > a->len - 8) break;
        uint8_t *w = mem + (to - a->base);
        uint64_t orig, val;
        memcpy(&orig, w, sizeof orig);
        uint64_t data = be64(q + AREQ_ADD_SWAP), mask = be64(q + AREQ_ADD_SWAP_MASK);
        if (word0 == AOP_FETCH_ADD) {
            val = mask ? udpv_masked_add(orig, data, mask) : orig + data;
        } else if (word0 == AOP_CMP_SWAP && ((orig ^ be64(q + AREQ_COMPARE)) & be64(q + AREQ_COMPARE_MASK))) {
            val = orig; /* compare failed: the word stays, the original value still returns */
        } else {
            val = (orig & ~mask) | (data & mask);
        }
        memcpy(w, &val, sizeof val);
        uint8_t *b = out + i * spacing;
        memcpy(b, a->hdr, a->prefix);
        put32(b + UNTAGGED_MSN_AT, a->msn + (uint32_t)i);
        put32(b + a->prefix, be32(q + AREQ_REQ_ID));
        put64(b + a->prefix + 4, orig);
    }
    return i;
}

/* The requester's side: the next atomic WQEs of an SQ that are alike (one
 * opcode, no flag but signaled, one SGE of 8 bytes in the one local region
 * the caller checked), taken in one call and built into Atomic Requests
 * (RFC 7306 §5.2) in run slots, as udpv_tx_take_small builds Writes.  The
 * WQE is in the application's memory: each field is read once, and what
 * was read is what the caller's records get. */

typedef struct {
    const uint8_t *slots;
    uint32_t cons, mask, entry_size, sg_at, avail;
    uint32_t opcode;        /* the WR opcode every WQE must have */
    uint32_t flags_ok, signaled_flag, sig_all;
    uint32_t lkey;          /* the local region every sink must lie in */
    uint64_t addr, len;
    uint8_t hdr[32];        /* an Atomic Request's segment header, Python-packed */
    uint32_t prefix, msn, req_id;
    uint32_t aop;           /* RFC 7306's operation code */
    uint64_t *wr_id, *raddr, *sink_off;
    uint32_t *rkey;
    uint8_t *signaled;
} udpv_atomic_wqes;

size_t udpv_atomic_take(udpv_atomic_wqes *t, uint8_t *out, size_t max, size_t spacing) {
    size_t k;
    if (max > t->avail) max = t->avail;
    for (k = 0; k < max; k++) {
        const uint8_t *w = t->slots + (size_t)((t->cons + (uint32_t)k) & t->mask) * t->entry_size;
        uint8_t head[56], sge[16];
        memcpy(head, w, sizeof head); /* once: the application may write the slot meanwhile */
        memcpy(sge, w + t->sg_at, sizeof sge);
        uint32_t flags = ld32(head + WQE_FLAGS);
        uint64_t addr = ld64(sge);
        if (ld32(head + WQE_OPCODE) != t->opcode || flags & ~t->flags_ok || ld32(head + WQE_NUM_SGE) != 1) break;
        if (ld32(sge + SGE_LENGTH) != 8 || ld32(sge + SGE_LKEY) != t->lkey) break;
        if (addr < t->addr || t->len < 8 || addr - t->addr > t->len - 8) break;
        uint64_t raddr = ld64(head + WQE_RADDR), compare_add = ld64(head + WQE_COMPARE_ADD),
                 swap = ld64(head + WQE_SWAP);
        uint32_t rkey = ld32(head + WQE_RKEY);
        uint8_t *b = out + k * spacing;
        memcpy(b, t->hdr, t->prefix);
        put32(b + UNTAGGED_MSN_AT, t->msn + (uint32_t)k);
        uint8_t *q = b + t->prefix;
        put32(q + AREQ_WORD0, t->aop);
        put32(q + AREQ_REQ_ID, t->req_id + (uint32_t)k);
        put32(q + AREQ_STAG, rkey);
        put64(q + AREQ_TO, raddr);
        if (t->aop == AOP_FETCH_ADD) { /* verbs' FetchAdd: a masked add with no field boundaries */
            put64(q + AREQ_ADD_SWAP, compare_add);
            put64(q + AREQ_ADD_SWAP_MASK, 0);
            put64(q + AREQ_COMPARE, 0);
            put64(q + AREQ_COMPARE_MASK, 0);
        } else { /* CmpSwap: compares and swaps all 64 bits */
            put64(q + AREQ_ADD_SWAP, swap);
            put64(q + AREQ_ADD_SWAP_MASK, ~(uint64_t)0);
            put64(q + AREQ_COMPARE, compare_add);
            put64(q + AREQ_COMPARE_MASK, ~(uint64_t)0);
        }
        t->wr_id[k] = ld64(head + WQE_WR_ID);
        t->raddr[k] = raddr;
        t->rkey[k] = rkey;
        t->sink_off[k] = addr - t->addr;
        t->signaled[k] = t->sig_all || flags & t->signaled_flag;
    }
    return k;
}
