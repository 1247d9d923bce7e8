"""In-process Write stream: two Devices in one process, both loops turned by hand.

Not a test: the measurement behind README's fifth-round figures, which time
each device's pass apart (what one datagram costs the sender's daemon and the
receiver's) with no scheduler, applications or other processes in the way.

    python -m tests.daemon.inprocess_bw [--mtu 1472] [--bytes 40000000] [--no-native]
"""

from __future__ import annotations

import argparse
import time

import trio

from .test_batching import MR_LEN, Host

WRITE = 65536
DEPTH = 16


async def main(mtu: int, total: int, native: bool) -> None:
    a, b = Host("127.0.0.2", gso=True, mtu=mtu, native=native), Host("127.0.0.3", gso=True, mtu=mtu, native=native)
    try:
        a.connect(b)
        b.connect(a)
        for _ in range(200):  # the handshake crosses real loopback sockets
            a.dev.poll_once()
            b.dev.poll_once()
            if a.qp.link.link.state == b.qp.link.link.state == a.qp.link.link.state.ESTABLISHED:
                break
            await trio.sleep(0.001)
        n = total // WRITE
        posted = done = 0
        t_send = t_recv = 0.0
        start = time.perf_counter()
        while done < n:
            while posted < n and posted - done < DEPTH:
                a.post_write(posted, (posted * WRITE) % (MR_LEN - WRITE), WRITE, b, 0)
                posted += 1
            t1 = time.perf_counter()
            a.dev.poll_once()
            t2 = time.perf_counter()
            b.dev.poll_once()
            t_send += t2 - t1
            t_recv += time.perf_counter() - t2
            done += len(a.completions())
        elapsed = time.perf_counter() - start
        datagrams = b.dev.dump_stats().get("link_datagrams_received", 0)
        print(f"mtu {mtu} native={b.dev.native is not None}: {n * WRITE / elapsed / 1e6:.1f} MB/s; per datagram "
              f"sender {t_send / datagrams * 1e6:.2f} us, receiver {t_recv / datagrams * 1e6:.2f} us; "
              f"lane took {b.dev.stats['rx_native_datagrams']} of {datagrams}")
    finally:
        a.close()
        b.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mtu", type=int, default=1472)
    p.add_argument("--bytes", type=int, default=40_000_000)
    p.add_argument("--no-native", dest="native", action="store_false")
    args = p.parse_args()
    trio.run(main, args.mtu, args.bytes, args.native)
