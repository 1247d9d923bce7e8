"""Striping and failover for real: two namespaces joined by two veth pairs, one link over both.

The test makes its own namespaces (``udpverbs.bench.netns``: unique names,
two subnets that exist only inside them) and deletes them on every way
out; skipped where namespaces cannot be made (not root, no ``ip``).  A
daemon in each namespace has both addresses, and each veth is shaped
(tbf) below what the daemons move, so both paths carry the stream.
256 MiB of RDMA Writes go from A to B and are read back by RDMA Reads,
and halfway through the Writes one veth is set down (a cut cable: the
kernel drops the route, so sends on that path fail).  Every work request must complete successfully
and both copies must match.  Then the veth comes back and the per-path
counters show traffic on it again.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from typing import Callable

import pytest

from udpverbs import verbs
from udpverbs.bench.netns import NamespaceError, NamespacePair, Wire
from udpverbs.verbs.enums import IBV_SEND_SIGNALED, IBV_WC_SUCCESS, IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE

from .conftest import Side, connect_manual
from .daemons import DaemonProc, running
from .test_multipath import path_figures

MIB = 1 << 20
TOTAL = 256 * MIB
CHUNK = 64 * 1024
DEPTH = 16
#: a path silent this long is down (the default is longer; the test need not wait)
PATH_DEAD = ("--link", "path_dead_s=0.3")
#: each veth's rate each way, Mbit/s: below what the daemons' CPUs move, so
#: that the link needs both paths (unshaped, the lower-RTT path alone keeps
#: up with the CPUs and the other one may carry nothing when it is cut)
RATE_MBIT = 300


def stream(a: Side, b: Side, opcode: int, a_off: int, total: int, deadline_s: float,
           halfway: Callable[[], None] | None = None) -> None:
    """``total`` bytes of ``opcode`` (Write: A -> B; Read: B -> A) in CHUNK-byte
    WRs, DEPTH in flight, A's region from ``a_off`` and B's from 0; every
    completion must succeed.  ``halfway`` runs once half the WRs are posted."""
    count = total // CHUNK
    posted = done = 0
    end = time.monotonic() + deadline_s
    while done < count:
        while posted < count and posted - done < DEPTH:
            off = posted * CHUNK
            wr = verbs.SendWR(wr_id=posted, opcode=opcode, sg=[verbs.SGE(a.mr.buf + a_off + off, CHUNK, a.mr.lkey)],
                              send_flags=IBV_SEND_SIGNALED)
            wr.set_wr_rdma(b.mr.rkey, b.mr.buf + off)
            a.qp.post_send(wr)
            posted += 1
            if halfway is not None and posted == count // 2:
                halfway()
        left = end - time.monotonic()
        assert left > 0, f"{done} of {count} WRs in {deadline_s} s"
        for wc in a.cq.poll_blocking(1, timeout=left):
            assert wc.status == IBV_WC_SUCCESS, wc
            done += 1


def digest(mr: verbs.MR, start: int, n: int) -> bytes:
    return hashlib.sha256(mr.mv[start:start + n]).digest()


def test_a_cut_veth_mid_transfer_loses_nothing_and_comes_back() -> None:
    try:
        pair = NamespacePair([Wire(1500, RATE_MBIT), Wire(1500, RATE_MBIT)], tag="uvnm").__enter__()
    except NamespaceError as e:
        pytest.skip(str(e))
    try:
        with tempfile.TemporaryDirectory(prefix="udpverbs-nm-") as d, running(
            *(DaemonProc(f"nm{'ab'[s]}", f"{pair.addrs[s][0]}/24", d, prefix=pair.prefix(s), seed=s + 1,
                         extra=("--addr", f"{pair.addrs[s][1]}/24", *PATH_DEAD)) for s in (0, 1))
        ) as (da, db):
            a, b = Side(da, 2 * TOTAL), Side(db, TOTAL)
            try:
                connect_manual(a, a.qp, b, b.qp, rd=DEPTH)
                a.mr.mv[:TOTAL] = os.urandom(TOTAL)
                second = (f"{pair.addrs[0][1]}:{da.port}", f"{pair.addrs[1][1]}:{db.port}")
                stream(a, b, IBV_WR_RDMA_WRITE, 0, TOTAL, 120.0, halfway=lambda: pair.set_wire(1, False))
                stream(a, b, IBV_WR_RDMA_READ, TOTAL, TOTAL, 120.0)
                want = digest(a.mr, 0, TOTAL)
                assert digest(b.mr, 0, TOTAL) == want, "the data placed at B differs"
                assert digest(a.mr, TOTAL, TOTAL) == want, "the data read back differs"
                cut = path_figures(a.ctx, *second)
                assert cut["times_down"] >= 1 and cut["up"] == 0, cut

                pair.set_wire(1, True)
                end = time.monotonic() + 10.0
                while path_figures(a.ctx, *second)["up"] != 1:
                    assert time.monotonic() < end, path_figures(a.ctx, *second)
                    stream(a, b, IBV_WR_RDMA_WRITE, 0, MIB, 10.0)  # a down path is probed while data waits
                back = path_figures(a.ctx, *second)
                stream(a, b, IBV_WR_RDMA_WRITE, 0, 32 * MIB, 30.0)
                after = path_figures(a.ctx, *second)
                assert after["datagrams_sent"] > back["datagrams_sent"] + 100, (back, after)
                assert after["datagrams_received"] > back["datagrams_received"], (back, after)
                assert digest(b.mr, 0, 32 * MIB) == digest(a.mr, 0, 32 * MIB)
            finally:
                a.close()
                b.close()
            log = da.log_text()
        assert f"path 1 {second[0]} -> {second[1]} down" in log, log
        assert f"path 1 {second[0]} -> {second[1]} up" in log, log
    finally:
        pair.close()
