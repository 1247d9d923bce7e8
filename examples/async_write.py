"""Eight 64 KiB RDMA Writes in flight, waited for with trio.

Every wait of the verbs library has an ``async`` form for trio:
``cq.wait_async``, ``cq.poll_async``, ``channel.get_cq_event_async``,
``ctx.get_async_event_async``, and for connections ``verbs.connect_async``
and ``listener.get_request_async``.  This program connects two QPs through
the connection helper, one task accepting while the other connects, then
posts eight Writes and waits for their completions without blocking other
trio tasks.

It needs two daemons on this machine:

  udpverbsd --name uvA --addr 127.0.0.2 &
  udpverbsd --name uvB --addr 127.0.0.3 &
  python examples/async_write.py
"""

import trio

from udpverbs import verbs
from udpverbs.verbs.enums import *


def resources(device):
    ctx = verbs.Context(name=device)
    pd = verbs.PD(ctx)
    mr = verbs.MR(pd, 1 << 20, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)
    cq = verbs.CQ(ctx, 64)
    qp = verbs.QP(pd, verbs.QPInitAttr(qp_type=IBV_QPT_RC, scq=cq, rcq=cq, cap=verbs.QPCap(64, 64)))
    return ctx, mr, cq, qp


async def main():
    ctx_a, mr_a, cq_a, qp_a = resources("uvA")
    ctx_b, mr_b, cq_b, qp_b = resources("uvB")
    with ctx_a, ctx_b, verbs.CMListener(ctx_b, port=7472) as listener:
        async def accept_one():
            req = await listener.get_request_async(timeout=10)
            listener.accept(req, qp_b)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(accept_one)
            # B's daemon: its address and UDP port (the port's LID)
            await verbs.connect_async(qp_a, "127.0.0.3", 7472, udp_port=ctx_b.query_port().lid)

        # Eight 64 KiB Writes in flight; other trio tasks run while we wait.
        for i in range(8):
            wr = verbs.SendWR(wr_id=i, opcode=IBV_WR_RDMA_WRITE, send_flags=IBV_SEND_SIGNALED,
                              sg=[verbs.SGE(mr_a.buf + i * 65536, 65536, mr_a.lkey)])
            wr.set_wr_rdma(mr_b.rkey, mr_b.buf + i * 65536)
            qp_a.post_send(wr)
        wcs = await cq_a.poll_async(8, timeout=30)
        print([(wc.wr_id, wc.status.name) for wc in wcs])


trio.run(main)
