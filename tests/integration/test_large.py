"""A 1 GiB RDMA Write and Read on loopback with jumbo datagrams: lazily segmented, memory bounded."""

from __future__ import annotations

import tempfile

import pytest

from udpverbs import verbs
from udpverbs.verbs.enums import IBV_SEND_SIGNALED, IBV_WC_SUCCESS, IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE

from .conftest import Side, connect_manual
from .daemons import DaemonProc

np = pytest.importorskip("numpy")  # compares a GiB in C; numpy belongs in the [test] extras

GIB = 1 << 30
JUMBO = ("--cc", "aimd")  # loopback carries 64 KB datagrams, so a GiB is 16 k segments


def _rss_anon_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise AssertionError("no RssAnon")


def _run(qp: verbs.QP, cq: verbs.CQ, opcode: int, sge: verbs.SGE, rkey: int, raddr: int) -> None:
    wr = verbs.SendWR(wr_id=opcode, opcode=opcode, sg=[sge], send_flags=IBV_SEND_SIGNALED)
    wr.set_wr_rdma(rkey, raddr)
    qp.post_send(wr)
    (wc,) = cq.poll_blocking(1, timeout=120)
    assert (wc.status, wc.byte_len) == (IBV_WC_SUCCESS, sge.length)


def test_one_gib_write_and_read() -> None:
    with tempfile.TemporaryDirectory(prefix="udpverbs-big-") as d:
        with DaemonProc("uvX", "127.0.0.2", d, mtu=65000, extra=JUMBO) as da, \
                DaemonProc("uvY", "127.0.0.3", d, mtu=65000, extra=JUMBO) as db:
            a, b = Side(da, GIB + 4096), Side(db, GIB)
            try:
                connect_manual(a, a.qp, b, b.qp)
                src = np.frombuffer(a.mr.mv, dtype=np.uint8)
                rng = np.random.default_rng(1)
                # Random 64 KiB islands every 16 MiB; the rest stays zero (sparse, cheap to set up).
                for off in range(0, GIB, 16 << 20):
                    src[off + 3:off + 3 + 65536] = rng.integers(0, 256, 65536, dtype=np.uint8)
                before = _rss_anon_kib(da.proc.pid)  # type: ignore[union-attr]
                _run(a.qp, a.cq, IBV_WR_RDMA_WRITE, verbs.SGE(a.mr.buf, GIB, a.mr.lkey), b.mr.rkey, b.mr.buf)
                dst = np.frombuffer(b.mr.mv, dtype=np.uint8)
                assert np.array_equal(dst, src[:GIB])
                # The daemon's own memory did not grow with the message (the link window bounds it).
                assert _rss_anon_kib(da.proc.pid) - before < 128 * 1024  # type: ignore[union-attr]
                dst[::4096] ^= 0x5A  # change the target, then read it back over the source
                _run(a.qp, a.cq, IBV_WR_RDMA_READ, verbs.SGE(a.mr.buf, GIB, a.mr.lkey), b.mr.rkey, b.mr.buf)
                assert np.array_equal(src[:GIB], dst)
                del src, dst
            finally:
                a.close()
                b.close()
