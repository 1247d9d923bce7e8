"""Path MTU discovery for real: two daemons in network namespaces joined by a veth pair.

Each test makes two namespaces of its own (``udpverbs.bench.netns``:
unique names, addresses that exist only inside them) and deletes them on
every way out.  Skipped where namespaces cannot be made (not root, no ``ip``).

- ``--mtu 8972`` on a 1500-byte veth: the links find 1472-byte datagrams
  (the kernel refuses larger ones: EMSGSIZE), a 64 MiB stream of RDMA Writes
  arrives whole, and the daemon says so once in its log.  The same stream
  with ``--mtu 1472`` runs in the same test, and both throughputs are
  printed (a benchmark figure, not asserted: the host is shared).
- one side ``--mtu 8972``, the other ``--mtu 1472``, on a 9000-byte veth
  (and a 1500-byte one): the jumbo side keeps to what its peer takes, and
  Writes both ways finish.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from typing import Iterator

import pytest

from udpverbs import verbs
from udpverbs.bench.netns import NamespaceError, NamespacePair, Wire
from udpverbs.verbs.enums import IBV_SEND_SIGNALED, IBV_WC_SUCCESS, IBV_WR_RDMA_WRITE

from .conftest import Side, connect_manual
from .daemons import DaemonProc, running

MIB = 1 << 20
WRITE = 64 * 1024
DEPTH = 16  # Writes in flight, as perftest's tx depth


@contextlib.contextmanager
def veth_pair(mtu: int) -> Iterator[tuple[str, str, str, str]]:
    """Two fresh namespaces joined by a veth of ``mtu``: (ns A, ns B, address A, address B)."""
    try:
        with NamespacePair([Wire(mtu)], tag="uvpm") as pair:
            yield pair.ns[0], pair.ns[1], pair.addrs[0][0], pair.addrs[1][0]
    except NamespaceError as e:
        pytest.skip(str(e))


def in_ns(ns: str) -> tuple[str, ...]:
    return ("ip", "netns", "exec", ns)


def stream_writes(a: Side, b: Side, total: int, deadline_s: float) -> float:
    """RDMA Writes of WRITE bytes, DEPTH in flight, ``a``'s region to
    ``b``'s, ``total`` bytes in all; returns the seconds they took."""
    count = total // WRITE
    posted = done = 0
    t0 = time.monotonic()
    while done < count:
        while posted < count and posted - done < DEPTH:
            off = posted * WRITE
            wr = verbs.SendWR(wr_id=posted, opcode=IBV_WR_RDMA_WRITE,
                              sg=[verbs.SGE(a.mr.buf + off, WRITE, a.mr.lkey)], send_flags=IBV_SEND_SIGNALED)
            wr.set_wr_rdma(b.mr.rkey, b.mr.buf + off)
            a.qp.post_send(wr)
            posted += 1
        left = deadline_s - (time.monotonic() - t0)
        assert left > 0, f"{done} of {count} Writes in {deadline_s} s"
        for wc in a.cq.poll_blocking(1, timeout=left):
            assert wc.status == IBV_WC_SUCCESS, wc
            done += 1
    return time.monotonic() - t0


def digest(mr: verbs.MR, n: int) -> bytes:
    return hashlib.sha256(mr.mv[:n]).digest()


def one_run(d: str, ns_a: str, ns_b: str, ip_a: str, ip_b: str, mtu: int, total: int) -> tuple[float, dict, str]:
    """Daemons with ``--mtu mtu`` in the two namespaces; ``total`` bytes of
    Writes A -> B.  Returns (seconds, A's counters, A's log)."""
    with running(DaemonProc(f"pm{mtu}a", ip_a, d, mtu=mtu, prefix=in_ns(ns_a), seed=1),
                 DaemonProc(f"pm{mtu}b", ip_b, d, mtu=mtu, prefix=in_ns(ns_b), seed=2)) as (da, db):
        a, b = Side(da, total), Side(db, total)
        try:
            connect_manual(a, a.qp, b, b.qp)
            a.mr.mv[:total] = os.urandom(total)
            took = stream_writes(a, b, total, 25.0)
            assert digest(b.mr, total) == digest(a.mr, total)
            stats = a.ctx.query_stats()
        finally:
            a.close()
            b.close()
        return took, stats, da.log_text()


def test_jumbo_mtu_on_a_1500_path_runs_at_the_paths_mtu() -> None:
    total = 64 * MIB
    with veth_pair(1500) as (ns_a, ns_b, ip_a, ip_b), tempfile.TemporaryDirectory(prefix="udpverbs-pm-") as d:
        jumbo_s, jumbo, log = one_run(d, ns_a, ns_b, ip_a, ip_b, 8972, total)
        plain_s, plain, _ = one_run(d, ns_a, ns_b, ip_a, ip_b, 1472, total)
    print(f"\n64 MiB of 64 KiB Writes over a 1500-byte veth: --mtu 8972 {total / jumbo_s / 1e6:.1f} MB/s, "
          f"--mtu 1472 {total / plain_s / 1e6:.1f} MB/s (ratio {plain_s / jumbo_s:.2f})")
    assert jumbo["link_plpmtu_min"] == 1472 and plain["link_plpmtu_min"] == 1472
    # the kernel refused the larger probes at once; no data waited for a timeout
    assert jumbo["link_pmtu_too_big"] >= 1 and jumbo.get("tx_oserror", 0) == 0
    assert jumbo["link_rto_count"] == 0 and plain["link_pmtu_probes_sent"] == 0
    warnings = [line for line in log.splitlines() if "--mtu asks for" in line]
    assert len(warnings) == 1 and f"path to {ip_b}:" in warnings[0] and "carries 1472 bytes; --mtu asks for 8972" \
        in warnings[0], log


@pytest.mark.parametrize("veth_mtu", [9000, 1500])
def test_jumbo_on_one_side_only_does_not_hang(veth_mtu: int) -> None:
    total = 16 * MIB
    with veth_pair(veth_mtu) as (ns_a, ns_b, ip_a, ip_b), tempfile.TemporaryDirectory(prefix="udpverbs-pm-") as d:
        with running(DaemonProc("pmja", ip_a, d, mtu=8972, prefix=in_ns(ns_a), seed=1),
                     DaemonProc("pmjb", ip_b, d, mtu=1472, prefix=in_ns(ns_b), seed=2)) as (da, db):
            a, b = Side(da, total), Side(db, total)
            try:
                connect_manual(a, a.qp, b, b.qp)
                for src, dst in ((a, b), (b, a)):
                    src.mr.mv[:total] = os.urandom(total)
                    stream_writes(src, dst, total, 20.0)
                    assert digest(dst.mr, total) == digest(src.mr, total)
                sa, sb = a.ctx.query_stats(), b.ctx.query_stats()
            finally:
                a.close()
                b.close()
            log = da.log_text()
    assert sa["link_plpmtu_min"] == sb["link_plpmtu_min"] == 1472
    assert sa["link_rto_count"] == sb["link_rto_count"] == 0
    assert "carries 1472 bytes; --mtu asks for 8972 (the peer takes at most 1472)" in log, log
