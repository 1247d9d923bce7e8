"""In-process latency passes: what each daemon pass of a 2-byte Write hop, a Send hop and a Read costs.

Why ``read_lat`` and ``send_lat`` cost what they do against ``write_lat``
(docs/PERFORMANCE.md).  Two Devices in one process, both loops turned by
hand, one operation at a time: each phase turns one device's loop until
the phase is done (a datagram left, the data landed, the Read completed)
and times it, with no scheduler, applications or other processes in the
way.  Writes and Sends are posted inline, as ``write_lat`` and
``send_lat`` post them.  A Write hop is two passes (the sender's, the receiver's); a Send
hop likewise, the receiver's taking a posted receive and writing its CQE
(the two hosts Send in turn, as ``send_lat`` does, so each Send carries
the Modified ACK of the one before it, and each posts the receive for the
answer just before its Send, whose pass then resolves it ahead); a Read's round trip is three (the
request's, the responder's, the requester's that places the response and
completes the Read).

    python -m udpverbs.bench.inprocess_lat [--iters 2000] [--reads-only | --sends-only] [--profile PHASE]

``--profile PHASE`` (one of the phase names printed) runs cProfile over
that phase alone and prints its top functions by internal time.  Under
cProfile the Send phases run past the 200 µs a receiver holds its Modified
ACK for the answer, so the ACKs then leave alone and the profile shows a
different protocol: sample those with ``py-spy`` instead.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from typing import Callable

import trio

from ..daemon.policy import LoopPolicy
from ..wire.shm import WrOpcode

from .inprocess import Host, establish

PHASES = ("write_send", "write_receive", "send_send", "send_receive", "read_request", "read_respond", "read_complete")
#: phases with more passes than this have stopped making progress
PASS_LIMIT = 20_000
#: iterations before measuring (caches, first hints, the link's RTT estimate)
WARMUP = 100


def _turn(host: Host, done: Callable[[], bool]) -> tuple[int, int]:
    """Turn ``host``'s loop until ``done()``; return (nanoseconds, passes)."""
    t0 = time.perf_counter_ns()
    passes = 0
    while not done():
        host.dev.poll_once()
        passes += 1
        if passes > PASS_LIMIT:
            raise SystemExit(f"no progress after {PASS_LIMIT} passes")
    return time.perf_counter_ns() - t0, passes


class Phases:
    """Two hosts and the time of each phase of each iteration."""

    def __init__(self, a: Host, b: Host, profile: str | None) -> None:
        self.a, self.b = a, b
        self.profile = profile
        self.prof = cProfile.Profile() if profile else None
        self.times: dict[str, list[int]] = {p: [] for p in PHASES}
        self.passes: dict[str, list[int]] = {p: [] for p in PHASES}

    def phase(self, name: str, host: Host, done: Callable[[], bool]) -> None:
        """Turn ``host``'s loop until ``done()``, timed as phase ``name``."""
        prof = self.prof if name == self.profile else None
        if prof is not None:
            prof.enable()
        t, n = _turn(host, done)
        if prof is not None:
            prof.disable()
        self.times[name].append(t)
        self.passes[name].append(n)

    def settle(self, until: Callable[[], bool] = lambda: True) -> None:
        """ACKs and completions of the iteration just measured, outside any
        phase (``until``: what must have happened, given up to 50 ms)."""
        deadline = time.monotonic() + 0.05
        for _ in range(3):
            self.a.dev.poll_once()
            self.b.dev.poll_once()
        while not until() and time.monotonic() < deadline:
            self.a.dev.poll_once()
            self.b.dev.poll_once()

    def writes(self, count: int) -> None:
        """Inline 2-byte Writes from a to b, one at a time."""
        a, b = self.a, self.b
        la = a.qp.link.link
        for i in range(count):
            marker = i % 255 + 1
            a.mr.view[1] = marker
            a.post_write(i, 0, 2, b, 64, inline=True)
            sent = la.stats.data_sent
            self.phase("write_send", a, lambda: la.stats.data_sent > sent)
            self.phase("write_receive", b, lambda: b.mr.view[65] == marker)
            wc: list[tuple[int, int]] = []
            self.settle(lambda: bool(wc.extend(a.completions()) or wc))
            if wc != [(i, 0)]:
                raise SystemExit(f"Write {i} did not complete alone")

    def reads(self, count: int, first_id: int) -> None:
        """2-byte Reads of b's memory by a, one at a time."""
        a, b = self.a, self.b
        la, lb = a.qp.link.link, b.qp.link.link
        for i in range(count):
            a.post_write(first_id + i, 128, 2, b, 256, opcode=WrOpcode.IBV_WR_RDMA_READ)
            sent, answered = la.stats.data_sent, lb.stats.data_sent
            self.phase("read_request", a, lambda: la.stats.data_sent > sent)
            self.phase("read_respond", b, lambda: lb.stats.data_sent > answered)
            done: list[tuple[int, int]] = []

            def completed() -> bool:
                done.extend(a.completions())
                return bool(done)

            self.phase("read_complete", a, completed)
            if done != [(first_id + i, 0)]:
                raise SystemExit(f"Read {i} completed as {done}")
            self.settle()

    def sends(self, count: int) -> None:
        """The Send ping-pong: each host answers as soon as it has received,
        with nothing in between, so each Send carries the Modified ACK of
        the one before it (as in send_lat, whose applications answer within
        the link's delayed-ACK time).  As there, each posts the receive for
        the answer just before its Send."""
        a, b = self.a, self.b
        la, lb = a.qp.link.link, b.qp.link.link
        for i in range(count):
            seen: list[tuple[int, int]] = []  # a's completions this iteration
            for k, (src, dst, link) in enumerate(((a, b, la), (b, a, lb))):
                recv_id, send_id = (4 + k) * count + i, (2 + k) * count + i
                if i == 0 and k == 0:
                    dst.post_recv(recv_id, 512, 64)  # b's first
                src.post_recv(5 * count + i if k == 0 else 4 * count + i + 1, 512, 64)
                src.post_write(send_id, 0, 2, dst, 0, opcode=WrOpcode.IBV_WR_SEND, inline=True)
                sent = link.stats.data_sent
                got: list[tuple[int, int]] = []

                def received(dst: Host = dst, got: list[tuple[int, int]] = got, recv_id: int = recv_id) -> bool:
                    new = dst.completions()
                    got.extend(new)
                    return bool(new) and (recv_id, 0) in got

                self.phase("send_send", src, lambda: link.stats.data_sent > sent)
                self.phase("send_receive", dst, received)
                if dst is a:
                    seen = got
            if (2 * count + i, 0) not in seen:  # a's Send, carried by b's answer
                raise SystemExit(f"Send {i} did not complete: {seen}")

    def report(self) -> None:
        """One line per phase measured (the warm-up iterations left out), then the profile if any."""
        for name in PHASES:
            t = self.times[name][WARMUP:]
            if t:
                print(f"{name:14s} median {statistics.median(t) / 1e3:6.1f} us, p10 {sorted(t)[len(t) // 10] / 1e3:6.1f} us, "
                      f"passes {statistics.median(self.passes[name][WARMUP:]):g}")
        if self.prof is not None:
            pstats.Stats(self.prof).sort_stats("tottime").print_stats(30)


async def main(iters: int, only: str | None, profile: str | None) -> None:
    # No hand-over after a send: with nobody else to run, its yields would
    # time the wait, not the pass.
    policy = LoopPolicy(hand_over_s=0.0)
    a, b = Host("127.0.0.2", gso=True, policy=policy), Host("127.0.0.3", gso=True, policy=policy)
    for h in (a, b):
        h.qp.caps["max_inline_data"] = 64  # Writes and Sends go inline, as perftest posts them
    try:
        a.connect(b)
        b.connect(a)
        await establish(a, b)
        run = Phases(a, b, profile)
        count = iters + WARMUP
        # The Writes before the Reads: b answers a Read Request at once, and
        # a link that has seen answers holds the ACK a Write asks for (up to
        # max_ack_delay_s) for the answer no Write gets here.
        run.writes(count if only is None else 0)
        run.reads(count if only != "sends" else 0, count)
        run.sends(count if only != "reads" else 0)
        run.report()
    finally:
        a.close()
        b.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000)
    only = p.add_mutually_exclusive_group()
    only.add_argument("--reads-only", dest="only", action="store_const", const="reads",
                      help="Reads alone, as read_lat runs them (no Write hint set)")
    only.add_argument("--sends-only", dest="only", action="store_const", const="sends", help="the Send ping-pong alone")
    p.add_argument("--profile", choices=PHASES, help="profile this phase (cProfile)")
    args = p.parse_args()
    trio.run(main, args.iters, args.only, args.profile)
