"""In-process Write stream: two Devices in one process, both loops turned by hand.

Not a test: the measurement behind README's fifth- and sixth-round figures,
which time each device's pass apart (what one datagram costs the sender's
daemon and the receiver's) with no scheduler, applications or other
processes in the way.

    python -m tests.daemon.inprocess_bw [--mtu 1472] [--bytes 40000000] [--qps 1] [--depth 16] [--no-native]

With ``--qps N`` the Writes are spread over N QP pairs on the one link,
``--depth`` Writes in flight in all (at least one per QP).
"""

from __future__ import annotations

import argparse
import time

import trio

from udpverbs.daemon.qp import QueuePair
from udpverbs.wire import shm
from udpverbs.wire.shm import WrOpcode

from .test_batching import MR_LEN, Host

WRITE = 65536
TIME_LIMIT_S = 300  # a stream that stops moving ends the run


def _more_qps(a: Host, b: Host, n: int) -> list[tuple[QueuePair, QueuePair]]:
    """QPs 2..n on both hosts (same PD, CQ and region as QP 1), connected pairwise."""
    pairs = [(a.qp, b.qp)]
    for qpn in range(2, n + 1):
        qa, qb = (QueuePair(h.dev, qpn, h.sess, h.qp.pd, h.cq, h.cq, dict(Host.QP_CAPS), False) for h in (a, b))
        a.dev.qps[qpn], b.dev.qps[qpn] = qa, qb
        pairs.append((qa, qb))
    return pairs


def _post(a: Host, qp: QueuePair, wr_id: int, src_off: int, b: Host) -> None:
    ring = qp.sq
    ring.prod = ring.hdr.producer
    at = ring.next_slot_offset()
    shm.SEND_WQE_HEAD.pack_into(ring.buf, at, wr_id, b.mr.addr, int(WrOpcode.IBV_WR_RDMA_WRITE),
                                int(shm.SendFlags.IBV_SEND_SIGNALED), 1, 0, b.mr.stag, 0, 0, 0)
    shm.SGE.pack_into(ring.buf, at + shm.SEND_WQE_SG_OFFSET, a.mr.addr + src_off, WRITE, a.mr.stag)
    ring.push()
    ring.publish()


async def main(mtu: int, total: int, native: bool, nqp: int, depth: int) -> None:
    a, b = Host("127.0.0.2", gso=True, mtu=mtu, native=native), Host("127.0.0.3", gso=True, mtu=mtu, native=native)
    try:
        pairs = _more_qps(a, b, nqp)
        for qa, qb in pairs:
            a.connect(b, qa, qb.qpn)
            b.connect(a, qb, qa.qpn)
        for _ in range(300):  # the handshake crosses real loopback sockets
            a.dev.poll_once()
            b.dev.poll_once()
            if a.qp.link.link.state == b.qp.link.link.state == a.qp.link.link.state.ESTABLISHED:
                break
            await trio.sleep(0.001)
        n = total // WRITE
        per_qp = max(1, depth // nqp)
        out = [0] * nqp
        posted = done = 0
        t_send = t_recv = 0.0
        start = time.perf_counter()
        while done < n:
            if time.perf_counter() - start > TIME_LIMIT_S:
                raise SystemExit(f"gave up after {TIME_LIMIT_S} s: {done} of {n} Writes done")
            for k, (qa, _) in enumerate(pairs):
                while out[k] < per_qp and posted < n:
                    _post(a, qa, k, (posted * WRITE) % (MR_LEN - WRITE), b)
                    out[k] += 1
                    posted += 1
            t1 = time.perf_counter()
            a.dev.poll_once()
            t2 = time.perf_counter()
            b.dev.poll_once()
            t_send += t2 - t1
            t_recv += time.perf_counter() - t2
            for wr_id, _ in a.completions():
                out[wr_id] -= 1
                done += 1
        elapsed = time.perf_counter() - start
        stats = b.dev.dump_stats()
        datagrams = stats.get("link_datagrams_received", 0)
        print(f"mtu {mtu} qps {nqp} native={b.dev.native is not None}: {n * WRITE / elapsed / 1e6:.1f} MB/s; "
              f"per datagram sender {t_send / datagrams * 1e6:.2f} us, receiver {t_recv / datagrams * 1e6:.2f} us; "
              f"lanes took {a.dev.dump_stats().get('tx_native_datagrams', 0)} sent and "
              f"{stats.get('rx_native_datagrams', 0)} received of {datagrams}")
    finally:
        a.close()
        b.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mtu", type=int, default=1472)
    p.add_argument("--bytes", type=int, default=40_000_000)
    p.add_argument("--qps", type=int, default=1)
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--no-native", dest="native", action="store_false")
    args = p.parse_args()
    trio.run(main, args.mtu, args.bytes, args.native, args.qps, args.depth)
