"""A stream of 64 KiB RDMA Writes in 64 KB datagrams, sent from the
registered region without a copy, arrives byte-exact through a lossy,
reordering network (``--impair`` on both daemons), and so does a Read of
the same size; with a cluster key the datagrams are built and sealed as
before, and arrive just as well."""

from __future__ import annotations

import os
import tempfile

from udpverbs import verbs
from udpverbs.verbs.enums import IBV_SEND_SIGNALED, IBV_WC_SUCCESS, IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE

from .conftest import Side, connect_manual
from .daemons import DaemonProc

MTU = 65507  # the largest UDP payload over IPv4: loopback carries 64 KB datagrams
MSG = 64 << 10
COUNT = 48  # Writes in the stream: 3 MiB
IMPAIR = ("--impair", "loss=0.04,reorder=0.05,delay=200us")


def _stream(a: Side, b: Side) -> None:
    """``COUNT`` Writes of ``MSG`` bytes each, posted back to back (the last
    signaled), then a Read of one message back into a's upper half."""
    src = os.urandom(COUNT * MSG)
    a.mr.mv[:len(src)] = src
    cap = 32  # the SQ's depth
    done = 0
    for i in range(COUNT):
        wr = verbs.SendWR(wr_id=i, opcode=IBV_WR_RDMA_WRITE, sg=[verbs.SGE(a.mr.buf + i * MSG, MSG, a.mr.lkey)],
                          send_flags=IBV_SEND_SIGNALED)
        wr.set_wr_rdma(b.mr.rkey, b.mr.buf + i * MSG)
        if i - done >= cap:
            for wc in a.cq.poll_blocking(1, timeout=60):
                assert wc.status == IBV_WC_SUCCESS
                done += 1
        a.qp.post_send(wr)
    while done < COUNT:
        for wc in a.cq.poll_blocking(1, timeout=60):
            assert wc.status == IBV_WC_SUCCESS
            done += 1
    assert bytes(b.mr.mv[:len(src)]) == src
    back = len(src)
    wr = verbs.SendWR(wr_id=COUNT, opcode=IBV_WR_RDMA_READ, sg=[verbs.SGE(a.mr.buf + back, MSG, a.mr.lkey)],
                      send_flags=IBV_SEND_SIGNALED)
    wr.set_wr_rdma(b.mr.rkey, b.mr.buf + 5 * MSG)
    a.qp.post_send(wr)
    (wc,) = a.cq.poll_blocking(1, timeout=60)
    assert (wc.status, wc.byte_len) == (IBV_WC_SUCCESS, MSG)
    assert bytes(a.mr.mv[back:back + MSG]) == src[5 * MSG:6 * MSG]


def _run(extra: tuple[str, ...]) -> tuple[dict[str, int], dict[str, int]]:
    with tempfile.TemporaryDirectory(prefix="udpverbs-zc-") as d:
        with DaemonProc("uvZa", "127.0.0.2", d, mtu=MTU, extra=extra) as da, \
                DaemonProc("uvZb", "127.0.0.3", d, mtu=MTU, extra=extra) as db:
            cap = verbs.QPCap(32, 32, 1, 1)
            a, b = Side(da, (COUNT + 1) * MSG, cap=cap), Side(db, COUNT * MSG, cap=cap)
            try:
                connect_manual(a, a.qp, b, b.qp)
                _stream(a, b)
                return a.ctx.query_stats(), b.ctx.query_stats()
            finally:
                a.close()
                b.close()


def test_a_lossy_stream_of_large_writes_arrives_byte_exact() -> None:
    sa, _ = _run(IMPAIR)
    # the Writes' large segments left gathered from a's region, and the
    # datagrams lost on the way were made good by retransmissions (the
    # Read's answer, alone on a quiet link, leaves as a run sent at once)
    assert sa.get("tx_gathered", 0) > COUNT // 2
    assert sa.get("impair_lost", 0) > 0


def test_with_a_cluster_key_large_writes_are_sealed_copies() -> None:
    with tempfile.NamedTemporaryFile("w", prefix="udpverbs-key-", delete=False) as f:
        f.write(os.urandom(32).hex() + "\n")
    os.chmod(f.name, 0o600)
    try:
        sa, _ = _run((*IMPAIR, f"--key-file={f.name}"))
        assert "tx_gathered" not in sa and sa.get("tx_gather_segments", 0) == 0
    finally:
        os.unlink(f.name)
