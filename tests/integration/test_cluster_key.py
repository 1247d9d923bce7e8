"""Two real daemons with a cluster key: forged and replayed datagrams do nothing, other keys cannot talk.

The attacker is on the path: a raw socket (root, loopback) sees every
datagram, and a raw socket with ``IP_HDRINCL`` sends datagrams with any
source address and port.  The forgeries are built with the real wire
codecs from a sniffed datagram, so the same forgery is shown to land
without a key.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import tempfile
import time
from typing import Iterator

import pytest

from udpverbs import verbs
from udpverbs.daemon.clusterkey import write_new_key
from udpverbs.verbs.enums import (
    IBV_SEND_SIGNALED, IBV_WC_RECV, IBV_WC_RETRY_EXC_ERR, IBV_WC_SUCCESS, IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE,
    IBV_WR_SEND,
)
from udpverbs.wire import auth, segment
from udpverbs.wire import link as wl
from udpverbs.wire.rdmap import Opcode

from .conftest import Side, connect_manual
from .daemons import DaemonProc

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sniffing and forging datagrams needs raw sockets (root)")


@pytest.fixture(scope="module")
def keys() -> Iterator[tuple[str, str]]:
    with tempfile.TemporaryDirectory(prefix="udpverbs-keys-") as d:
        paths = (os.path.join(d, "one.key"), os.path.join(d, "two.key"))
        for p in paths:
            write_new_key(p)
        yield paths


def _key_args(path: str | None) -> tuple[str, ...]:
    return () if path is None else ("--key-file", path)


class Wire:
    """The attacker: sees every UDP datagram on loopback, sends any with any source."""

    def __init__(self) -> None:
        self.watch = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)
        self.raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
        self.raw.setsockopt(socket.IPPROTO_IP, socket.IP_HDRINCL, 1)

    def close(self) -> None:
        self.watch.close()
        self.raw.close()

    def drain(self) -> None:
        while select.select([self.watch], [], [], 0)[0]:
            self.watch.recv(65536)

    def seen(self, src: tuple[str, int], dst: tuple[str, int], wait_s: float = 0.3) -> list[bytes]:
        """The UDP payloads from ``src`` to ``dst`` seen until ``wait_s`` passes without one."""
        out = []
        while select.select([self.watch], [], [], wait_s)[0]:
            pkt = self.watch.recv(65536)
            ihl = (pkt[0] & 0xF) * 4
            sport, dport = struct.unpack_from("!HH", pkt, ihl)
            if (socket.inet_ntoa(pkt[12:16]), sport, socket.inet_ntoa(pkt[16:20]), dport) == (*src, *dst):
                out.append(pkt[ihl + 8:])
        return out

    def send(self, src: tuple[str, int], dst: tuple[str, int], payload: bytes) -> None:
        """``payload`` in a UDP datagram from ``src`` to ``dst`` (checksum 0: none, RFC 768)."""
        udp = struct.pack("!HHHH", src[1], dst[1], 8 + len(payload), 0) + payload
        ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, socket.IPPROTO_UDP, 0,
                         socket.inet_aton(src[0]), socket.inet_aton(dst[0]))
        self.raw.sendto(ip + udp, (dst[0], 0))


def _addr(d: DaemonProc) -> tuple[str, int]:
    return d.addr, d.port


def _post(a: Side, b: Side, wr_id: int, opcode: int, length: int, offset: int = 0, remote: int = 0) -> None:
    wr = verbs.SendWR(wr_id=wr_id, opcode=opcode, sg=[verbs.SGE(a.mr.buf + offset, length, a.mr.lkey)],
                      send_flags=IBV_SEND_SIGNALED)
    if opcode != IBV_WR_SEND:
        wr.set_wr_rdma(b.mr.rkey, b.mr.buf + remote)
    a.qp.post_send(wr)


def _ok(a: Side, b: Side, wr_id: int, opcode: int, length: int, offset: int = 0, remote: int = 0) -> None:
    _post(a, b, wr_id, opcode, length, offset, remote)
    (wc,) = a.cq.poll_blocking(1, timeout=20)
    assert (wc.wr_id, wc.status) == (wr_id, IBV_WC_SUCCESS), wc


def _last_data(datagrams: list[bytes], keyed: bool) -> bytes:
    """The DATA packet with the highest sequence number among ``datagrams`` (sealed if ``keyed``)."""
    best, best_seq = b"", -1
    for d in datagrams:
        h, _ = wl.decode_untrusted(d[:-auth.TRAILER_LEN] if keyed else d)
        if h.ptype == wl.PacketType.DATA and h.seq > best_seq:
            best, best_seq = d, h.seq
    assert best, "no DATA packet seen"
    return best


def _forged_write(sniffed: bytes, keyed: bool, a: Side, b: Side, remote: int, payload: bytes) -> bytes:
    """An RDMA Write of ``payload`` into ``b``'s region, as the next DATA packet
    of the link ``sniffed`` came on: its tag, the next sequence number.  With
    a key, the forger has no way to make a tag: it reuses the one it saw."""
    h, _ = wl.decode_untrusted(sniffed[:-auth.TRAILER_LEN] if keyed else sniffed)
    seg = bytearray(segment.TAGGED_PREFIX_LEN)
    segment.pack_tagged_into(seg, 0, b.qp.qp_num, a.qp.qp_num, Opcode.RDMA_WRITE, True, b.mr.rkey,
                             b.mr.buf + remote)
    pkt = wl.encode_fields(wl.PacketType.DATA, h.flags, h.path_id, h.conn_tag, h.seq + 1, h.ack, h.ts_us + 5,
                           h.ts_echo_us, h.rwnd, bytes(seg) + payload)
    return pkt + sniffed[-auth.TRAILER_LEN:] if keyed else pkt


@pytest.mark.parametrize("keyed", [False, True], ids=["no key: the forgery lands", "key: it does not"])
def test_a_write_forged_with_a_sniffed_tag(keys: tuple[str, str], keyed: bool) -> None:
    key = keys[0] if keyed else None
    forged_payload = b"FORGED BY THE PATH " * 3
    with tempfile.TemporaryDirectory(prefix="udpverbs-forge-") as d, \
            DaemonProc("uvX1", "127.0.0.2", d, seed=51, extra=_key_args(key)) as da, \
            DaemonProc("uvX2", "127.0.0.3", d, seed=52, extra=_key_args(key)) as db:
        a, b = Side(da, 1 << 16), Side(db, 1 << 16)
        wire = Wire()
        try:
            connect_manual(a, a.qp, b, b.qp)
            _ok(a, b, 1, IBV_WR_RDMA_WRITE, 64)  # the link is up and idle
            wire.drain()
            a.mr.write(b"legitimate")
            _ok(a, b, 2, IBV_WR_RDMA_WRITE, 10)
            sniffed = _last_data(wire.seen(_addr(da), _addr(db)), keyed)
            wire.send(_addr(da), _addr(db), _forged_write(sniffed, keyed, a, b, 4096, forged_payload))
            deadline = time.monotonic() + (1.0 if keyed else 5.0)
            while time.monotonic() < deadline and b.mr.read(len(forged_payload), 4096) != forged_payload:
                time.sleep(0.01)
            landed = b.mr.read(len(forged_payload), 4096) == forged_payload
            stats = b.ctx.query_stats()
            if not keyed:
                assert landed  # the threat is real: one sniffed datagram is enough
                return
            assert not landed and b.mr.read(len(forged_payload), 4096) == bytes(len(forged_payload))
            assert stats.get("auth_failed", 0) >= 1 and stats.get("auth_replayed", 0) == 0
            assert stats.get("rx_armed", 0) == 0  # the compiled armed read is off with a key
            _ok(a, b, 3, IBV_WR_RDMA_WRITE, 10, remote=100)  # and the link is unharmed
            assert (b.mr.read(10, 0), b.mr.read(10, 100)) == (b"legitimate",) * 2
        finally:
            wire.close()
            a.close()
            b.close()


def test_a_replayed_datagram_does_nothing(keys: tuple[str, str]) -> None:
    with tempfile.TemporaryDirectory(prefix="udpverbs-replay-") as d, \
            DaemonProc("uvR1", "127.0.0.2", d, seed=61, extra=_key_args(keys[0])) as da, \
            DaemonProc("uvR2", "127.0.0.3", d, seed=62, extra=_key_args(keys[0])) as db, \
            DaemonProc("uvR3", "127.0.0.4", d, seed=63, extra=_key_args(keys[0])) as dc:
        a, b = Side(da, 1 << 16), Side(db, 1 << 16)
        wire = Wire()
        try:
            connect_manual(a, a.qp, b, b.qp)
            _ok(a, b, 1, IBV_WR_RDMA_WRITE, 64)
            wire.drain()
            a.mr.write(b"first write")
            _ok(a, b, 2, IBV_WR_RDMA_WRITE, 11, remote=512)
            captured = _last_data(wire.seen(_addr(da), _addr(db)), keyed=True)
            a.mr.write(b"SECOND")
            _ok(a, b, 3, IBV_WR_RDMA_WRITE, 6, remote=512)
            assert b.mr.read(11, 512) == b"SECONDwrite"
            for _ in range(3):
                wire.send(_addr(da), _addr(db), captured)  # to its own receiver
                wire.send(_addr(da), _addr(dc), captured)  # to another daemon of the cluster
            time.sleep(0.5)
            assert b.mr.read(11, 512) == b"SECONDwrite"
            sb = b.ctx.query_stats()
            assert sb.get("auth_replayed", 0) == 3 and sb.get("auth_failed", 0) == 0
            with verbs.Context(socket_path=dc.socket_path) as ctx_c:
                assert ctx_c.query_stats().get("auth_failed", 0) == 3  # not sealed for it
            a.mr.write(b"third write")
            _ok(a, b, 4, IBV_WR_RDMA_WRITE, 11, remote=512)  # the link goes on
            assert b.mr.read(11, 512) == b"third write"
        finally:
            wire.close()
            a.close()
            b.close()


@pytest.mark.parametrize("other", [1, None], ids=["another key", "no key"])
def test_daemons_with_different_keys_cannot_talk(keys: tuple[str, str], other: int | None) -> None:
    fast = ("--link", "max_init_retransmits=2")
    with tempfile.TemporaryDirectory(prefix="udpverbs-keys-") as d, \
            DaemonProc("uvD1", "127.0.0.2", d, seed=71, extra=(*_key_args(keys[0]), *fast)) as da, \
            DaemonProc("uvD2", "127.0.0.3", d, seed=72,
                       extra=(*_key_args(None if other is None else keys[other]), *fast)) as db:
        a, b = Side(da, 1 << 16), Side(db, 1 << 16)
        try:
            connect_manual(a, a.qp, b, b.qp)
            _post(a, b, 1, IBV_WR_RDMA_WRITE, 64)
            (wc,) = a.cq.poll_blocking(1, timeout=20)
            assert (wc.wr_id, wc.status) == (1, IBV_WC_RETRY_EXC_ERR)
            assert b.mr.read(64, 0) == bytes(64)
            # Each side dropped what the other sent: as forgeries, or (no key) as garbage.
            assert a.ctx.query_stats().get("auth_failed", 0) >= 1
            sb = b.ctx.query_stats()
            if other is not None:
                assert sb.get("auth_failed", 0) >= 1
            else:
                assert sb.get("link_bad_crc", 0) + sb.get("rx_garbage", 0) + sb.get("rx_unknown_peer", 0) >= 1
            assert "handshake_timeout" in da.log_text()
        finally:
            a.close()
            b.close()


def test_a_workload_runs_with_the_key(keys: tuple[str, str]) -> None:
    n = 1 << 20
    with tempfile.TemporaryDirectory(prefix="udpverbs-keyed-") as d, \
            DaemonProc("uvW1", "127.0.0.2", d, seed=81, extra=_key_args(keys[0])) as da, \
            DaemonProc("uvW2", "127.0.0.3", d, seed=82, extra=_key_args(keys[0])) as db:
        a, b = Side(da, 4 << 20), Side(db, 4 << 20)
        try:
            connect_manual(a, a.qp, b, b.qp)
            data = os.urandom(n)
            a.mr.write(data)
            _ok(a, b, 1, IBV_WR_RDMA_WRITE, n)  # 1 MiB: runs of datagrams, GSO and GRO
            assert b.mr.read(n, 0) == data
            _ok(a, b, 2, IBV_WR_RDMA_READ, n, offset=n, remote=0)
            assert a.mr.read(n, n) == data
            for i in range(20):  # a ping-pong of small Writes: the path of a datagram sent alone
                _ok(a, b, 10 + i, IBV_WR_RDMA_WRITE, 8, offset=8 * i, remote=3 * n + 8 * i)
            assert b.mr.read(160, 3 * n) == data[:160]
            b.qp.post_recv(verbs.RecvWR(wr_id=50, sg=[verbs.SGE(b.mr.buf + 2 * n, 8192, b.mr.lkey)]))
            _ok(a, b, 51, IBV_WR_SEND, 4096, offset=0)
            (wc,) = b.cq.poll_blocking(1, timeout=20)
            assert (wc.wr_id, wc.status, wc.opcode, wc.byte_len) == (50, IBV_WC_SUCCESS, IBV_WC_RECV, 4096)
            assert b.mr.read(4096, 2 * n) == data[:4096]
            sa, sb = a.ctx.query_stats(), b.ctx.query_stats()
            for s in (sa, sb):
                assert s.get("auth_failed", 0) == 0 and s.get("auth_replayed", 0) == 0
                assert s.get("rx_armed", 0) == 0
            # nothing resent but the tail loss probes that end each burst may draw
            assert sa.get("link_retransmits", 0) <= sa.get("link_tlp_probes", 0)
        finally:
            a.close()
            b.close()
