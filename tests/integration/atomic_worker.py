"""One application process of the atomics tests: connects a QP to the owner's, then hammers its word.

Run as ``python -m tests.integration.atomic_worker SOCKET MODE COUNT``.  It
prints ``qpn gid_hex lid`` on stdout, reads ``qpn gid_hex lid rkey addr`` of
the owner's QP and word on stdin, and exits 0 after COUNT operations:
``fadd`` does Fetch-and-Add 1; ``lock`` takes a CAS spinlock at ``addr``,
increments the counter at ``addr + 8`` by RDMA Read + RDMA Write (not atomic
by itself), and releases the lock.
"""

from __future__ import annotations

import struct
import sys

from udpverbs import verbs
from udpverbs.verbs.enums import (
    IBV_ACCESS_LOCAL_WRITE,
    IBV_ACCESS_REMOTE_ATOMIC,
    IBV_ACCESS_REMOTE_READ,
    IBV_ACCESS_REMOTE_WRITE,
    IBV_SEND_SIGNALED,
    IBV_WC_SUCCESS,
    IBV_WR_ATOMIC_CMP_AND_SWP,
    IBV_WR_ATOMIC_FETCH_AND_ADD,
    IBV_WR_RDMA_READ,
    IBV_WR_RDMA_WRITE,
)

ACCESS = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC


def main() -> int:
    sock, mode, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with verbs.Context(socket_path=sock) as ctx:
        pd = verbs.PD(ctx)
        mr = verbs.MR(pd, 4096, ACCESS)
        cq = verbs.CQ(ctx, 16)
        qp = verbs.QP(pd, verbs.QPInitAttr(scq=cq, rcq=cq, cap=verbs.QPCap(8, 1)))
        print(qp.qp_num, ctx.query_gid().raw.hex(), ctx.query_port().lid, flush=True)
        pqpn, pgid, plid, rkey, addr = sys.stdin.readline().split()
        rkey_i, addr_i = int(rkey), int(addr)
        attr = verbs.QPAttr(qp_access_flags=ACCESS, dest_qp_num=int(pqpn), max_rd_atomic=1, max_dest_rd_atomic=1)
        attr.ah_attr = verbs.AHAttr(dlid=int(plid), gr=verbs.GlobalRoute(dgid=bytes.fromhex(pgid)))
        qp.to_rts(attr)

        def post(opcode: int, remote: int, **atomic: int) -> int:
            wr = verbs.SendWR(opcode=opcode, sg=[verbs.SGE(mr.buf, 8, mr.lkey)], send_flags=IBV_SEND_SIGNALED)
            if atomic:
                wr.set_wr_atomic(rkey_i, remote, atomic["compare_add"], atomic.get("swap", 0))
            else:
                wr.set_wr_rdma(rkey_i, remote)
            qp.post_send(wr)
            (wc,) = cq.poll_blocking(1, timeout=30)
            if wc.status != IBV_WC_SUCCESS:
                raise SystemExit(f"WR failed: status {wc.status}")
            return int(struct.unpack("=Q", mr.read(8, 0))[0])

        me = qp.qp_num
        for _ in range(count):
            if mode == "fadd":
                post(IBV_WR_ATOMIC_FETCH_AND_ADD, addr_i, compare_add=1)
                continue
            for _ in range(1_000_000):  # spin on the lock word, bounded
                if post(IBV_WR_ATOMIC_CMP_AND_SWP, addr_i, compare_add=0, swap=me) == 0:
                    break
            else:
                raise SystemExit("lock never free")
            value = post(IBV_WR_RDMA_READ, addr_i + 8)
            mr.write(struct.pack("=Q", value + 1), 8, 0)
            post(IBV_WR_RDMA_WRITE, addr_i + 8)  # completes once the peer has it
            if post(IBV_WR_ATOMIC_CMP_AND_SWP, addr_i, compare_add=me, swap=0) != me:
                raise SystemExit("lock word changed under its holder")
    return 0


if __name__ == "__main__":
    sys.exit(main())
