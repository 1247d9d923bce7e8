"""A real daemon fuzzed from outside, through its UDP port and its control socket.

Two daemons, A and B, each a subprocess.  On A, application 1 registers a
region with remote write, read and atomics (its length not a multiple of
the page, so the mapping has bytes past it), one with remote read only,
one with local access only, a receive buffer and a guard region with no
access at all; its QP is connected to a peer the test plays itself
(``fuzz_peer.FakePeer``: the project's own sans-IO link over a UDP socket
of the test process, handshake and cookie included).  Application 2 on A
and one on B have connected QPs and regions of their own.

Hypothesis then sends A's UDP port random bytes and link datagrams with
random fields (from unknown addresses, from the peer's socket, and spoofed
as B), and, over the fake peer's link, DDP/RDMAP messages with random
opcodes, STags (the real ones among them), offsets, lengths, MSNs, queue
numbers, atomic bodies and Terminates, and the other engines' messages.
After each example A is alive and no byte changed that only a valid
remote access could change: the guard, the regions without remote write,
application 2's and B's regions, and the bytes of each mapping past its
region.  At the end the A-B QPs still move data (a Write and a Send,
checked by digest), A's garbage counters grew, and A's log holds no
traceback or logged error.

The control socket gets, from connections of other processes (a child
opens each and exits, so the daemon sees another application): random
bytes, headers of any op with bodies cut short or too long, well-formed
requests with edge values, file descriptors of every kind, and hang-ups
while a request is served.  Each request is answered or ends its session
alone; application 2 keeps working after every example; A's open file
descriptors come back to their count.

``UDPVERBS_FUZZ_EXAMPLES=N`` runs N examples per test, randomized (the
default is a few dozen, derandomized: the same on every run).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import os
import random
import select
import socket
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from udpverbs import verbs
from udpverbs.verbs.enums import (
    IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_ATOMIC, IBV_ACCESS_REMOTE_READ, IBV_ACCESS_REMOTE_WRITE,
    IBV_QP_STATE, IBV_QPS_RESET, IBV_QPS_RTS, IBV_QPT_RC, IBV_SEND_SIGNALED, IBV_WC_RECV, IBV_WC_SUCCESS,
    IBV_WR_RDMA_WRITE, IBV_WR_SEND,
)
from udpverbs.wire import ctl, envelope, rdmap
from udpverbs.wire import link as wl
from udpverbs.wire.errors import WireError

from .daemons import DaemonProc
from .fuzz_messages import (BLOCKING_OPS, Targets, resolve, link_datagrams, link_messages, random_datagrams, raw_requests,
                            valid_requests)
from .fuzz_peer import FakePeer, can_spoof, raw_sender, spoof

EXAMPLES = int(os.environ.get("UDPVERBS_FUZZ_EXAMPLES", "0"))


def fuzz_settings(default: int) -> settings:
    """``default`` derandomized examples, or ``$UDPVERBS_FUZZ_EXAMPLES`` random ones."""
    return settings(max_examples=EXAMPLES or default, deadline=None, derandomize=not EXAMPLES, database=None,
                    suppress_health_check=list(HealthCheck))


A_IP, B_IP, PEER_IP = "127.0.4.2", "127.0.4.3", "127.0.4.9"
STRANGER_IPS = ("127.0.4.20", "127.0.4.21")
PEER_QPN = 0x77
RECEIVES = 8  #: receives kept posted on the fuzzed QP (Sends land there)
ALL = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC
#: application 1's regions: name -> (length, access); "rw" and "recv" may change, the rest never
REGIONS = {"rw": (12_000, ALL), "ro": (5_000, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ),
           "none": (4096, IBV_ACCESS_LOCAL_WRITE), "recv": (3000, IBV_ACCESS_LOCAL_WRITE), "guard": (8192, 0)}
MAY_CHANGE = ("rw", "recv")
#: what a daemon's log must never say
BAD_LOG = ("Traceback", " ERROR ", " CRITICAL ", "failed; tearing it down", "error handling")


def _connect(qp: verbs.QP, ip: str, port: int, dest_qpn: int) -> None:
    attr = verbs.QPAttr(qp_access_flags=ALL, dest_qp_num=dest_qpn, max_rd_atomic=4, max_dest_rd_atomic=4)
    attr.ah_attr = verbs.AHAttr(dlid=port, gr=verbs.GlobalRoute(dgid=verbs.GID(ctl.gid_from_ip(ip))))
    qp.to_rts(attr)


class App:
    """One application: a context, a PD, regions filled with a pattern, a CQ and a QP."""

    def __init__(self, daemon: DaemonProc, regions: dict[str, tuple[int, int]], seed: int) -> None:
        self.ctx = verbs.Context(socket_path=daemon.socket_path)
        self.pd = verbs.PD(self.ctx)
        rng = random.Random(seed)
        self.mrs = {}
        for name, (length, access) in regions.items():
            mr = self.mrs[name] = verbs.MR(self.pd, length, access)
            mr._mm[:] = rng.randbytes(len(mr._mm))  # the mapping past the region too
        self.cq = verbs.CQ(self.ctx, 1024)
        self.qp = verbs.QP(self.pd, verbs.QPInitAttr(qp_type=IBV_QPT_RC, scq=self.cq, rcq=self.cq,
                                                      cap=verbs.QPCap(64, RECEIVES * 2, 1, 1)))

    def drain(self) -> list[Any]:
        out = []
        while True:
            n, wcs = self.cq.poll(64)
            if not n:
                return out
            out += wcs


class World:
    """Daemons A and B, their applications, and the fake peer of A (see the module docstring)."""

    def __init__(self, runtime_dir: str) -> None:
        self.a = DaemonProc("uvZA", A_IP, runtime_dir, seed=61).start()
        self.b = DaemonProc("uvZB", B_IP, runtime_dir, seed=62).start()
        self.app1 = App(self.a, REGIONS, 1)
        self.app2 = App(self.a, {"rw": (16_384, ALL)}, 2)
        self.appb = App(self.b, {"rw": (16_384, ALL)}, 3)
        _connect(self.app2.qp, B_IP, self.b.port, self.appb.qp.qp_num)
        _connect(self.appb.qp, A_IP, self.a.port, self.app2.qp.qp_num)
        self.peer = FakePeer(PEER_IP, (A_IP, self.a.port), seed=63)
        self.peer.open()
        self.resets = 0  # times the fuzzed QP ended in ERR (a Terminate, a violation) and was connected again
        self.reopens = 0  # times the fake peer's link failed and was opened again
        self._reconnect()
        self.snapshot()
        self.targets = Targets(
            qpn=self.app1.qp.qp_num, peer_qpn=PEER_QPN, other_qpns=(self.app2.qp.qp_num,),
            regions=tuple((mr.rkey, mr.buf, mr.length) for app in (self.app1, self.app2, self.appb)
                          for mr in app.mrs.values()),
            max_body=self.peer.max_payload)

    def _reconnect(self) -> None:
        qp = self.app1.qp
        qp.modify(verbs.QPAttr(qp_state=IBV_QPS_RESET), IBV_QP_STATE)
        self.app1.drain()
        _connect(qp, PEER_IP, self.peer.addr[1], PEER_QPN)
        for _ in range(RECEIVES):
            self._post_recv()

    def _post_recv(self) -> None:
        mr = self.app1.mrs["recv"]
        self.app1.qp.post_recv(verbs.RecvWR(wr_id=1, sg=[verbs.SGE(mr.buf, mr.length, mr.lkey)]))

    # -- what may and may not change ------------------------------------------------
    def _guarded(self) -> Iterator[tuple[str, verbs.MR, int]]:
        """(name, region, first guarded byte of its mapping)."""
        for name, mr in self.app1.mrs.items():
            yield name, mr, mr.length if name in MAY_CHANGE else 0
        yield "app2", self.app2.mrs["rw"], 0
        yield "B", self.appb.mrs["rw"], 0

    def snapshot(self) -> None:
        self.frozen = {name: bytes(mr._mm[start:]) for name, mr, start in self._guarded()}

    def check(self) -> None:
        """A is alive, and nothing changed that no valid remote access could change."""
        assert self.a.proc is not None and self.a.proc.poll() is None, self.a.log_text()
        for name, mr, start in self._guarded():
            if bytes(mr._mm[start:]) != self.frozen[name]:
                at = next(i for i, (x, y) in enumerate(zip(mr._mm[start:], self.frozen[name])) if x != y)
                raise AssertionError(f"region {name} changed at byte {start + at} (length {mr.length})")

    def refresh(self) -> None:
        """After an example: the fake peer's link open, the fuzzed QP in RTS with its receives posted."""
        if self.peer.link.state != self.peer.link.state.ESTABLISHED:
            self.reopens += 1
            self.peer.open()
        wcs = self.app1.drain()
        if self.app1.qp.query()[0].qp_state != IBV_QPS_RTS:
            self.resets += 1
            self._reconnect()
        else:
            for _ in wcs:
                self._post_recv()

    def ping(self) -> None:
        """A round trip through the fake peer's link: A has worked through everything sent before."""
        self.peer.send([envelope.encode(envelope.Kind.DDP, envelope.MAX_QPN, PEER_QPN,
                                        rdmap.encode_tagged(rdmap.Opcode.RDMA_WRITE, True, 0, 0))])

    # -- the end of a test ------------------------------------------------------------
    def a_and_b_still_work(self) -> None:
        """A Write from A to B and a Send from B to A, each checked by digest."""
        app2, appb = self.app2, self.appb
        src, dst = app2.mrs["rw"], appb.mrs["rw"]
        data = random.Random(time.monotonic_ns()).randbytes(3000)
        src.write(data)
        wr = verbs.SendWR(wr_id=11, opcode=IBV_WR_RDMA_WRITE, sg=[verbs.SGE(src.buf, len(data), src.lkey)],
                          send_flags=IBV_SEND_SIGNALED)
        wr.set_wr_rdma(dst.rkey, dst.buf)
        app2.qp.post_send(wr)
        (wc,) = app2.cq.poll_blocking(1, timeout=10)
        assert (wc.wr_id, wc.status) == (11, IBV_WC_SUCCESS), wc
        assert hashlib.sha256(dst.read(len(data), 0)).digest() == hashlib.sha256(data).digest()
        back = bytes(reversed(data))[:2500]
        dst.write(back, offset=8192)
        app2.qp.post_recv(verbs.RecvWR(wr_id=12, sg=[verbs.SGE(src.buf + 8192, 4096, src.lkey)]))
        appb.qp.post_send(verbs.SendWR(wr_id=13, opcode=IBV_WR_SEND, sg=[verbs.SGE(dst.buf + 8192, len(back),
                                                                                    dst.lkey)],
                                       send_flags=IBV_SEND_SIGNALED))
        (wc,) = appb.cq.poll_blocking(1, timeout=10)
        assert (wc.wr_id, wc.status) == (13, IBV_WC_SUCCESS), wc
        (wc,) = app2.cq.poll_blocking(1, timeout=10)
        assert (wc.wr_id, wc.status, wc.opcode, wc.byte_len) == (12, IBV_WC_SUCCESS, IBV_WC_RECV, len(back)), wc
        assert hashlib.sha256(src.read(len(back), 8192)).digest() == hashlib.sha256(back).digest()
        self.snapshot()

    def log_clean(self) -> None:
        for d in (self.a, self.b):
            with open(d.log.name, errors="replace") as f:
                text = f.read()
            bad = [line for line in text.splitlines() if any(b in line for b in BAD_LOG)]
            assert not bad, "\n".join(bad[:20]) + "\n" + d.log_text()

    def close(self) -> None:
        self.peer.close()
        for app in (self.app1, self.app2, self.appb):
            app.ctx.close()
        codes = [d.stop() for d in (self.a, self.b)]
        assert codes == [0, 0], (codes, self.a.log_text(), self.b.log_text())


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    with tempfile.TemporaryDirectory(prefix="udpverbs-fuzz-") as d:
        w = World(d)
        try:
            yield w
            w.log_clean()
        finally:
            w.close()


def _grew(before: dict[str, int], after: dict[str, int], *names: str) -> dict[str, int]:
    return {n: after.get(n, 0) - before.get(n, 0) for n in names}


# --- the UDP port ---------------------------------------------------------------------

SOURCES = ("stranger", "stranger", "peer", "spoof_b", "spoof_any")


@st.composite
def noise(draw: st.DrawFn) -> tuple[str, bytes, int]:
    """(source, datagram, stranger index or spoofed port)."""
    source = draw(st.sampled_from(SOURCES))
    data = draw(st.one_of(random_datagrams, link_datagrams()))
    return source, data, draw(st.integers(0, 0xFFFF))


class Noise:
    """Where the datagrams of the noise test leave from."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.strangers = []
        for ip in STRANGER_IPS:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind((ip, 0))
            s.setblocking(False)
            self.strangers.append(s)
        self.raw = raw_sender() if can_spoof() else None

    def send(self, source: str, data: bytes, n: int) -> None:
        w = self.world
        a = (A_IP, w.a.port)
        if source == "peer":
            link = w.peer.link
            if len(data) >= 8 and int.from_bytes(data[4:8], "big") == link.peer_tag:
                data = data[:4] + (link.peer_tag ^ 1).to_bytes(4, "big") + data[8:]  # the real tag would be the peer
            w.peer.sock.sendto(data, a)
        elif source.startswith("spoof") and self.raw is not None:
            src = (B_IP, w.b.port) if source == "spoof_b" else (STRANGER_IPS[n % 2], 1 + n % 0xFFFF)
            spoof(self.raw, src, a, data)
        else:
            self.strangers[n % len(self.strangers)].sendto(data, a)

    def echo_cookie(self, n: int) -> None:
        """A stranger that answers the COOKIE: A opens a passive link that never completes."""
        s = self.strangers[n % len(self.strangers)]
        init = wl.LinkInit(1 + n, n, 1400, 64, n + 7)
        s.sendto(wl.encode_fields(wl.PacketType.INIT, 0, 0, 0, n, 0, 0, 0, 64, wl.encode_init(init)),
                 (A_IP, self.world.a.port))
        end = time.monotonic() + 0.2
        while select.select([s], [], [], max(0.0, end - time.monotonic()))[0]:
            try:
                h, body = wl.decode_untrusted(s.recv(2048))
            except (WireError, OSError):
                continue
            if h.ptype == wl.PacketType.COOKIE:
                init = init._replace(cookie=bytes(body))
                s.sendto(wl.encode_fields(wl.PacketType.INIT, 0, 0, 0, n, 0, 0, 0, 64, wl.encode_init(init)),
                         (A_IP, self.world.a.port))
                return

    def close(self) -> None:
        for s in self.strangers:
            s.close()
        if self.raw is not None:
            self.raw.close()


def test_noise_on_the_udp_port_changes_nothing(world: World) -> None:
    before = world.app1.ctx.query_stats()
    out = Noise(world)

    @fuzz_settings(60)
    @given(st.lists(noise(), min_size=1, max_size=12), st.integers(0, 9))
    def run(datagrams: list[tuple[str, bytes, int]], echo: int) -> None:
        for source, data, n in datagrams:
            out.send(source, data, n)
        if echo == 0:
            out.echo_cookie(len(datagrams))
        world.ping()  # A read everything before it
        world.refresh()
        world.check()

    try:
        run()
    finally:
        out.close()
    world.a_and_b_still_work()
    after = world.app1.ctx.query_stats()
    grew = _grew(before, after, "rx_garbage", "rx_unknown_peer", "init_cookie_sent", "link_bad_crc",
                 "link_bad_tag", "link_malformed", "link_truncated")
    print("noise:", grew, "resets", world.resets, "reopens", world.reopens)
    assert all(grew[n] > 0 for n in ("rx_garbage", "rx_unknown_peer", "init_cookie_sent", "link_bad_crc")), grew
    assert world.reopens == 0  # the peer answered every probe: nothing a stranger sent ended its link
    world.log_clean()


def test_rdmap_from_a_real_peer_stays_inside_the_regions(world: World) -> None:
    before = world.app1.ctx.query_stats()
    rw = world.app1.mrs["rw"]
    rw_before = bytes(rw.mv)

    @fuzz_settings(80)
    @given(st.lists(link_messages(world.targets), min_size=1, max_size=8))
    def run(messages: list[bytes]) -> None:
        world.peer.send(messages)
        world.refresh()
        world.check()

    run()
    world.ping()
    world.a_and_b_still_work()
    after = world.app1.ctx.query_stats()
    grew = _grew(before, after, "rx_no_qp", "terminate_sent", "rnr_nack_sent", "rx_unhandled_kind")
    print("rdmap:", grew, "resets", world.resets, "reopens", world.reopens, "answers", len(world.peer.received))
    assert bytes(rw.mv) != rw_before  # the fuzz reached placement
    assert world.resets > 0 and grew["terminate_sent"] > 0 and grew["rx_no_qp"] > 0, grew
    assert world.reopens == 0
    world.log_clean()


# --- the control socket -----------------------------------------------------------------

def foreign_connection(path: str) -> socket.socket:
    """A connection to ``path`` opened by a child process that then exits, so
    the daemon sees another application (its verbs may not touch ours)."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with parent, child:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                s.connect(path)
                socket.send_fds(child, [b"c"], [s.fileno()])
                code = 0
            finally:
                os._exit(code)
        os.waitpid(pid, 0)
        _, fds, _, _ = socket.recv_fds(parent, 1, 1)
    return socket.socket(fileno=fds[0])


class FdPool:
    """One file descriptor of each kind a client might pass (the first: a region's memfd)."""

    def __init__(self) -> None:
        self.file = tempfile.TemporaryFile()
        self.file.write(b"x" * 5000)
        self.file.flush()
        self.pair = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sealable = os.MFD_ALLOW_SEALING
        self._own = [os.memfd_create("fuzz", sealable), os.memfd_create("fuzz-unsealable"),
                     os.memfd_create("fuzz-empty", sealable), *os.pipe(), os.eventfd(0),
                     os.open(os.devnull, os.O_RDONLY)]
        os.ftruncate(self._own[0], 8192)
        os.ftruncate(self._own[1], 8192)
        self.fds = [*self._own, self.file.fileno(), self.pair[0].fileno()]

    def close(self) -> None:
        for fd in self._own:
            os.close(fd)
        self.file.close()
        for s in self.pair:
            s.close()


@st.composite
def ctl_steps(draw: st.DrawFn) -> tuple[bytes | tuple[ctl.Op, dict[str, object]], list[int], bool]:
    """(request bytes or op and fields, indices into the fd pool, hang up right after sending it)."""
    data = draw(st.one_of(raw_requests(), valid_requests((PEER_IP, B_IP))))
    fds = draw(st.lists(st.integers(0, 8), max_size=5)) if draw(st.integers(0, 3)) == 0 else []
    return data, fds, draw(st.integers(0, 15)) == 0


def _reply(sock: socket.socket, wait_s: float) -> bytes | None:
    """The daemon's answer, b"" if it closed the session, None if nothing came within ``wait_s``."""
    if not select.select([sock], [], [], wait_s)[0]:
        return None
    try:
        data, fds, _, _ = socket.recv_fds(sock, ctl.MAX_CTL_MESSAGE, 8)
    except ConnectionResetError:
        return b""
    for fd in fds:
        os.close(fd)
    return data


def _op(data: bytes) -> int:
    return int.from_bytes(data[:2], "big") if len(data) >= 2 else -1


#: a valid start of a session: what gives the fuzzed requests real handles to name
SETUP = (
    (ctl.Op.HELLO, dict(version=ctl.CTL_VERSION)),
    (ctl.Op.ALLOC_PD, {}),
    (ctl.Op.REG_MR, dict(pd_handle="pd_handle", access=int(IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE),
                         length=4096, addr=1 << 20)),
    (ctl.Op.CREATE_COMP_CHANNEL, {}),
    (ctl.Op.CREATE_CQ, dict(cqe=16, channel_handle="channel_handle", comp_vector=0)),
    (ctl.Op.CREATE_QP, dict(pd_handle="pd_handle", send_cq="cq_handle", recv_cq="cq_handle", qp_type=IBV_QPT_RC,
                            max_send_wr=4, max_recv_wr=4, max_send_sge=1, max_recv_sge=1, max_inline_data=0,
                            sq_sig_all=0, srq_handle=0)),
    (ctl.Op.CREATE_SRQ, dict(pd_handle="pd_handle", max_wr=4, max_sge=1, srq_limit=0)),
)
HANDLE_NAMES = ("pd_handle", "mr_handle", "lkey", "channel_handle", "cq_handle", "qp_num", "srq_handle",
                "listener_handle", "conn_id")
ANSWERS: collections.Counter[tuple[int, int]] = collections.Counter()  # (op, errno) of every answer


class HostileClient:
    """One connection of another application, sending what hypothesis draws (see ``run``)."""

    def __init__(self, path: str, pool: FdPool) -> None:
        self.sock = foreign_connection(path)
        self.pool = pool
        self.learned: dict[str, int] = {}

    def request(self, data: bytes, fd_idx: tuple[int, ...] = (), hang_up: bool = False) -> bool:
        """Send one request and check its answer; False once the session is over."""
        try:
            if fd_idx:
                socket.send_fds(self.sock, [data], [self.pool.fds[i] for i in fd_idx])
            else:
                self.sock.send(data)
        except OSError as e:
            assert e.errno in (errno.EPIPE, errno.ECONNRESET, errno.EMSGSIZE), e
            return False
        if hang_up:
            return False
        op = _op(data)
        known = op in ctl.Op._value2member_map_
        rep = _reply(self.sock, 0.3 if not known or ctl.Op(op) in BLOCKING_OPS else 10.0)
        if rep is None:
            assert not known or ctl.Op(op) in BLOCKING_OPS, f"no answer to op {op}"
            return False  # a request that waits: hang up on it
        if rep == b"":
            return False  # the daemon ended this session
        rop, flags, status = _op(rep), int.from_bytes(rep[2:4], "big"), int.from_bytes(rep[4:8], "big", signed=True)
        assert flags == ctl.REPLY and rop in (op, ctl.Op.HELLO), (op, rep[:16])
        ANSWERS[(op if known else -1, status)] += 1
        if known and status == 0 and rop == op:
            fields = ctl.decode_reply(rep, ctl.Op(op))[1]
            self.learned.update({n: getattr(fields, n) for n in HANDLE_NAMES if hasattr(fields, n)})
        return True

    def set_up(self, steps: int) -> bool:
        for op, fields in SETUP[:steps]:
            kw = {k: self.learned.get(v, 0) if isinstance(v, str) else v for k, v in fields.items()}
            if not self.request(ctl.encode_request(op, **kw), (0,) if op == ctl.Op.REG_MR else ()):
                return False
        return True

    def run(self, setup: int, steps: list[tuple[bytes | tuple[ctl.Op, dict[str, object]], list[int], bool]]) -> None:
        """The set-up (none, HELLO, or every kind of resource), then the fuzzed requests."""
        if not self.set_up(setup):
            return
        for req, fds, hang_up in steps:
            if isinstance(req, tuple):
                req = ctl.encode_request(req[0], **resolve(req[1], self.learned))
            if not self.request(req, tuple(fds), hang_up):
                return

    def close(self) -> None:
        self.sock.close()


def test_a_request_too_short_to_name_its_op_is_refused_as_hello(world: World) -> None:
    # A lone byte names no op: the error must not name one the client never sent (0x02 spells ALLOC_PD).
    with foreign_connection(world.a.socket_path) as sock:
        sock.send(b"\x02")
        rep = _reply(sock, 10.0)
    assert rep and ctl.decode_reply(rep, ctl.Op.HELLO)[0] == errno.EINVAL, rep


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_hostile_control_clients_end_alone(world: World) -> None:
    pid = world.a.proc.pid  # type: ignore[union-attr]
    fds_before = _open_fds(pid)
    pool = FdPool()
    other = world.app2

    @fuzz_settings(60)
    @given(st.sampled_from([0, 1, len(SETUP), len(SETUP)]), st.lists(ctl_steps(), min_size=1, max_size=8))
    def run(setup: int, steps: list[Any]) -> None:
        client = HostileClient(world.a.socket_path, pool)
        try:
            client.run(setup, steps)
        finally:
            client.close()
        assert world.a.proc is not None and world.a.proc.poll() is None, world.a.log_text()
        # another application, connected all along, still gets its verbs served
        assert other.qp.query()[0].qp_state == IBV_QPS_RTS
        with contextlib.closing(verbs.MR(other.pd, 100, IBV_ACCESS_LOCAL_WRITE)):
            pass

    try:
        run()
    finally:
        pool.close()
    end = time.monotonic() + 10
    while _open_fds(pid) > fds_before + 2 and time.monotonic() < end:
        time.sleep(0.05)  # sessions that waited end with their waits (at most 200 ms each)
    assert _open_fds(pid) <= fds_before + 2, (fds_before, sorted(os.listdir(f"/proc/{pid}/fd")))
    print("control answers (op, errno):", sorted(ANSWERS.items()))
    world.check()
    world.a_and_b_still_work()
    world.log_clean()
