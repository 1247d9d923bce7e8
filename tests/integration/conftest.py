"""Two real daemons on loopback (127.0.0.2 and 127.0.0.3), shared by the integration tests."""

from __future__ import annotations

import tempfile
from typing import Iterator

import pytest

from udpverbs import verbs
from udpverbs.verbs.enums import (
    IBV_ACCESS_LOCAL_WRITE,
    IBV_ACCESS_REMOTE_READ,
    IBV_ACCESS_REMOTE_WRITE,
    IBV_QPT_RC,
)

from .daemons import DaemonProc, running

ACCESS_ALL = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ


@pytest.fixture(scope="package")
def daemons() -> Iterator[tuple[DaemonProc, DaemonProc]]:
    with tempfile.TemporaryDirectory(prefix="udpverbs-test-") as d:
        # default congestion control (efe-host)
        with running(DaemonProc("uvA", "127.0.0.2", d, seed=11), DaemonProc("uvB", "127.0.0.3", d, seed=12)) as (a, b):
            yield a, b


class Side:
    """One application's resources on one daemon (pyverbs tests' "player")."""

    def __init__(self, daemon: DaemonProc, mr_size: int = 1 << 20, access: int = ACCESS_ALL,
                 cap: verbs.QPCap | None = None) -> None:
        self.cap = cap
        self.ctx = verbs.Context(socket_path=daemon.socket_path)
        self.pd = verbs.PD(self.ctx)
        self.mr = verbs.MR(self.pd, mr_size, access)
        self.cq = verbs.CQ(self.ctx, 256)
        self.qp = self.new_qp(cap)

    def new_qp(self, cap: verbs.QPCap | None = None) -> verbs.QP:
        return verbs.QP(self.pd, verbs.QPInitAttr(qp_type=IBV_QPT_RC, scq=self.cq, rcq=self.cq,
                                                  cap=cap or self.cap or verbs.QPCap(64, 64, 4, 4), sq_sig_all=0))

    def close(self) -> None:
        self.ctx.close()


def connect_manual(a: Side, qa: verbs.QP, b: Side, qb: verbs.QP, rd: int = 4) -> None:
    """perftest style: swap QPN, GID and daemon UDP port, then modify both QPs to RTS."""
    for me, qp, peer, pqp in ((a, qa, b, qb), (b, qb, a, qa)):
        attr = verbs.QPAttr(qp_access_flags=ACCESS_ALL, dest_qp_num=pqp.qp_num, max_rd_atomic=rd,
                            max_dest_rd_atomic=rd)
        attr.ah_attr = verbs.AHAttr(dlid=peer.ctx.query_port().lid,
                                    gr=verbs.GlobalRoute(dgid=peer.ctx.query_gid()))
        qp.to_rts(attr)


@pytest.fixture
def sides(daemons: tuple[DaemonProc, DaemonProc]) -> Iterator[tuple[Side, Side]]:
    """A Side on each daemon, not connected."""
    a, b = Side(daemons[0]), Side(daemons[1])
    try:
        yield a, b
    finally:
        a.close()
        b.close()


@pytest.fixture
def pair(daemons: tuple[DaemonProc, DaemonProc]) -> Iterator[tuple[Side, Side]]:
    a, b = Side(daemons[0]), Side(daemons[1])
    try:
        connect_manual(a, a.qp, b, b.qp)
        yield a, b
    finally:
        a.close()
        b.close()
