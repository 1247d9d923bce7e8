"""A blind spoofed INIT changes nothing; an INIT flood costs no state.

The forged datagrams leave a raw socket (``IP_HDRINCL``, so the source
address and port are whatever we write; root on loopback), and a raw UDP
socket watches what the daemon answers.
"""

from __future__ import annotations

import collections
import os
import random
import select
import socket
import struct
import tempfile
import time

import pytest

from udpverbs import verbs
from udpverbs.verbs.enums import IBV_QPS_RTS, IBV_SEND_SIGNALED, IBV_WC_SUCCESS, IBV_WR_RDMA_WRITE
from udpverbs.wire import link as wl

from .conftest import Side, connect_manual
from .daemons import DaemonProc

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="forging source addresses needs a raw socket (root)")


def _forged_init(src: tuple[str, int], dst: tuple[str, int], tag: int, incarnation: int) -> bytes:
    body = wl.encode_init(wl.LinkInit(tag, 1234, 1400, 64, incarnation))
    payload = wl.encode_fields(wl.PacketType.INIT, 0, 0, 0, 1234, 0, 0, 0, 64, body)
    udp = struct.pack("!HHHH", src[1], dst[1], 8 + len(payload), 0) + payload  # checksum 0: none (RFC 768)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, socket.IPPROTO_UDP, 0,
                     socket.inet_aton(src[0]), socket.inet_aton(dst[0]))  # the kernel fills the checksum
    return ip + udp


def _raw_sender() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    s.setsockopt(socket.IPPROTO_IP, socket.IP_HDRINCL, 1)
    return s


def _write_ok(a: Side, b: Side, wr_id: int) -> None:
    wr = verbs.SendWR(wr_id=wr_id, opcode=IBV_WR_RDMA_WRITE, sg=[verbs.SGE(a.mr.buf, 100, a.mr.lkey)],
                      send_flags=IBV_SEND_SIGNALED)
    wr.set_wr_rdma(b.mr.rkey, b.mr.buf)
    a.qp.post_send(wr)
    (wc,) = a.cq.poll_blocking(1, timeout=10)
    assert (wc.wr_id, wc.status) == (wr_id, IBV_WC_SUCCESS)


def test_blind_spoofed_init_changes_nothing() -> None:
    # On main this INIT was taken as the peer's restart: every QP to the peer failed.
    with tempfile.TemporaryDirectory(prefix="udpverbs-spoof-") as d:
        with DaemonProc("uvS1", "127.0.0.2", d, seed=31) as da, DaemonProc("uvS2", "127.0.0.3", d, seed=32) as db:
            a, b = Side(da, 1 << 16), Side(db, 1 << 16)
            connect_manual(a, a.qp, b, b.qp)
            _write_ok(a, b, 1)
            raw = _raw_sender()
            try:
                rng = random.Random(5)
                for incarnation in (rng.getrandbits(63), None):  # a "restart", then a "reset" (same run, new tag)
                    inc = incarnation if incarnation is not None else 0
                    raw.sendto(_forged_init((db.addr, db.port), (da.addr, da.port), rng.randrange(1, 1 << 32),
                                            inc), (da.addr, 0))
                    time.sleep(1.0)  # many restart-probe windows
                    _write_ok(a, b, 2)
            finally:
                raw.close()
            assert a.qp.query()[0].qp_state == IBV_QPS_RTS and b.qp.query()[0].qp_state == IBV_QPS_RTS
            assert "ended" not in da.log_text()
            a.close()
            b.close()


def test_init_flood_costs_no_state() -> None:
    # On main each INIT made a half-open link (and nine INIT_ACKs); 1,023 filled the table.
    n = 10_000
    with tempfile.TemporaryDirectory(prefix="udpverbs-flood-") as d:
        with DaemonProc("uvF1", "127.0.0.2", d, seed=41) as da:
            raw, watch = _raw_sender(), socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)
            answers: collections.Counter[int] = collections.Counter()

            def drain(until: float) -> None:
                while True:
                    r, _, _ = select.select([watch], [], [], max(0.0, until - time.monotonic()))
                    if not r:
                        return
                    pkt = watch.recv(65536)
                    src, dst = socket.inet_ntoa(pkt[12:16]), socket.inet_ntoa(pkt[16:20])
                    sport, dport = struct.unpack_from("!HH", pkt, 20)
                    if (src, sport, dst) == (da.addr, da.port, "127.0.0.5"):
                        answers[dport] += 1

            try:
                for i in range(n):
                    raw.sendto(_forged_init(("127.0.0.5", 20000 + i), (da.addr, da.port), i + 1, 7), (da.addr, 0))
                    if i % 256 == 255:
                        drain(time.monotonic())
                drain(time.monotonic() + 1.0)
            finally:
                raw.close()
                watch.close()
            assert max(answers.values(), default=0) <= 1  # at most one answer each
            assert sum(answers.values()) < n // 10  # and rate-limited per source address
            assert "link from 127.0.0.5" not in da.log_text()  # no link state
            # a real peer still connects at once
            with DaemonProc("uvF2", "127.0.0.3", d, seed=42) as db:
                a, b = Side(da, 1 << 16), Side(db, 1 << 16)
                connect_manual(a, a.qp, b, b.qp)
                _write_ok(a, b, 1)
                a.close()
                b.close()


def test_a_peer_of_another_link_version_is_named_in_the_log_once() -> None:
    from udpverbs.wire.crc import append_crc

    packet = wl.encode_fields(wl.PacketType.INIT, 0, 0, 0, 1234, 0, 0, 0, 64,
                              wl.encode_init(wl.LinkInit(77, 1234, 1400, 64, 5)))
    old = append_crc(bytearray(b"\x01" + packet[1:-4]))  # version 1, a valid CRC
    with tempfile.TemporaryDirectory(prefix="udpverbs-ver-") as d, DaemonProc("uvV1", "127.0.0.2", d, seed=33) as da:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.bind(("127.0.0.4", 0))
            for _ in range(3):
                s.sendto(old, ("127.0.0.2", da.port))
            ctx = verbs.Context(socket_path=da.socket_path)
            deadline = time.monotonic() + 10
            while ctx.query_stats().get("rx_bad_version", 0) < 3:
                assert time.monotonic() < deadline, ctx.query_stats()
                time.sleep(0.01)
            ctx.close()
            port = s.getsockname()[1]
        finally:
            s.close()
        lines = [line for line in da.log_text().splitlines() if "speaks link version" in line]
    assert len(lines) == 1 and f"127.0.0.4:{port} speaks link version 1, this daemon {wl.LINK_VERSION}" in lines[0]
