
/* -- the armed read of a Send: its receive's CQE written in the same call -- */

/* In a Send ping-pong the application waits on the receive's CQE, not on
   the data: what the armed read saves by placing the Send in the call that
   reads it is lost if the CQE waits for the daemon's Python afterwards.
   The receive was resolved when the lane was armed (daemon/rxlane.py); the
   CQ's producer index is the daemon's at the call (it completes other WRs
   into the same CQ meanwhile). */
typedef struct {
    uint8_t *cq;                          /* the receive CQ's slots */
    const volatile uint32_t *cq_consumer; /* its header's consumer index (the application's) */
    volatile uint32_t *cq_producer;       /* ... and producer index (ours) */
    uint32_t cq_prod, cq_mask, cq_entry_size, cq_entries;
    uint64_t wr_id;                       /* the receive the run places into */
    uint32_t placed;                      /* its bytes placed before the run */
    volatile uint32_t *rq_consumer;       /* its ring's consumer index (an RQ's or SRQ's) */
    uint32_t rq_next;                     /* ... once the receive is taken */
    uint32_t rq_take;                     /* the run starts the receive: take it off the ring */
    uint32_t qp_num, src_qp, wc_recv;
    uint32_t on;                          /* write the CQE of a Send the run ends */
    uint32_t written;                     /* out: the CQE is written and published */
} udpv_rx_send_cqe;

/* udpv_rx_recv_run, and if its run ended the Send (a plain Send or one with
   Solicited Event: r is set up so that no other ends in the lane) and the
   CQ has room, the receive's CQE written after the producer index and
   published.  A receive the run started leaves its ring first: an
   application that polled the CQE may post into its slot at once.  The
   caller does the same bookkeeping (``Ring.pop`` stores the same index)
   and accounts for the CQE (``CompletionQueue.pushed``) as the Python path
   would have. */
long udpv_rx_recv_send(udpv_rx_recv *a, udpv_rx_run *r, udpv_rx_send_cqe *c, uint8_t *buf, size_t cap,
                       uint8_t *mem) {
    c->written = 0;
    long k = udpv_rx_recv_run(a, r, buf, cap, mem);
    if (k <= 0 || !r->ended || !c->on) return k;
    uint32_t used = c->cq_prod - __atomic_load_n(c->cq_consumer, __ATOMIC_ACQUIRE);
    if (used >= c->cq_entries) return k; /* full, or the consumer lied: the Python path's push decides */
    uint8_t *e = c->cq + (size_t)(c->cq_prod & c->cq_mask) * c->cq_entry_size;
    memcpy(e, &c->wr_id, 8);
    st32(e + CQE_STATUS, 0);
    st32(e + CQE_OPCODE, c->wc_recv);
    st32(e + CQE_VENDOR_ERR, 0);
    st32(e + CQE_BYTE_LEN, c->placed + (uint32_t)r->bytes);
    st32(e + CQE_IMM, 0);
    st32(e + CQE_QP_NUM, c->qp_num);
    st32(e + CQE_SRC_QP, c->src_qp);
    st32(e + CQE_WC_FLAGS, 0);
    if (c->rq_take) __atomic_store_n(c->rq_consumer, c->rq_next, __ATOMIC_RELEASE);
    __atomic_store_n(c->cq_producer, c->cq_prod + 1, __ATOMIC_RELEASE);
    c->written = 1;
    return k;
}
