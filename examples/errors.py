"""Where errors surface: the control path, the data path, asynchronous events.

A refused verb raises ``VerbsError`` with the errno in ``.error_code``; a
work request that fails completes with an error status and moves its QP to
the error state; what belongs to no single work request arrives as an
asynchronous event.  This program shows one of each: a device that does
not exist, a connection nobody listens for, and an RDMA Write into a memory
region that does not allow remote writes.

It needs two daemons on this machine:

  udpverbsd --name uvA --addr 127.0.0.2 &
  udpverbsd --name uvB --addr 127.0.0.3 &
  python examples/errors.py
"""

import errno
import threading

from udpverbs import verbs
from udpverbs.verbs.enums import *

# Control path: a refused verb raises VerbsError, with the errno in .error_code.
try:
    verbs.Context(name="no-such-device")
except verbs.VerbsError as e:
    print("control path:", errno.errorcode[e.error_code])

objs = []
for name in ("uvA", "uvB"):
    ctx = verbs.Context(name=name)
    pd = verbs.PD(ctx)
    mr = verbs.MR(pd, 4096, IBV_ACCESS_LOCAL_WRITE)  # no IBV_ACCESS_REMOTE_WRITE
    cq = verbs.CQ(ctx, 16)
    qp = verbs.QP(pd, verbs.QPInitAttr(qp_type=IBV_QPT_RC, scq=cq, rcq=cq, cap=verbs.QPCap(16, 16)))
    objs.append((ctx, mr, cq, qp))
(ctx_a, mr_a, cq_a, qp_a), (ctx_b, mr_b, _, qp_b) = objs
port_b = ctx_b.query_port().lid  # B's daemon's UDP port

try:
    verbs.connect(qp_a, "127.0.0.3", 7999, udp_port=port_b)  # nobody listens on service port 7999
except verbs.VerbsError as e:
    print("control path:", errno.errorcode[e.error_code])

with verbs.CMListener(ctx_b, port=7473) as listener:
    t = threading.Thread(target=lambda: listener.accept(listener.get_request(), qp_b))
    t.start()
    verbs.connect(qp_a, "127.0.0.3", 7473, udp_port=port_b)
    t.join()

# Data path: B's memory region does not allow RDMA Write, so the Write completes with an error.
wr = verbs.SendWR(wr_id=1, opcode=IBV_WR_RDMA_WRITE, sg=[verbs.SGE(mr_a.buf, 8, mr_a.lkey)],
                  send_flags=IBV_SEND_SIGNALED)
wr.set_wr_rdma(mr_b.rkey, mr_b.buf)
qp_a.post_send(wr)
(wc,) = cq_a.poll_blocking(1, timeout=10)
print("data path:", wc.status.name, "and QP A is now", qp_a.query()[0].qp_state.name)

# Asynchronous events: both QPs were hit.
for side, ctx in (("A", ctx_a), ("B", ctx_b)):
    ev = ctx.get_async_event(timeout=5)
    print(f"async event on {side}:", ev.event_type.name, "QPN", ev.element)
ctx_a.close()
ctx_b.close()
