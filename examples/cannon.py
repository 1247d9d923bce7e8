"""Cannon's matrix multiply C = A @ B on a q x q torus of ranks, blocks moved by RDMA Write.

p = q*q ranks (4, 9, 16, ...) form a q x q torus; rank r sits at row
i = r // q, column j = r % q and computes block (i, j) of C, b x b with
b = N / q.  Every rank builds the blocks of A and B it needs itself, from
--seed (no rank sends matrices around to start with), already skewed:
rank (i, j) starts with A's block (i, i+j) and B's block (i+j, j), indices
mod q.  Then q steps: multiply the two blocks held into C (numpy, float64),
and, after all but the last, pass the A block to the left neighbour and the
B block to the upper one.  Afterwards rank (i, j) has added
A(i, k) @ B(k, j) for every k, which is block (i, j) of A @ B.

A shift is an RDMA Write of each block into the neighbour's landing area.
The areas are double-buffered: blocks for step s lie in buffer s % 2, and
the neighbours write the blocks for step s+1 into the other buffer while
this rank still multiplies.  One ``group.barrier()`` per shift is then
enough: once past it, every Write of this shift has completed (the writers
waited for their completions first), and nobody can write into the buffer
still in use, because the next Writes into it come only after the next
barrier, which this rank enters when it has finished with it.

Connections: each rank listens on its own service port (7500 + rank), a
barrier makes sure all of them listen, and then it connects one QP to its
left neighbour and one to its upper one while a thread accepts its right
and lower neighbours' requests (a rank that only connected would wait for
a neighbour that only connects, round the torus).  The accept's private
data carries the landing memory's address and rkey; the layout of the
region is the same on every rank.

At the end every rank compares its C block with numpy's A @ B for that
block, the ranks pass the largest error round the torus (a row ring then a
column ring, over the same QPs), and rank 0 prints it with the time the
multiply took.  The exit status is 1 when any block is wrong.

  $ udpverbs run -n 16 --daemons 4 -- python examples/cannon.py -N 512
  [0] C = A @ B, N = 512 on 16 ranks (4 x 4 blocks of 128): max error 3.6e-14, multiply 0.12 s

It needs numpy.
"""

import argparse
import math
import os
import struct
import sys
import threading
import time

# One BLAS thread a rank: the ranks already keep every core busy.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np

from udpverbs import verbs
from udpverbs.verbs.enums import *

SERVICE_BASE = 7500  # rank r listens on service port SERVICE_BASE + r
ACCESS = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE
F64 = struct.Struct("=d")


# -- the block arithmetic (no verbs; tests call these directly) ----------------------------------------
def block(seed, name, row, col, b):
    """Block (row, col) of matrix ``name`` ("A" or "B"), b x b, the same on every rank."""
    rng = np.random.default_rng([seed, ord(name), row, col])
    return rng.uniform(-1.0, 1.0, (b, b))


def coords(rank, q):
    """Rank -> (row, column) on the torus."""
    return divmod(rank, q)


def rank_at(i, j, q):
    """(row, column), mod q -> rank."""
    return (i % q) * q + j % q


def left(rank, q):
    i, j = coords(rank, q)
    return rank_at(i, j - 1, q)


def up(rank, q):
    i, j = coords(rank, q)
    return rank_at(i - 1, j, q)


def first_k(i, j, q):
    """The skew: rank (i, j) starts with A(i, k) and B(k, j) for this k."""
    return (i + j) % q


def reference(seed, i, j, q, b):
    """Block (i, j) of A @ B, computed by numpy from A's row of blocks and B's column."""
    a_row = np.hstack([block(seed, "A", i, k, b) for k in range(q)])
    b_col = np.vstack([block(seed, "B", k, j, b) for k in range(q)])
    return a_row @ b_col


def simulate(n, q, seed):
    """Cannon's algorithm in one process, blocks shifted between dict entries as the ranks shift them.

    Returns the C blocks by rank; a check of the skew and of the shift
    directions that needs no daemon.
    """
    b = n // q
    a, bb = {}, {}
    for r in range(q * q):
        i, j = coords(r, q)
        k = first_k(i, j, q)
        a[r], bb[r] = block(seed, "A", i, k, b), block(seed, "B", k, j, b)
    c = {r: np.zeros((b, b)) for r in range(q * q)}
    for step in range(q):
        for r in c:
            c[r] += a[r] @ bb[r]
        if step < q - 1:
            a = {left(r, q): blk for r, blk in a.items()}
            bb = {up(r, q): blk for r, blk in bb.items()}
    return c


def tolerance(n):
    """A sum of n products of numbers in [-1, 1): rounding differences stay far below this."""
    return 64 * n * np.finfo(np.float64).eps


# -- the program ------------------------------------------------------------------------------------------
class Region:
    """This rank's registered memory: A and B landing buffers (two each), error slots, an outgoing word.

    The layout depends only on N and q, so it is the same on every rank and
    a neighbour's buffer k lies at the neighbour's base + the same offset.
    """

    def __init__(self, pd, b, q):
        self.blk = b * b * 8
        self.slots = 2 * self.blk * 2  # error slots after the four block buffers
        self.out = self.slots + 8 * 2 * q  # the word this rank writes from
        self.mr = verbs.MR(pd, self.out + 8, ACCESS)
        self.b = b

    def offset(self, name, k):
        return ((0 if name == "A" else 2) + k) * self.blk

    def array(self, name, k):
        return np.frombuffer(self.mr.mv, np.float64, self.b * self.b, self.offset(name, k)).reshape(self.b, self.b)


def new_qp(pd, cq):
    return verbs.QP(pd, verbs.QPInitAttr(qp_type=IBV_QPT_RC, scq=cq, rcq=cq, cap=verbs.QPCap(4, 1)))


def post_write(qp, mr, offset, length, remote, remote_offset):
    addr, rkey = remote
    wr = verbs.SendWR(opcode=IBV_WR_RDMA_WRITE, sg=[verbs.SGE(mr.buf + offset, length, mr.lkey)],
                      send_flags=IBV_SEND_SIGNALED)
    wr.set_wr_rdma(rkey, addr + remote_offset)
    qp.post_send(wr)


def wait(cq, n):
    for wc in cq.poll_blocking(n, timeout=60):
        if wc.status != IBV_WC_SUCCESS:
            raise SystemExit(f"RDMA Write failed: {wc}")


def connect_torus(ctx, group, pd, cq, region, q):
    """One QP to the left and one to the upper neighbour; returns them and where their memory is."""
    me = group.rank
    mine = struct.pack("!QI", region.mr.buf, region.mr.rkey)
    qp_left, qp_up = new_qp(pd, cq), new_qp(pd, cq)  # we write A blocks left, B blocks up
    qp_right, qp_down = new_qp(pd, cq), new_qp(pd, cq)  # they write into us; nothing is posted on these
    with verbs.CMListener(ctx, SERVICE_BASE + me, backlog=4) as listener:
        group.barrier()  # every rank listens
        failed = []

        def accept_two():
            try:
                for _ in range(2):
                    req = listener.get_request(timeout=60)
                    listener.accept(req, qp_right if req.private_data == b"A" else qp_down, private_data=mine)
            except Exception as e:  # reported by the main thread
                failed.append(e)

        acceptor = threading.Thread(target=accept_two)
        acceptor.start()
        remote = {}
        for name, qp, peer in (("A", qp_left, left(me, q)), ("B", qp_up, up(me, q))):
            ip, udp_port = group.members[peer]
            conn = verbs.connect(qp, ip, SERVICE_BASE + peer, udp_port=udp_port, private_data=name.encode(),
                                 timeout=60)
            remote[name] = struct.unpack("!QI", conn.private_data)
        acceptor.join()
        if failed:
            raise failed[0]
    return {"A": qp_left, "B": qp_up}, remote


def torus_max(value, group, qps, remote, region, cq, q):
    """The largest ``value`` of all ranks, on every rank: a ring to the left, then a ring upwards."""
    mr, slot = region.mr, region.slots
    for name in ("A", "B"):  # the A connections go left (rows), the B connections up (columns)
        for _ in range(q - 1):
            F64.pack_into(mr.mv, region.out, value)
            post_write(qps[name], mr, region.out, 8, remote[name], slot)
            wait(cq, 1)
            group.barrier()
            value = max(value, F64.unpack_from(mr.mv, slot)[0])
            slot += 8
    return value


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-N", type=int, default=512, help="matrix size, a multiple of q (default 512)")
    ap.add_argument("--seed", type=int, default=1, help="seed of A and B (default 1)")
    args = ap.parse_args()

    with verbs.Context() as ctx, verbs.Group.from_env(ctx) as group:
        p, n = group.size, args.N
        q = math.isqrt(p)
        if q * q != p:
            if group.rank == 0:
                print(f"cannon.py needs a square number of ranks (1, 4, 9, 16, ...), not {p}", file=sys.stderr)
            return 2
        if n <= 0 or n % q:
            if group.rank == 0:
                print(f"-N {n} must be a positive multiple of q = {q}", file=sys.stderr)
            return 2
        b = n // q
        i, j = coords(group.rank, q)

        pd = verbs.PD(ctx)
        cq = verbs.CQ(ctx, 16)
        region = Region(pd, b, q)
        if q > 1:
            qps, remote = connect_torus(ctx, group, pd, cq, region, q)
        k = first_k(i, j, q)
        a_buf = [region.array("A", 0), region.array("A", 1)]
        b_buf = [region.array("B", 0), region.array("B", 1)]
        a_buf[0][:] = block(args.seed, "A", i, k, b)
        b_buf[0][:] = block(args.seed, "B", k, j, b)
        c = np.zeros((b, b))
        group.barrier()  # set-up done everywhere

        start = time.perf_counter()
        for step in range(q):
            cur, nxt = step % 2, (step + 1) % 2
            if step < q - 1:  # send this step's blocks on while multiplying them
                post_write(qps["A"], region.mr, region.offset("A", cur), region.blk, remote["A"],
                           region.offset("A", nxt))
                post_write(qps["B"], region.mr, region.offset("B", cur), region.blk, remote["B"],
                           region.offset("B", nxt))
            c += a_buf[cur] @ b_buf[cur]
            if step < q - 1:
                wait(cq, 2)
                group.barrier()  # the blocks for the next step have landed
        group.barrier()
        elapsed = time.perf_counter() - start

        err = float(np.max(np.abs(c - reference(args.seed, i, j, q, b))))
        if not math.isfinite(err):
            err = math.inf
        tol = tolerance(n)
        if err > tol:
            print(f"rank {group.rank}: block ({i}, {j}) of C is wrong, max error {err:.3g}", file=sys.stderr)
        worst = torus_max(err, group, qps, remote, region, cq, q) if q > 1 else err
        if group.rank == 0:
            print(f"C = A @ B, N = {n} on {p} ranks ({q} x {q} blocks of {b}): max error {worst:.2g}"
                  f"{'' if worst <= tol else f' > tolerance {tol:.2g}: WRONG'}, multiply {elapsed:.2f} s")
        del a_buf, b_buf  # numpy views of the region, before it is deregistered
        return 0 if worst <= tol else 1


if __name__ == "__main__":
    sys.exit(main())
