/* The batch take (see wire/native.py and daemon/txbatch.py): a stream's
 * small messages straight from the send queue into a link run.
 *
 * Compiled after _native.c, in the same unit: it uses that file's helpers
 * (put32, put64).  One call takes the next WQEs of one QP's SQ that are all
 * alike (one opcode, flags among those allowed, payload inline or one SGE in
 * the one local region the caller checked, all of the first one's length,
 * cut into segments of one size) and builds their segments (the headers
 * Python packed, each with its own STag and TO, or its MSN, then its
 * payload), each in the place its link packet will have (transport/link.py
 * run_slots), so the link queues them as one run and the framer frames
 * them in one call.  It stops
 * at the first WQE that is not like the others; that one and everything
 * unusual (errors included) is the Python path's (daemon/requester.py).
 * The WQE is in the application's memory: each field is read once, and
 * what was read is what the caller's records get.
 */

enum {
    /* struct uv_send_wqe (wire/shm.py), host byte order */
    WQE_WR_ID = 0,
    WQE_RADDR = 8,
    WQE_OPCODE = 16,
    WQE_FLAGS = 20,
    WQE_NUM_SGE = 24,
    WQE_RKEY = 32,
    WQE_INLINE_LEN = 36,
    /* struct uv_sge */
    SGE_LENGTH = 8,
    SGE_LKEY = 12,
    /* where the segment headers keep what varies (wire/segment.py) */
    TAGGED_STAG_AT = 10,
    TAGGED_TO_AT = 14,
    UNTAGGED_MSN_AT = 18,
};

typedef struct {
    /* the send queue */
    const uint8_t *slots;  /* its first slot */
    uint32_t cons;         /* the daemon's consumer index */
    uint32_t mask;         /* entries - 1 */
    uint32_t entry_size;
    uint32_t sg_at;        /* where a WQE's SGE list (or inline data) starts */
    uint32_t avail;        /* WQEs posted beyond cons, as the caller read the producer index */
    /* what every WQE taken must be */
    uint32_t opcode;       /* the WR opcode: RDMA Write or Send */
    uint32_t flags_ok;     /* send_flags a WQE may have */
    uint32_t inline_flag;  /* IBV_SEND_INLINE */
    uint32_t signaled_flag;/* IBV_SEND_SIGNALED */
    uint32_t sig_all;      /* the QP signals every WR */
    uint32_t max_inline;   /* the longest inline payload taken */
    uint32_t lkey;         /* the local region an SGE must lie in */
    uint64_t addr;         /* its first byte's address (the application's) */
    uint64_t len;          /* its length */
    /* the segment headers, packed by Python (wire/segment.py): of a
       message's last segment, and of the others (a Write of several) */
    uint8_t hdr[32];
    uint8_t more[32];
    uint32_t prefix;       /* their bytes: 22 tagged, 26 untagged */
    uint32_t seg;          /* payload bytes a segment: `length` divided evenly (a Send's: `length`) */
    uint32_t untagged;     /* a Send's: the MSN from `msn`, one more each; else STag and TO from the WQE */
    uint32_t msn;
    uint32_t length;       /* every message's payload: the first WQE's, checked by the caller */
    /* out, per WQE */
    uint64_t *wr_id;
    uint64_t *raddr;
    uint32_t *rkey;
    uint64_t *src_off;     /* the payload's offset in the region; inline: UINT64_MAX */
    uint8_t *signaled;
} udpv_tx_take;

static inline uint32_t ld32(const uint8_t *p) { uint32_t v; memcpy(&v, p, sizeof v); return v; }
static inline uint64_t ld64(const uint8_t *p) { uint64_t v; memcpy(&v, p, sizeof v); return v; }

/* Take up to `max` WQEs from t's SQ (see the file's comment), building the
   segments of each in turn, `spacing` bytes apart from `out` (a message of
   length / seg segments, each seg bytes at the next tagged offset, the last
   with the `hdr` header, the others with `more`); the region's bytes are at
   `mem`.  Returns how many WQEs (the caller pops them off the ring). */
size_t udpv_tx_take_small(udpv_tx_take *t, const uint8_t *mem, uint8_t *out, size_t max, size_t spacing) {
    size_t k = 0;
    size_t n_max = max < t->avail ? max : t->avail;
    for (; k < n_max; k++) {
        const uint8_t *w = t->slots + (size_t)((t->cons + (uint32_t)k) & t->mask) * t->entry_size;
        uint8_t head[WQE_INLINE_LEN + 4];
        memcpy(head, w, sizeof head); /* once: the application may write the slot meanwhile */
        uint32_t flags = ld32(head + WQE_FLAGS);
        if (ld32(head + WQE_OPCODE) != t->opcode || (flags & ~t->flags_ok)) break;
        const uint8_t *src;
        uint64_t off;
        uint32_t n;
        if (flags & t->inline_flag) {
            n = ld32(head + WQE_INLINE_LEN);
            if (n > t->max_inline) break;
            src = w + t->sg_at;
            off = UINT64_MAX;
        } else {
            if (ld32(head + WQE_NUM_SGE) != 1) break;
            uint8_t sge[16];
            memcpy(sge, w + t->sg_at, sizeof sge);
            uint64_t a = ld64(sge);
            n = ld32(sge + SGE_LENGTH);
            if (ld32(sge + SGE_LKEY) != t->lkey || a < t->addr || a - t->addr > t->len || n > t->len - (a - t->addr))
                break;
            off = a - t->addr;
            src = mem + off;
        }
        if (n != t->length) break;
        uint32_t rkey = ld32(head + WQE_RKEY);
        uint64_t raddr = ld64(head + WQE_RADDR);
        size_t m = n / t->seg;
        for (size_t j = 0; j < m; j++) {
            uint8_t *b = out + (k * m + j) * spacing;
            memcpy(b, j + 1 == m ? t->hdr : t->more, t->prefix);
            if (t->untagged) {
                put32(b + UNTAGGED_MSN_AT, t->msn + (uint32_t)k);
            } else {
                put32(b + TAGGED_STAG_AT, rkey);
                put64(b + TAGGED_TO_AT, raddr + j * t->seg);
            }
            memcpy(b + t->prefix, src + j * t->seg, t->seg);
        }
        t->wr_id[k] = ld64(head + WQE_WR_ID);
        t->raddr[k] = raddr;
        t->rkey[k] = rkey;
        t->src_off[k] = off;
        t->signaled[k] = t->sig_all || (flags & t->signaled_flag);
    }
    return k;
}

/* -- the Send batch: a GRO buffer of one-segment Sends, each into its receive -- */

enum {
    /* struct uv_recv_wqe and struct uv_cqe (wire/shm.py), host byte order */
    RWQE_NUM_SGE = 8,
    CQE_STATUS = 8,
    CQE_OPCODE = 12,
    CQE_VENDOR_ERR = 16,
    CQE_BYTE_LEN = 20,
    CQE_IMM = 24,
    CQE_QP_NUM = 28,
    CQE_SRC_QP = 32,
    CQE_WC_FLAGS = 36,
};

typedef struct {
    /* the receive queue: its slots, the daemon's consumer index, receives posted */
    const uint8_t *rq;
    uint32_t rq_cons, rq_mask, rq_entry_size, rq_sg_at, rq_avail;
    /* the one region the receives must lie in (the caller checked it for the QP) */
    uint32_t lkey;
    uint64_t addr, len;
    /* the receive CQ: its slots, the daemon's producer index, free slots */
    uint8_t *cq;
    uint32_t cq_prod, cq_mask, cq_entry_size, cq_room;
    uint32_t qp_num, src_qp, wc_recv;
    /* out: the datagrams' link fields, as udpv_rx_run's over the whole batch */
    uint32_t ack, ts, echo, rwnd, flags, last_ts, last_rwnd, flags_or;
    uint32_t flow_ack, flow_ack_msn;
    uint32_t last_len; /* the last Send's length: the receive's bytes placed */
} udpv_rx_sends;

static inline void st32(uint8_t *p, uint32_t v) { memcpy(p, &v, sizeof v); }

/* One-segment Sends at buf (datagrams of `seg` bytes, as udpv_rx_write_run
   reads them), each into the next posted receive (one SGE in s's region;
   `mem` is the region's first byte) with its CQE written after the CQ's
   producer index: r is set up as for a Send's run, with `whole` (each
   datagram a whole message), its MSN the next expected, and is moved on
   message by message (seq, MSN, window room).  Stops at the first datagram
   the lane would not take as such a Send, at a receive that is not one SGE
   in the region, when receives or CQ slots run out, and at an ACK field
   other than the first's (the link takes one per run).  Returns how many;
   the caller pops the receives, publishes the CQEs and accounts for the
   run on the link. */
size_t udpv_rx_send_batch(udpv_rx_sends *s, udpv_rx_run *r, const uint8_t *buf, size_t len, size_t seg,
                          uint8_t *mem) {
    size_t n = 0, off = 0;
    s->flags_or = 0;
    s->flow_ack = 0;
    while (off < len && n < s->rq_avail && n < s->cq_room && r->max_count > 0) {
        if (len - off < LINK_HEADER_LEN || (n && be32(buf + off + 12) != s->ack)) break;
        const uint8_t *w = s->rq + (size_t)((s->rq_cons + (uint32_t)n) & s->rq_mask) * s->rq_entry_size;
        uint8_t head[16], sge[16];
        memcpy(head, w, sizeof head); /* once: the application may write the slot meanwhile */
        memcpy(sge, w + s->rq_sg_at, sizeof sge);
        uint64_t a = ld64(sge);
        uint32_t sl = ld32(sge + SGE_LENGTH);
        if (ld32(head + RWQE_NUM_SGE) != 1 || ld32(sge + SGE_LKEY) != s->lkey || a < s->addr ||
            a - s->addr > s->len || sl > s->len - (a - s->addr))
            break;
        r->length = sl;
        r->next_to = 0;
        if (udpv_rx_write_run(r, buf + off, len - off, seg, mem + (a - s->addr)) != 1 || !r->ended) break;
        if (n == 0) {
            s->ack = r->first_ack;
            s->ts = r->first_ts;
            s->echo = r->first_echo;
            s->rwnd = r->first_rwnd;
            s->flags = r->first_flags;
        }
        s->last_ts = r->last_ts;
        s->last_rwnd = r->last_rwnd;
        s->flags_or |= r->flags_or;
        if (r->flow_ack) {
            s->flow_ack = 1;
            s->flow_ack_msn = r->flow_ack_msn;
        }
        uint8_t *c = s->cq + (size_t)((s->cq_prod + (uint32_t)n) & s->cq_mask) * s->cq_entry_size;
        memcpy(c, head, 8); /* wr_id */
        st32(c + CQE_STATUS, 0);
        st32(c + CQE_OPCODE, s->wc_recv);
        st32(c + CQE_VENDOR_ERR, 0);
        st32(c + CQE_BYTE_LEN, (uint32_t)r->bytes);
        s->last_len = (uint32_t)r->bytes;
        st32(c + CQE_IMM, 0);
        st32(c + CQE_QP_NUM, s->qp_num);
        st32(c + CQE_SRC_QP, s->src_qp);
        st32(c + CQE_WC_FLAGS, 0);
        r->seq++;
        r->max_count--;
        r->msn++;
        off += len - off < seg ? len - off : seg;
        n++;
    }
    return n;
}
