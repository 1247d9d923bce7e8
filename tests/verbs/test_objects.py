"""The verbs objects against one real daemon: lifetimes, control-path errors, the state machine."""

from __future__ import annotations

import errno
import json
import os
import sys
import tempfile

import pytest

from udpverbs import verbs
from udpverbs.verbs.enums import (
    IBV_ACCESS_LOCAL_WRITE,
    IBV_ACCESS_REMOTE_WRITE,
    IBV_QP_PORT,
    IBV_QP_STATE,
    IBV_QPS_ERR,
    IBV_QPS_INIT,
    IBV_QPS_RESET,
    IBV_QPS_RTS,
    IBV_QPT_RC,
    IBV_QPT_UD,
    IBV_SEND_SIGNALED,
    IBV_WC_RDMA_WRITE,
    IBV_WC_SUCCESS,
    IBV_WC_WITH_IMM,
    IBV_WR_RDMA_WRITE,
    IBV_WR_RDMA_WRITE_WITH_IMM,
)

from ..integration.daemons import DaemonProc


@pytest.fixture(scope="module")
def daemon():
    with tempfile.TemporaryDirectory(prefix="udpverbs-v-") as d:
        old = os.environ.get("UDPVERBS_RUNTIME_DIR")
        os.environ["UDPVERBS_RUNTIME_DIR"] = d
        try:
            with DaemonProc("uv0", "127.0.0.7", d) as p:
                yield p
        finally:
            if old is None:
                del os.environ["UDPVERBS_RUNTIME_DIR"]
            else:
                os.environ["UDPVERBS_RUNTIME_DIR"] = old


@pytest.fixture
def ctx(daemon):
    with verbs.Context(name="uv0") as c:
        yield c


def _qp(ctx: verbs.Context, **cap: int) -> tuple[verbs.PD, verbs.CQ, verbs.QP]:
    pd = verbs.PD(ctx)
    cq = verbs.CQ(ctx, 16)
    qp = verbs.QP(pd, verbs.QPInitAttr(qp_type=IBV_QPT_RC, scq=cq, rcq=cq, cap=verbs.QPCap(**cap)))
    return pd, cq, qp


def test_device_list_and_queries(ctx, daemon) -> None:
    assert [d.name for d in verbs.get_device_list()] == [b"uv0"]
    attr = ctx.query_device()
    assert attr.max_qp > 64 and attr.max_sge == 16 and attr.phys_port_cnt == 1
    port = ctx.query_port()
    assert port.lid == daemon.port and port.state == 4
    assert ctx.query_gid().gid == "0000:0000:0000:0000:0000:ffff:7f00:0007"
    assert ctx.query_gid().ip == "127.0.0.7"
    with pytest.raises(verbs.VerbsError):
        ctx.query_port(2)


def test_a_device_is_named_by_its_name_or_its_socket_path(daemon, monkeypatch) -> None:
    monkeypatch.chdir(os.path.dirname(daemon.socket_path))
    for name in ("uv0", daemon.socket_path, "./uv0.sock", daemon.socket_path.encode()):
        with verbs.Context(name=name) as c:
            assert c.name == "uv0" and c.socket_path.endswith("uv0.sock") and c.query_port().lid == daemon.port
    monkeypatch.setenv("UDPVERBS_DEVICE", daemon.socket_path)
    with verbs.Context() as c:
        assert c.name == "uv0" and c.query_port().lid == daemon.port


def test_no_daemon_is_enodev(tmp_path) -> None:
    with pytest.raises(verbs.VerbsError) as e:
        verbs.Context(socket_path=str(tmp_path / "none.sock"))
    assert e.value.error_code == errno.ENODEV


def test_mr_memory_is_shared_and_numpy_usable(ctx) -> None:
    pd = verbs.PD(ctx)
    mr = verbs.MR(pd, 4096 + 3, IBV_ACCESS_LOCAL_WRITE)
    assert mr.length == 4099 and mr.lkey == mr.rkey and mr.buf % 4096 == 0
    mr.write(b"abc", 3, 10)
    assert mr.read(3, 10) == b"abc"
    with pytest.raises(verbs.UserError):
        mr.read(10, 4095)
    with pytest.raises(verbs.VerbsError) as e:  # remote write needs local write (ibv_reg_mr(3))
        verbs.MR(pd, 64, IBV_ACCESS_REMOTE_WRITE)
    assert e.value.error_code == errno.EINVAL
    zero = verbs.MR(pd, 0, IBV_ACCESS_LOCAL_WRITE)
    assert zero.length == 0 and zero.read(0, 0) == b""


def test_mr_with_numpy(ctx) -> None:
    np = pytest.importorskip("numpy")
    mr = verbs.MR(verbs.PD(ctx), 4096, IBV_ACCESS_LOCAL_WRITE)
    arr = np.frombuffer(mr.mv, dtype=np.uint8)
    arr[100:104] = [1, 2, 3, 4]
    assert mr.read(4, 100) == b"\x01\x02\x03\x04"
    del arr


def test_close_is_idempotent_and_parents_close_children(ctx) -> None:
    pd, cq, qp = _qp(ctx)
    mr = verbs.MR(pd, 64, IBV_ACCESS_LOCAL_WRITE)
    ch = verbs.CompChannel(ctx)
    cq2 = verbs.CQ(ctx, 4, channel=ch)
    cq.close()  # closes the QP that completes into it first
    assert qp._closed
    cq.close()
    pd.close()
    assert mr._closed
    pd.close()
    ch.close()
    assert cq2._closed
    with pytest.raises(verbs.UserError):
        mr.read(1, 0)


def test_context_manager_tree(daemon) -> None:
    with verbs.Context(name="uv0") as c:
        with verbs.PD(c) as pd:
            mr = verbs.MR(pd, 64, IBV_ACCESS_LOCAL_WRITE)
        assert mr._closed
        _, _, qp = _qp(c)
    assert qp._closed


def test_state_machine_from_the_library(ctx) -> None:
    _, _, qp = _qp(ctx)
    attr = verbs.QPAttr(qp_state=IBV_QPS_RTS)
    with pytest.raises(verbs.VerbsError) as e:
        qp.modify(attr, IBV_QP_STATE)  # RESET -> RTS is not a transition
    assert e.value.error_code == errno.EINVAL
    assert qp.query()[0].qp_state == IBV_QPS_RESET  # and nothing changed
    with pytest.raises(verbs.VerbsError):
        qp.modify(verbs.QPAttr(qp_state=IBV_QPS_INIT), IBV_QP_STATE | IBV_QP_PORT)  # mask incomplete
    qp.to_init(verbs.QPAttr(qp_access_flags=IBV_ACCESS_LOCAL_WRITE))
    a, init = qp.query()
    assert a.qp_state == IBV_QPS_INIT and a.qp_access_flags == IBV_ACCESS_LOCAL_WRITE
    assert init.cap.max_send_wr >= 1 and init.qp_type == IBV_QPT_RC
    bad = verbs.QPAttr(dest_qp_num=5)  # RTR without a peer address (dgid/dlid)
    with pytest.raises(verbs.VerbsError):
        qp.to_rtr(bad)
    assert qp.query()[0].qp_state == IBV_QPS_INIT


def test_post_errors(ctx) -> None:
    pd, cq, qp = _qp(ctx, max_send_wr=2, max_send_sge=1)
    mr = verbs.MR(pd, 64, IBV_ACCESS_LOCAL_WRITE)
    wr = verbs.SendWR(opcode=IBV_WR_RDMA_WRITE, sg=[verbs.SGE(mr.buf, 8, mr.lkey)])
    with pytest.raises(verbs.VerbsError):  # RESET: cannot post sends
        qp.post_send(wr)
    qp.to_init(verbs.QPAttr())
    with pytest.raises(verbs.UserError):
        qp.post_recv(verbs.RecvWR(num_sge=2, sg=[verbs.SGE(mr.buf, 8, mr.lkey)]))
    with pytest.raises(verbs.VerbsError) as e:
        verbs.QP(pd, verbs.QPInitAttr(qp_type=IBV_QPT_UD, scq=cq, rcq=cq))
    assert e.value.error_code == errno.EOPNOTSUPP
    with pytest.raises(verbs.VerbsError):
        verbs.QP(pd, verbs.QPInitAttr(scq=cq, rcq=cq, cap=verbs.QPCap(max_send_sge=17)))


def test_waits_time_out(ctx) -> None:
    cq = verbs.CQ(ctx, 4)
    with pytest.raises(TimeoutError):
        cq.wait(timeout=0.05)
    with pytest.raises(TimeoutError):
        ctx.get_async_event(timeout=0.05)
    ch = verbs.CompChannel(ctx)
    verbs.CQ(ctx, 4, channel=ch)
    with pytest.raises(TimeoutError):
        ch.get_cq_event(timeout=0.05)


def test_send_queue_full_is_enomem(daemon) -> None:
    # Two QPs on one daemon, connected to each other through the daemon's own address.
    with verbs.Context(name="uv0") as c:
        pd, cq, qp = _qp(c, max_send_wr=2)
        _, _, peer = _qp(c)
        mr = verbs.MR(pd, 64, IBV_ACCESS_LOCAL_WRITE)
        for me, other in ((qp, peer), (peer, qp)):
            a = verbs.QPAttr(dest_qp_num=other.qp_num)
            a.ah_attr = verbs.AHAttr(dlid=c.query_port().lid, gr=verbs.GlobalRoute(dgid=c.query_gid()))
            me.to_rts(a)
        assert qp.query()[0].qp_state == IBV_QPS_RTS
        # SQD stops the engine taking WQEs, so the ring fills up.
        qp.modify(verbs.QPAttr(qp_state=4), IBV_QP_STATE)
        wr = verbs.SendWR(opcode=IBV_WR_RDMA_WRITE, sg=[verbs.SGE(mr.buf, 8, mr.lkey)])
        qp.post_send(wr)
        qp.post_send(wr)
        with pytest.raises(verbs.VerbsError) as e:
            qp.post_send(wr)
        assert e.value.error_code == errno.ENOMEM


def _loopback_pair(c: verbs.Context, **cap: int) -> tuple[verbs.PD, verbs.CQ, verbs.QP, verbs.QP]:
    """Two QPs of one daemon, connected to each other through its own address (both complete into one CQ)."""
    pd, cq, qp = _qp(c, **cap)
    peer = verbs.QP(pd, verbs.QPInitAttr(qp_type=IBV_QPT_RC, scq=cq, rcq=cq, cap=verbs.QPCap(**cap)))
    for me, other in ((qp, peer), (peer, qp)):
        a = verbs.QPAttr(dest_qp_num=other.qp_num, qp_access_flags=IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)
        a.ah_attr = verbs.AHAttr(dlid=c.query_port().lid, gr=verbs.GlobalRoute(dgid=c.query_gid()))
        me.to_rts(a)
    return pd, cq, qp, peer


def test_completions_and_qp_states_print_by_name_and_compare_as_ints(ctx) -> None:
    pd, cq, qp, peer = _loopback_pair(ctx)
    mr = verbs.MR(pd, 64, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)
    peer.post_recv(verbs.RecvWR(wr_id=2))
    wr = verbs.SendWR(wr_id=1, opcode=IBV_WR_RDMA_WRITE_WITH_IMM, imm_data=5, sg=[verbs.SGE(mr.buf, 8, mr.lkey)],
                      send_flags=IBV_SEND_SIGNALED)
    wr.set_wr_rdma(mr.rkey, mr.buf + 8)
    qp.post_send(wr)
    wcs = {wc.wr_id: wc for wc in cq.poll_blocking(2, timeout=10)}
    send, recv = wcs[1], wcs[2]
    assert repr(send).startswith("WC(wr_id=1, status=IBV_WC_SUCCESS, opcode=IBV_WC_RDMA_WRITE, ")
    assert "opcode=IBV_WC_RECV_RDMA_WITH_IMM" in repr(recv) and "wc_flags=IBV_WC_WITH_IMM)" in repr(recv)
    assert send.status == IBV_WC_SUCCESS == 0 and send.opcode == IBV_WC_RDMA_WRITE and send.status.name == "IBV_WC_SUCCESS"
    assert recv.wc_flags & IBV_WC_WITH_IMM and isinstance(recv.opcode, int)
    assert f"{send.status} {send.opcode:d}" == "0 1" and json.dumps([send.status]) == "[0]"  # still numbers as text
    attr, _ = qp.query()
    assert attr.qp_state == IBV_QPS_RTS and attr.qp_state.name == "IBV_QPS_RTS" and qp.qp_state.name == "IBV_QPS_RTS"
    assert "qp_state=IBV_QPS_RTS," in repr(attr)
    assert "qp_access_flags=IBV_ACCESS_LOCAL_WRITE|IBV_ACCESS_REMOTE_WRITE," in repr(attr)
    qp.modify(verbs.QPAttr(qp_state=IBV_QPS_ERR), IBV_QP_STATE)
    assert qp.qp_state.name == "IBV_QPS_ERR"
    assert "qp_state=IBV_QPS_INIT," in repr(verbs.QPAttr(qp_state=IBV_QPS_INIT))  # the constants are plain ints


def test_an_mr_as_a_numpy_array_shares_the_region(ctx) -> None:
    np = pytest.importorskip("numpy")
    pd, cq, qp, _ = _loopback_pair(ctx)
    mr = verbs.MR(pd, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)
    words = mr.ndarray(np.uint32, (4, 8), offset=64)
    assert words.shape == (4, 8) and words.flags.writeable and mr.ndarray().shape == (4096,)
    words[1, 2] = 0xDEADBEEF  # the application writes through the array ...
    assert mr.read(4, 64 + 40) == (0xDEADBEEF).to_bytes(4, "little")
    # ... and an RDMA Write into the region shows in it, with no copy anywhere.
    mr.write((7).to_bytes(4, "little") * 8, offset=2048)
    wr = verbs.SendWR(wr_id=1, opcode=IBV_WR_RDMA_WRITE, sg=[verbs.SGE(mr.buf + 2048, 32, mr.lkey)],
                      send_flags=IBV_SEND_SIGNALED)
    wr.set_wr_rdma(mr.rkey, mr.buf + 64 + 3 * 32)
    qp.post_send(wr)
    (wc,) = cq.poll_blocking(1, timeout=10)
    assert wc.status == IBV_WC_SUCCESS and words[3].tolist() == [7] * 8
    doubles = mr.ndarray("<f8", 3, offset=4096 - 24)
    doubles[:] = [0.5, 1.5, 2.5]
    assert np.frombuffer(mr.mv, dtype="<f8")[-3:].tolist() == [0.5, 1.5, 2.5]  # the buffer-protocol route
    for shape, offset in (((4, 8), 4096 - 127), (513, 0), (1, -8), ((-1,), 0)):
        with pytest.raises(verbs.UserError):
            mr.ndarray(np.uint64, shape, offset)
    mr.close()  # with arrays alive: the memory stays mapped while they live
    assert words[1, 2] == 0xDEADBEEF


def test_mr_ndarray_without_numpy_says_how_to_get_it(ctx, monkeypatch) -> None:
    mr = verbs.MR(verbs.PD(ctx), 64, IBV_ACCESS_LOCAL_WRITE)
    monkeypatch.setitem(sys.modules, "numpy", None)  # import numpy now raises ImportError
    with pytest.raises(verbs.UserError, match="pip install numpy"):
        mr.ndarray()
