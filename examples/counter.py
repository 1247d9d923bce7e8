"""Every rank adds to one counter in rank 0's memory, under a group lock.

Each rank adds 1 to a 64-bit counter in rank 0's memory region, --iters
times, by reading it (RDMA Read), adding 1 and writing it back (RDMA Write).
A read-modify-write like this is only correct while no other rank runs one
at the same time: ``with group.lock(0)`` (a queue lock the daemons hold for
the group, no set-up needed) makes sure of that.  With --no-lock the ranks'
updates overwrite each other and some are lost; the program then says how
many and still exits 0, so that you can see it happen.

Rank 0 registers the counter and listens with the connection helper; every
other rank connects one QP to it and learns the counter's address and rkey
from the accept's private data.  Ranks whose daemon is rank 0's connect the
same way (their daemon loops the QP back to itself); rank 0 itself updates
its own memory directly.  Barriers separate the set-up, the increments and
the final check.

Run it with the launcher, which starts the daemons and the ranks:

  $ udpverbs run -n 16 --daemons 4 -- python examples/counter.py --iters 625
  [0] counter = 10000 (expected 10000)
  [0] 16 ranks x 625 increments in ...
  $ udpverbs run -n 16 --daemons 4 -- python examples/counter.py --iters 625 --no-lock
  [0] counter = 2428 (expected 10000): 7572 updates lost without the lock
  [0] 16 ranks x 625 increments in ...

(``udpverbs run`` prefixes each line with the rank that printed it.)
"""

import argparse
import struct
import sys
import time

from udpverbs import verbs
from udpverbs.verbs.enums import *

SERVICE_PORT = 7480  # rank 0 listens here, on its daemon
LOCK_ID = 0  # any 32-bit number names a lock of the group
ACCESS = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE
COUNTER = struct.Struct("=Q")  # host byte order, like an atomic's target word


def new_qp(pd, cq):
    return verbs.QP(pd, verbs.QPInitAttr(qp_type=IBV_QPT_RC, scq=cq, rcq=cq, cap=verbs.QPCap(4, 1)))


def rdma(qp, cq, opcode, mr, addr, rkey):
    """Read rank 0's counter into ``mr`` or write ``mr`` to it, and wait for the completion."""
    wr = verbs.SendWR(opcode=opcode, sg=[verbs.SGE(mr.buf, COUNTER.size, mr.lkey)], send_flags=IBV_SEND_SIGNALED)
    wr.set_wr_rdma(rkey, addr)
    qp.post_send(wr)
    (wc,) = cq.poll_blocking(1, timeout=30)
    if wc.status != IBV_WC_SUCCESS:
        raise SystemExit(f"RDMA {'Read' if opcode == IBV_WR_RDMA_READ else 'Write'} failed: {wc}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=625, help="increments per rank (default 625)")
    ap.add_argument("--no-lock", action="store_true", help="skip the lock: updates get lost")
    args = ap.parse_args()

    with verbs.Context() as ctx, verbs.Group.from_env(ctx) as group:
        pd = verbs.PD(ctx)
        mr = verbs.MR(pd, COUNTER.size, ACCESS)  # rank 0: the counter; the others: where it is read to
        cq = verbs.CQ(ctx, 2 * group.size)

        # Set-up: rank 0 listens, then the others connect to it.
        if group.rank == 0:
            COUNTER.pack_into(mr.mv, 0, 0)
            listener = verbs.CMListener(ctx, SERVICE_PORT, backlog=group.size)
            group.barrier()  # rank 0 listens
            for _ in range(group.size - 1):
                req = listener.get_request(timeout=60)
                listener.accept(req, new_qp(pd, cq), private_data=struct.pack("!QI", mr.buf, mr.rkey))
        else:
            group.barrier()
            qp = new_qp(pd, cq)
            ip, udp_port = group.members[0]  # rank 0's daemon
            conn = verbs.connect(qp, ip, SERVICE_PORT, udp_port=udp_port, timeout=60)
            addr, rkey = struct.unpack("!QI", conn.private_data)
        group.barrier()  # every rank is connected

        def increment():
            if group.rank == 0:  # its own memory
                (value,) = COUNTER.unpack_from(mr.mv, 0)
                COUNTER.pack_into(mr.mv, 0, value + 1)
            else:
                rdma(qp, cq, IBV_WR_RDMA_READ, mr, addr, rkey)
                (value,) = COUNTER.unpack_from(mr.mv, 0)
                COUNTER.pack_into(mr.mv, 0, value + 1)
                rdma(qp, cq, IBV_WR_RDMA_WRITE, mr, addr, rkey)

        start = time.perf_counter()
        for _ in range(args.iters):
            if args.no_lock:
                increment()
            else:
                with group.lock(LOCK_ID):
                    increment()
        group.barrier()  # every rank's last Write has completed
        elapsed = time.perf_counter() - start

        if group.rank != 0:
            return 0
        (counter,) = COUNTER.unpack_from(mr.mv, 0)
        expected = group.size * args.iters
        if args.no_lock:
            print(f"counter = {counter} (expected {expected}): {expected - counter} updates lost without the lock")
        else:
            print(f"counter = {counter} (expected {expected})")
        print(f"{group.size} ranks x {args.iters} increments in {elapsed:.2f} s"
              f" ({elapsed / max(expected, 1) * 1e6:.0f} us per increment)")
        return 0 if args.no_lock or counter == expected else 1


if __name__ == "__main__":
    sys.exit(main())
