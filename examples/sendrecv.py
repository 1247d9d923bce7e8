"""A Send that finds no receive posted, then a Fetch-and-Add.

A's Send reaches B before B has posted a receive.  That is not an error:
B's daemon NACKs it (receiver not ready), drops A's later Sends until it
comes back, and tells A's daemon to resume the moment B posts a receive, so
the Send completes without waiting out its back-off.  Then A adds 1 to a
64-bit word of B's memory; the old value lands in A's buffer.  Last, B's
daemon's counters show the NACKs and the resume.

It needs two daemons on this machine:

  udpverbsd --name uvA --addr 127.0.0.2 &
  udpverbsd --name uvB --addr 127.0.0.3 &
  python examples/sendrecv.py
"""

import struct
import time

from udpverbs import verbs
from udpverbs.verbs.enums import *

ACCESS = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC

def side(name):
    ctx = verbs.Context(name=name)
    pd = verbs.PD(ctx)
    mr = verbs.MR(pd, 4096, ACCESS)
    cq = verbs.CQ(ctx, 16)
    qp = verbs.QP(pd, verbs.QPInitAttr(qp_type=IBV_QPT_RC, scq=cq, rcq=cq, cap=verbs.QPCap(16, 16)))
    return ctx, pd, mr, cq, qp

a, b = side("uvA"), side("uvB")
for (ctx, _, _, _, qp), (pctx, _, _, _, pqp) in ((a, b), (b, a)):
    attr = verbs.QPAttr(qp_access_flags=ACCESS, dest_qp_num=pqp.qp_num, rnr_retry=7, min_rnr_timer=12)
    attr.ah_attr = verbs.AHAttr(dlid=pctx.query_port().lid, gr=verbs.GlobalRoute(dgid=pctx.query_gid()))
    qp.to_rts(attr)
(actx, _, amr, acq, aqp), (bctx, _, bmr, bcq, bqp) = a, b

# A Send posted before B has a receive: B's daemon NACKs it, and B's post_recv makes it go.
amr.write(b"ping")
aqp.post_send(verbs.SendWR(wr_id=1, opcode=IBV_WR_SEND_WITH_IMM, imm_data=7,
                           sg=[verbs.SGE(amr.buf, 4, amr.lkey)], send_flags=IBV_SEND_SIGNALED))
time.sleep(0.1)  # let the Send arrive first
bqp.post_recv(verbs.RecvWR(wr_id=2, sg=[verbs.SGE(bmr.buf, 64, bmr.lkey)]))
(wc,) = bcq.poll_blocking(1, timeout=10)
print("received", bmr.read(wc.byte_len, 0), "imm", wc.imm_data, "with imm:", bool(wc.wc_flags & IBV_WC_WITH_IMM))
acq.poll_blocking(1, timeout=10)

# Fetch-and-Add on a 64-bit word of B's memory; the old value lands in A's SGE.
bmr.write(struct.pack("=Q", 41), 8, 128)
wr = verbs.SendWR(wr_id=3, opcode=IBV_WR_ATOMIC_FETCH_AND_ADD, sg=[verbs.SGE(amr.buf, 8, amr.lkey)],
                  send_flags=IBV_SEND_SIGNALED)
wr.set_wr_atomic(bmr.rkey, bmr.buf + 128, compare_add=1)
aqp.post_send(wr)
acq.poll_blocking(1, timeout=10)
print("old", struct.unpack("=Q", amr.read(8, 0))[0], "new", struct.unpack("=Q", bmr.read(8, 128))[0])
print("B's daemon:", {k: v for k, v in bctx.query_stats().items() if k.startswith("rnr_")})
actx.close(); bctx.close()
