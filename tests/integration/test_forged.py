"""Forged link packets between two real daemons: no silent hang.

An on-path attacker who saw one datagram knows the link's tags (they travel
in the clear) and can send packets, from the peer's address, that the tag
check accepts.  Those with wild sequence, ACK or SACK fields are dropped
and counted; and a link that stops making progress (here: an attacker who
acknowledges everything and keeps the window shut while the real peer is
stopped) fails within the retransmission budget, its WRs completing with
IBV_WC_RETRY_EXC_ERR and the application told by an async event.

Forged datagrams leave a raw socket (``IP_HDRINCL``, root on loopback); a
raw UDP socket with a BPF filter watches one daemon's datagrams.
"""

from __future__ import annotations

import ctypes
import os
import random
import select
import signal
import socket
import struct
import tempfile
import threading
import time

import pytest

from udpverbs import verbs
from udpverbs.verbs.enums import (
    IBV_EVENT_QP_FATAL,
    IBV_QPS_ERR,
    IBV_SEND_SIGNALED,
    IBV_WC_RETRY_EXC_ERR,
    IBV_WC_SUCCESS,
    IBV_WC_WR_FLUSH_ERR,
    IBV_WR_RDMA_WRITE,
)
from udpverbs.wire import link as wl

from .conftest import Side, connect_manual
from .daemons import DaemonProc
from .test_handshake_hostile import _raw_sender

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="forging source addresses needs a raw socket (root)")

_U32 = 0xFFFFFFFF
_OURS = 0x4242  # the IP id of our forged datagrams: the watcher leaves them out
_SO_ATTACH_FILTER = 26


def _forge(src: tuple[str, int], dst: tuple[str, int], payload: bytes) -> bytes:
    udp = struct.pack("!HHHH", src[1], dst[1], 8 + len(payload), 0) + payload  # checksum 0: none (RFC 768)
    return struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), _OURS, 0, 64, socket.IPPROTO_UDP, 0,
                       socket.inet_aton(src[0]), socket.inet_aton(dst[0])) + udp


class Watcher:
    """Datagrams from ``src`` (not ours), seen by a raw socket: their first link header."""

    def __init__(self, src: tuple[str, int]) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)
        ip = struct.unpack("!I", socket.inet_aton(src[0]))[0]
        prog = [(0x28, 0, 0, 4), (0x15, 4, 0, _OURS),  # ldh [4] (IP id): ours, drop
                (0x20, 0, 0, 12), (0x15, 0, 2, ip),  # ld [12]: the source address
                (0x28, 0, 0, 20), (0x15, 1, 0, src[1]),  # ldh [20]: the source port
                (0x06, 0, 0, 0), (0x06, 0, 0, 0xFFFF)]
        self._prog = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))
        self.sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER,
                             struct.pack("HL", len(prog), ctypes.addressof(self._prog)))
        self.src = src

    def next(self, timeout_s: float) -> wl.LinkHeader | None:
        """The next DATA/ACK/KEEPALIVE header, or None after ``timeout_s``."""
        end = time.monotonic() + timeout_s
        while True:
            r, _, _ = select.select([self.sock], [], [], max(0.0, end - time.monotonic()))
            if not r:
                return None
            pkt = self.sock.recv(65536)
            # What arrived before the filter was attached is anyone's: another
            # daemon's tag taken for the peer's made the forgeries miss.
            ip_src, sport = socket.inet_ntoa(pkt[12:16]), struct.unpack_from("!H", pkt, 20)[0]
            if (ip_src, sport) != self.src or struct.unpack_from("!H", pkt, 4)[0] == _OURS:
                continue
            # the first link header (a GSO datagram holds several: the first is enough here)
            f = struct.unpack_from("!BBBBIIIIIHBB", pkt, 28)
            if f[1] in (wl.PacketType.DATA, wl.PacketType.ACK, wl.PacketType.KEEPALIVE):
                return wl.LinkHeader(f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9])

    def close(self) -> None:
        self.sock.close()


def _write(a: Side, b: Side, wr_id: int, size: int) -> None:
    wr = verbs.SendWR(wr_id=wr_id, opcode=IBV_WR_RDMA_WRITE, sg=[verbs.SGE(a.mr.buf, size, a.mr.lkey)],
                      send_flags=IBV_SEND_SIGNALED)
    wr.set_wr_rdma(b.mr.rkey, b.mr.buf)
    a.qp.post_send(wr)


def _tag_of(watch: Watcher, a: Side, b: Side) -> int:
    """The tag of the daemon the watched one sends to (writes until a datagram is seen)."""
    for i in range(50):
        _write(a, b, 1000 + i, 64)
        h = watch.next(0.2)
        a.cq.poll_blocking(1, timeout=10)
        if h is not None:
            return h.conn_tag
    raise AssertionError("no datagram seen")


def test_wild_forged_packets_are_dropped_and_the_writes_keep_their_pace() -> None:
    # On main the receiving daemon echoed the forged timestamps: the writer's
    # RTT estimate grew to minutes and its pacer let a datagram go now and
    # then (the writes below took minutes; no error, no event).
    with tempfile.TemporaryDirectory(prefix="udpverbs-forge-") as d:
        with DaemonProc("uvW1", "127.0.0.2", d, seed=61) as da, DaemonProc("uvW2", "127.0.0.3", d, seed=62) as db:
            a, b = Side(da, 1 << 20), Side(db, 1 << 20)
            connect_manual(a, a.qp, b, b.qp)
            pa, pb = (da.addr, da.port), (db.addr, db.port)
            watch_a, watch_b = Watcher(pa), Watcher(pb)
            raw = _raw_sender()
            stop = threading.Event()
            sent = [0]
            try:
                tag_b, tag_a = _tag_of(watch_a, a, b), _tag_of(watch_b, a, b)

                def forger() -> None:
                    rng = random.Random(7)
                    while not stop.is_set() and sent[0] < 200_000:
                        for src, dst, tag in ((pa, pb, tag_b), (pb, pa, tag_a)):
                            s = rng.randrange(1 << 32)
                            sack = ((s, (s + rng.randrange(1, 1 << 20)) & _U32),) if rng.random() < 0.5 else ()
                            ptype = rng.choice([wl.PacketType.DATA, wl.PacketType.ACK])
                            p = wl.encode_fields(ptype, 0, 0, tag, rng.randrange(1 << 32), rng.randrange(1 << 32),
                                                 rng.randrange(1 << 32), rng.randrange(1 << 32),
                                                 rng.choice([0, 1, 0xFFFF]), b"x" * 40, sack)
                            raw.sendto(_forge(src, dst, p), (dst[0], 0))
                            sent[0] += 1
                        time.sleep(0.0002)

                th = threading.Thread(target=forger)
                th.start()
                try:
                    t0 = time.monotonic()
                    while sent[0] < 2000 and time.monotonic() - t0 < 10:
                        time.sleep(0.01)  # the forged packets are there first, and go on
                    t0 = time.monotonic()
                    posted = done = 0
                    while done < 200:
                        assert time.monotonic() - t0 < 20, f"{done} of 200 writes in 20 s"
                        while posted < 200 and posted - done < 8:
                            posted += 1
                            _write(a, b, posted, 100_000)
                        n, wcs = a.cq.poll(8)
                        assert all(wc.status == IBV_WC_SUCCESS for wc in wcs), wcs
                        done += n
                        if not n:
                            time.sleep(0.001)
                    elapsed = time.monotonic() - t0
                finally:
                    stop.set()
                    th.join()
            finally:
                raw.close()
                watch_a.close()
                watch_b.close()
            assert sent[0] >= 2000
            assert elapsed < 10, f"200 writes took {elapsed:.1f} s under forged packets"
            for side in (a, b):
                s = side.ctx.query_stats()
                assert s["link_bad_seq"] + s["link_bad_ack"] + s["link_bad_sack"] > 0, s
            a.close()
            b.close()


# A budget that outlasts the attacker's reaction: RTOs of 0.2, then 0.4 s.
SLOW_RTO = ("--link", "min_rto_s=0.2", "--link", "max_rto_s=0.4", "--link", "max_retransmits=3", "--no-gso")


def test_a_peer_that_acknowledges_everything_and_keeps_its_window_shut_fails_the_link() -> None:
    # On main nothing of ours was in flight, so no timer ran, and the forged
    # packets kept the link alive: the queued writes waited for ever.
    with tempfile.TemporaryDirectory(prefix="udpverbs-forge-") as d:
        with DaemonProc("uvZ1", "127.0.0.2", d, seed=71, extra=SLOW_RTO) as da, \
                DaemonProc("uvZ2", "127.0.0.3", d, seed=72, extra=SLOW_RTO) as db:
            a, b = Side(da, 1 << 20), Side(db, 1 << 20)
            connect_manual(a, a.qp, b, b.qp)
            pa, pb = (da.addr, da.port), (db.addr, db.port)
            watch_a, watch_b = Watcher(pa), Watcher(pb)
            raw = _raw_sender()
            assert db.proc is not None
            try:
                tag_a = _tag_of(watch_b, a, b)
                db.proc.send_signal(signal.SIGSTOP)  # the real peer says nothing from now on
                for i in range(1, 21):
                    _write(a, b, i, 65536)  # far more than one window: most of it stays queued
                # acknowledge all that leaves, window 0, as long as the link lives
                end = time.monotonic() + 15
                top = last = None
                failed = False
                while time.monotonic() < end and not failed:
                    h = watch_a.next(0.02)
                    while h is not None:
                        if top is None or (h.seq - top) & _U32 < 1 << 31:
                            top = h.seq
                        last = h
                        h = watch_a.next(0)
                    if last is not None:
                        p = wl.encode_fields(wl.PacketType.ACK, 0, 0, tag_a, last.ack, (top + 1) & _U32,
                                             0, last.ts_us, 0)
                        raw.sendto(_forge(pb, pa, p), (pa[0], 0))
                    failed = a.qp.query()[0].qp_state == IBV_QPS_ERR
            finally:
                raw.close()
                watch_a.close()
                watch_b.close()
                db.proc.send_signal(signal.SIGCONT)
            assert failed, "the link did not fail"
            wcs: list[verbs.WC] = []
            deadline = time.monotonic() + 10
            while len(wcs) < 20 and time.monotonic() < deadline:
                wcs += a.cq.poll(20)[1]
            statuses = [wc.status for wc in wcs]
            assert len(wcs) == 20 and IBV_WC_RETRY_EXC_ERR in statuses, statuses
            first = statuses.index(IBV_WC_RETRY_EXC_ERR)
            assert set(statuses[:first]) <= {IBV_WC_SUCCESS}  # what the forged ACKs covered
            assert set(statuses[first + 1:]) == {IBV_WC_WR_FLUSH_ERR}
            ev = a.ctx.get_async_event(timeout=5)
            assert (ev.event_type, ev.element) == (IBV_EVENT_QP_FATAL, a.qp.qp_num)
            assert "retransmit_budget" in da.log_text()
            a.close()
            b.close()
