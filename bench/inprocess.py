"""Two devices in one process: a harness for tests and in-process measurements.

A :class:`Host` is a real ``Device`` bound to a loopback address, with one
protection domain, one 1 MiB memory region and one QP (number 1), and a
control session standing in for an application.  The caller posts work
requests straight into the QP's rings (as the client library would) and
turns the data loops itself (``dev.poll_once()``), so nothing depends on
the scheduler: what two daemons do for a message can be timed, counted or
compared pass by pass.  ``bench/inprocess_lat.py`` and
``bench/inprocess_bw.py`` measure with it; the daemon's tests drive it.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import AsyncIterator

import trio

from ..daemon import tables
from ..daemon.control import Session, modify_qp
from ..daemon.cq import CompletionQueue
from ..daemon.device import Device, DeviceConfig
from ..daemon.policy import EAGER, LoopPolicy
from ..daemon.qp import QueuePair
from ..wire import ctl, shm
from ..wire.shm import AccessFlags as A, QPAttrMask as M, QPState as S, WrOpcode

ALL = A.IBV_ACCESS_LOCAL_WRITE | A.IBV_ACCESS_REMOTE_WRITE | A.IBV_ACCESS_REMOTE_READ | A.IBV_ACCESS_REMOTE_ATOMIC
MR_LEN = 1 << 20


class Host:
    """One device with a PD, one MR and one QP (number 1)."""

    QP_CAPS = {"max_send_wr": 64, "max_recv_wr": 4, "max_send_sge": 4, "max_recv_sge": 1, "max_inline_data": 0}

    def __init__(self, ip: str, *, gso: bool, mtu: int = 1472, native: bool = True, rx_dispatch_budget: int = 8,
                 policy: LoopPolicy = EAGER) -> None:
        self.dev = Device(DeviceConfig(addr=ip, port=0, seed=hash(ip) & 0xFFFF, mtu=mtu, gso=gso, native=native,
                                       rx_dispatch_budget=rx_dispatch_budget), policy)
        self.dev.bind()
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._ctl = trio.socket.from_stdlib_socket(a)
        self.sess = Session(self.dev, self._ctl, pid=1)
        b.close()
        self.dev.sessions.add(self.sess)
        pd = tables.ProtectionDomain(1, self.sess)
        self._mr_fd, mm = shm.new_segment(MR_LEN, "batching")
        self.mr = tables.MemoryRegion(1, pd, ALL, 0x100000, MR_LEN, mm)
        self.dev.stags.register(self.mr)
        self.cq = CompletionQueue(1, self.sess, 256, None)
        self.qp = QueuePair(self.dev, 1, self.sess, pd, self.cq, self.cq, dict(self.QP_CAPS), False)
        self.dev.qps[1] = self.qp
        self.more_qps: list[QueuePair] = []  # qp_pairs'
        self._spares: list[tables.MemoryRegion] = []

    def close(self) -> None:
        """Release the device's sockets and the rings' and region's mappings."""
        self.dev.close()
        self.dev.stags.invalidate(self.mr.stag)
        self.mr.close()
        os.close(self._mr_fd)
        for mr in self._spares:
            self.dev.stags.invalidate(mr.stag)
            mr.close()
        for qp in (self.qp, *self.more_qps):
            qp.close()
        self.cq.close()
        os.close(self._ctl.detach())  # a trio socket closes only inside trio.run

    def connect(self, peer: "Host", qp: QueuePair | None = None, dest_qpn: int = 1) -> None:
        """Take ``qp`` (default: QP 1) to RTS towards QP ``dest_qpn`` on ``peer``."""
        qp = qp or self.qp
        attrs = dict(qp.attrs, qp_state=S.IBV_QPS_INIT, qp_access_flags=ALL)
        modify_qp(qp, M.IBV_QP_STATE | M.IBV_QP_PKEY_INDEX | M.IBV_QP_PORT | M.IBV_QP_ACCESS_FLAGS, attrs)
        attrs.update(qp_state=S.IBV_QPS_RTR, dgid=ctl.gid_from_ip(peer.dev.config.addr), dlid=peer.dev.config.port,
                     dest_qp_num=dest_qpn, max_dest_rd_atomic=1)
        modify_qp(qp, M.IBV_QP_STATE | M.IBV_QP_AV | M.IBV_QP_PATH_MTU | M.IBV_QP_DEST_QPN | M.IBV_QP_RQ_PSN
                  | M.IBV_QP_MAX_DEST_RD_ATOMIC | M.IBV_QP_MIN_RNR_TIMER, attrs)
        attrs.update(qp_state=S.IBV_QPS_RTS, max_rd_atomic=1)
        modify_qp(qp, M.IBV_QP_STATE | M.IBV_QP_SQ_PSN | M.IBV_QP_TIMEOUT | M.IBV_QP_RETRY_CNT | M.IBV_QP_RNR_RETRY
                  | M.IBV_QP_MAX_QP_RD_ATOMIC, attrs)

    def spare_stag(self) -> int:
        """Register another region (a page, local access) in our PD, for a Send to invalidate; return its STag."""
        fd, mm = shm.new_segment(4096, "spare")
        os.close(fd)
        mr = tables.MemoryRegion(2 + len(self._spares), self.mr.pd, A.IBV_ACCESS_LOCAL_WRITE, 0x900000, 4096, mm)
        self.dev.stags.register(mr)
        self._spares.append(mr)
        return mr.stag

    def post_write(self, wr_id: int, src_off: int, length: int, peer: "Host", dst_off: int,
                   rkey: int | None = None, *, sges: list[tuple[int, int]] | None = None,
                   opcode: WrOpcode = WrOpcode.IBV_WR_RDMA_WRITE, qp: QueuePair | None = None,
                   imm: int = 0, compare_add: int = 0, swap: int = 0,
                   local: tables.MemoryRegion | None = None, inline: bool = False) -> None:
        """RDMA Write of ``length`` bytes from our MR at ``src_off`` to ``peer``'s at ``dst_off``
        (``rkey`` overrides the peer MR's STag; ``sges``, (offset, length) pairs
        in our MR, replace ``src_off`` and ``length``; ``opcode`` RDMA Read: from
        the peer's MR into ours; ``qp``: another of our QPs than QP 1; ``imm``:
        the WQE's immediate data or, for a Send with Invalidate, the STag;
        ``compare_add``, ``swap``: an atomic's operands; ``local``: the
        region of ours the SGEs are in, instead of our MR; ``inline``: the
        bytes go in the WQE, as ``IBV_SEND_INLINE`` posts them)."""
        ring = (qp or self.qp).sq
        ring.prod = ring.hdr.producer
        at = ring.next_slot_offset()
        sges = sges or [(src_off, length)]
        flags = shm.SendFlags.IBV_SEND_SIGNALED | (shm.SendFlags.IBV_SEND_INLINE if inline else 0)
        shm.SEND_WQE_HEAD.pack_into(ring.buf, at, wr_id, peer.mr.addr + dst_off, int(opcode), int(flags),
                                    0 if inline else len(sges), imm, peer.mr.stag if rkey is None else rkey,
                                    length if inline else 0, compare_add, swap)
        mr = local or self.mr
        if inline:
            ring.buf[at + shm.SEND_WQE_SG_OFFSET:at + shm.SEND_WQE_SG_OFFSET + length] = \
                mr.view[src_off:src_off + length]
        for i, (off, n) in enumerate(sges if not inline else []):
            shm.SGE.pack_into(ring.buf, at + shm.SEND_WQE_SG_OFFSET + i * shm.SGE_SIZE, mr.addr + off, n, mr.stag)
        ring.push()
        ring.publish()

    def post_recv(self, wr_id: int, off: int, length: int, qp: QueuePair | None = None,
                  local: tables.MemoryRegion | None = None) -> None:
        """A receive of ``length`` bytes into our MR at ``off`` (``qp``: another of our QPs than QP 1;
        ``local``: another region of ours than our MR, by its registration whatever has become of it since)."""
        mr = local or self.mr
        rq = (qp or self.qp).recv_ring
        rq.prod = rq.hdr.producer
        at = rq.next_slot_offset()
        shm.RECV_WQE_HEAD.pack_into(rq.buf, at, wr_id, 1)
        shm.SGE.pack_into(rq.buf, at + shm.RECV_WQE_SG_OFFSET, mr.addr + off, length, mr.stag)
        rq.push()
        rq.publish()

    def cqes(self) -> list[tuple[int, ...]]:
        """The CQEs our CQ holds, every field, taken off the ring."""
        ring, out = self.cq.ring, []
        while ring.available():
            out.append(shm.CQE.unpack_from(ring.buf, ring.slot_offset()))
            ring.pop()
        return out

    def completions(self) -> list[tuple[int, int]]:
        """``(wr_id, status)`` of each CQE ``cqes`` takes."""
        return [(c[0], c[1]) for c in self.cqes()]


def qp_pairs(a: Host, b: Host, n: int) -> list[tuple[QueuePair, QueuePair]]:
    """QP 1 and QPs 2..n on both hosts (same PD, CQ and region as QP 1), connected pairwise."""
    pairs = [(a.qp, b.qp)]
    for qpn in range(2, n + 1):
        qa, qb = (QueuePair(h.dev, qpn, h.sess, h.qp.pd, h.cq, h.cq, dict(Host.QP_CAPS), False) for h in (a, b))
        a.dev.qps[qpn], b.dev.qps[qpn] = qa, qb
        a.more_qps.append(qa)
        b.more_qps.append(qb)
        pairs.append((qa, qb))
    for qa, qb in pairs:
        a.connect(b, qa, qb.qpn)
        b.connect(a, qb, qa.qpn)
    return pairs


async def establish(a: Host, b: Host) -> None:
    """Turn both loops until the link between ``a`` and ``b`` is up."""
    for _ in range(300):  # the link handshake: real sockets, so give the datagrams a moment
        a.dev.poll_once()
        b.dev.poll_once()
        if a.qp.link.link.state == b.qp.link.link.state == a.qp.link.link.state.ESTABLISHED:
            return
        await trio.sleep(0.001)
    raise AssertionError("the link did not come up")


@contextlib.asynccontextmanager
async def connected(a: Host | None = None, b: Host | None = None) -> AsyncIterator[tuple[Host, Host]]:
    """QP 1 of ``a`` and of ``b`` (default: hosts on 127.0.0.2 and 127.0.0.3,
    with GSO) connected to each other, the link up; both closed afterwards."""
    a = a or Host("127.0.0.2", gso=True)
    b = b or Host("127.0.0.3", gso=True)
    try:
        a.connect(b)
        b.connect(a)
        await establish(a, b)
        yield a, b
    finally:
        a.close()
        b.close()


def complete(a: Host, b: Host, count: int, passes: int = 2000) -> list[tuple[int, int]]:
    """Turn both loops until A has ``count`` completions or more (real
    sockets: at most ``passes`` turns); return them, in order."""
    done: list[tuple[int, int]] = []
    for _ in range(passes):
        a.dev.poll_once()
        b.dev.poll_once()
        done += a.completions()
        if len(done) >= count:
            break
    return done
