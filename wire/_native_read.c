/* The Read batch (see wire/native.py and daemon/readbatch.py): an ORD
 * window of RDMA Reads taken, answered and completed as batches.
 *
 * Compiled after _native.c, _native_batch.c and _native_atomic.c, in the
 * same unit (it uses be32, be64, put32, put64, ld32, ld64, the WQE and
 * segment offsets, and udpv_rx_write_run).
 */

enum {
    /* a Read Request's body (RFC 5040 §4.4) */
    RREQ_SINK_STAG = 0,
    RREQ_SINK_TO = 4,
    RREQ_SIZE = 12,
    RREQ_SRC_STAG = 16,
    RREQ_SRC_TO = 20,
};

/* The responder's side.  The receive lane has checked the datagrams (link
 * header, CRC, envelope, DDP header, queue 1, MSN by MSN, the body's size);
 * this call reads each Read Request's body and, while it asks for `size`
 * bytes of the one region the caller checked (its STag, the QP's PD,
 * remote read access) within its bounds, as the Python path checks it
 * (daemon/tables.py MemoryRegion.check), builds the header of its one
 * Read Response segment (the tagged header Python packed, with the
 * request's sink STag and TO) in the place its link packet will have
 * (transport/link.py run_slots), and notes where in the region its bytes
 * are.  The payloads are copied when the responses leave
 * (udpv_read_fill), as the Python path reads the region then.  It stops at
 * the first request that differs; that one and everything unusual
 * (errors included) is the Python path's. */

typedef struct {
    uint32_t stag;    /* the region every request must name */
    uint64_t base;    /* the TO of its first byte (0 for a zero-based one) */
    uint64_t len;     /* its length */
    uint32_t size;    /* the bytes every request must ask for: one segment */
    uint8_t hdr[32];  /* a Read Response's last segment header, Python-packed */
    uint32_t prefix;  /* its bytes */
    uint64_t *src_off; /* out, per request: its bytes' offset in the region */
} udpv_reads;

size_t udpv_read_batch(udpv_reads *a, const uint8_t *buf, size_t k, size_t seg, uint8_t *out, size_t spacing) {
    size_t i;
    for (i = 0; i < k; i++) {
        const uint8_t *q = buf + i * seg;
        uint64_t to = be64(q + RREQ_SRC_TO);
        if (be32(q + RREQ_SRC_STAG) != a->stag || be32(q + RREQ_SIZE) != a->size) break;
        if (to < a->base || to - a->base > a->len || a->size > a->len - (to - a->base)) break;
        uint8_t *b = out + i * spacing;
        memcpy(b, a->hdr, a->prefix);
        memcpy(b + TAGGED_STAG_AT, q + RREQ_SINK_STAG, 4); /* both big-endian: as they came */
        memcpy(b + TAGGED_TO_AT, q + RREQ_SINK_TO, 8);
        a->src_off[i] = to - a->base;
    }
    return i;
}

/* The payloads of `k` responses built by udpv_read_batch, from the region
 * at `mem`, each after its header (`prefix` bytes) in its slot. */
void udpv_read_fill(uint8_t *out, size_t spacing, size_t prefix, const uint8_t *mem, const uint64_t *src_off,
                    size_t k, size_t size) {
    for (size_t i = 0; i < k; i++) memcpy(out + i * spacing + prefix, mem + src_off[i], size);
}

/* The requester's side: the next Read WQEs of an SQ that are alike (no
 * flag but signaled, one SGE of at least one byte, at most `max_len`, in
 * the one local region the caller checked), taken in one call and built
 * into Read Requests (RFC 5040 §4.4) in run slots, as udpv_atomic_take
 * builds Atomic Requests.  Each gets the next sink STag (never 0: it
 * wraps to 1).  The WQE is in the application's memory: each field is
 * read once, and what was read is what the caller's records get. */

typedef struct {
    const uint8_t *slots;
    uint32_t cons, mask, entry_size, sg_at, avail;
    uint32_t opcode;        /* the WR opcode every WQE must have: RDMA Read */
    uint32_t flags_ok, signaled_flag, sig_all;
    uint32_t lkey;          /* the local region every sink must lie in */
    uint64_t addr, len;
    uint32_t max_len;       /* the longest Read taken (the port's max_msg_sz) */
    uint8_t hdr[32];        /* a Read Request's segment header, Python-packed */
    uint32_t prefix, msn;
    uint32_t sink;          /* in: the first sink STag; out: the next one after the last taken */
    uint64_t *wr_id, *raddr, *sink_off;
    uint32_t *rkey, *length;
    uint8_t *signaled;
} udpv_read_wqes;

size_t udpv_read_take(udpv_read_wqes *t, uint8_t *out, size_t max, size_t spacing) {
    size_t k;
    uint32_t sink = t->sink;
    if (max > t->avail) max = t->avail;
    for (k = 0; k < max; k++) {
        const uint8_t *w = t->slots + (size_t)((t->cons + (uint32_t)k) & t->mask) * t->entry_size;
        uint8_t head[40], sge[16];
        memcpy(head, w, sizeof head); /* once: the application may write the slot meanwhile */
        memcpy(sge, w + t->sg_at, sizeof sge);
        uint32_t flags = ld32(head + WQE_FLAGS);
        uint64_t addr = ld64(sge);
        uint32_t n = ld32(sge + SGE_LENGTH);
        if (ld32(head + WQE_OPCODE) != t->opcode || flags & ~t->flags_ok || ld32(head + WQE_NUM_SGE) != 1) break;
        if (n == 0 || n > t->max_len || ld32(sge + SGE_LKEY) != t->lkey) break;
        if (addr < t->addr || addr - t->addr > t->len || n > t->len - (addr - t->addr)) break;
        uint64_t raddr = ld64(head + WQE_RADDR);
        uint32_t rkey = ld32(head + WQE_RKEY);
        uint8_t *b = out + k * spacing;
        memcpy(b, t->hdr, t->prefix);
        put32(b + UNTAGGED_MSN_AT, t->msn + (uint32_t)k);
        uint8_t *q = b + t->prefix;
        put32(q + RREQ_SINK_STAG, sink);
        put64(q + RREQ_SINK_TO, 0);
        put32(q + RREQ_SIZE, n);
        put32(q + RREQ_SRC_STAG, rkey);
        put64(q + RREQ_SRC_TO, raddr);
        t->wr_id[k] = ld64(head + WQE_WR_ID);
        t->raddr[k] = raddr;
        t->rkey[k] = rkey;
        t->length[k] = n;
        t->sink_off[k] = addr - t->addr;
        t->signaled[k] = t->sig_all || flags & t->signaled_flag;
        sink = sink + 1 ? sink + 1 : 1;
    }
    t->sink = sink;
    return k;
}

/* The requester's side again: a buffer of Read Responses, each one whole
 * response (one segment, the last) to the next Read of the ORRQ, placed
 * into its sink (one SGE: `off[i]` bytes into the region at `mem`,
 * `size[i]` bytes, sink STag `stag[i]`) by the receive lane's own checks
 * (udpv_rx_write_run, r set up as for a Read's responses), one response a
 * call, r moved on (seq, window room).  Stops at the first datagram the
 * lane would not take as such a response and at an ACK field other than
 * the first's (the link takes one per run).  Returns how many, with the
 * datagrams' link fields over the whole batch in s. */

typedef struct {
    const uint32_t *stag, *size;
    const uint64_t *off;
    uint32_t ack, ts, echo, rwnd, flags, last_ts, last_rwnd, flags_or;
} udpv_read_sinks;

size_t udpv_read_responses(udpv_read_sinks *s, udpv_rx_run *r, const uint8_t *buf, size_t len, size_t seg,
                           uint8_t *mem, size_t reads) {
    size_t n = 0, off = 0;
    s->flags_or = 0;
    while (off < len && n < reads && r->max_count > 0) {
        if (len - off < LINK_HEADER_LEN + TAGGED_PREFIX_LEN || (n && be32(buf + off + 12) != s->ack)) break;
        /* a response of several segments: the per-Read call's (nothing placed here) */
        if (buf[off + LINK_HEADER_LEN + 8] != r->ctrl_last) break;
        r->stag = s->stag[n];
        r->length = s->size[n];
        r->next_to = 0;
        if (udpv_rx_write_run(r, buf + off, len - off, seg, mem + s->off[n]) != 1 || !r->ended) break;
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
        r->seq++;
        r->max_count--;
        off += len - off < seg ? len - off : seg;
        n++;
    }
    return n;
}
