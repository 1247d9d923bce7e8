"""In-process Write stream: two Devices in one process, both loops turned by hand.

What one datagram costs the sending daemon and the receiving one, each
device's pass timed apart, with no scheduler, applications or other
processes in the way (docs/PERFORMANCE.md).

    python -m udpverbs.bench.inprocess_bw [--mtu 1472] [--size 65536] [--bytes 40000000] [--qps 1] [--depth 16]
                                        [--no-native] [--send]

With ``--qps N`` the Writes are spread over N QP pairs on the one link,
``--depth`` Writes in flight in all (at least one per QP).  ``--send``
streams Sends instead, on one QP, each into a receive posted ahead of it
(at most the 4 a test Host's QP holds).
"""

from __future__ import annotations

import argparse
import time

import trio

from ..wire.shm import WrOpcode

from .inprocess import MR_LEN, Host, establish, qp_pairs

TIME_LIMIT_S = 300  # a stream that stops moving ends the run


async def main(mtu: int, total: int, native: bool, nqp: int, depth: int, send: bool = False,
               size: int = 65536) -> None:
    a, b = Host("127.0.0.2", gso=True, mtu=mtu, native=native), Host("127.0.0.3", gso=True, mtu=mtu, native=native)
    try:
        pairs = qp_pairs(a, b, nqp)
        await establish(a, b)
        n = total // size
        per_qp = max(1, depth // nqp)
        if per_qp > Host.QP_CAPS["max_send_wr"]:
            # more would overrun the send queue ring and the stream would never start
            raise SystemExit(f"--depth {depth} over {nqp} QP(s) is {per_qp} Writes per QP; "
                             f"a test QP's send queue holds {Host.QP_CAPS['max_send_wr']}")
        if send:
            nqp, pairs, per_qp = 1, pairs[:1], min(depth, Host.QP_CAPS["max_recv_wr"])
            for i in range(per_qp):
                b.post_recv(i, 0, size)
        opcode = WrOpcode.IBV_WR_SEND if send else WrOpcode.IBV_WR_RDMA_WRITE
        out = [0] * nqp
        posted = done = 0
        t_send = t_recv = 0.0
        start = time.perf_counter()
        while done < n:
            if time.perf_counter() - start > TIME_LIMIT_S:
                raise SystemExit(f"gave up after {TIME_LIMIT_S} s: {done} of {n} Writes done")
            for k, (qa, _) in enumerate(pairs):
                while out[k] < per_qp and posted < n:
                    a.post_write(k, (posted * size) % (MR_LEN - size), size, b, 0, qp=qa, opcode=opcode)
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
            if send:
                for wr_id, _ in b.completions():
                    b.post_recv(wr_id, 0, size)  # the receive that took a Send, posted again
        elapsed = time.perf_counter() - start
        stats, sent = b.dev.dump_stats(), a.dev.dump_stats()
        datagrams = stats.get("link_datagrams_received", 0)
        print(f"{'send' if send else 'write'} mtu {mtu} qps {nqp} native={b.dev.native is not None}: {n * size / elapsed / 1e6:.1f} MB/s; "
              f"per datagram sender {t_send / datagrams * 1e6:.2f} us, receiver {t_recv / datagrams * 1e6:.2f} us; "
              f"lanes took {sent.get('tx_native_datagrams', 0)} sent and "
              f"{stats.get('rx_native_datagrams', 0)} received of {datagrams}; "
              f"{sent.get('tx_gso_sends', 0)} sends")
    finally:
        a.close()
        b.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mtu", type=int, default=1472)
    p.add_argument("--size", type=int, default=65536, help="bytes a message")
    p.add_argument("--bytes", type=int, default=40_000_000)
    p.add_argument("--qps", type=int, default=1)
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--no-native", dest="native", action="store_false")
    p.add_argument("--send", action="store_true", help="stream Sends instead of RDMA Writes")
    args = p.parse_args()
    trio.run(main, args.mtu, args.bytes, args.native, args.qps, args.depth, args.send, args.size)
