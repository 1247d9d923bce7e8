"""The rdma_cm-like helper: listen/connect/accept, reject, no listener, disconnect flushes."""

from __future__ import annotations

import errno
import subprocess
import sys
import threading
import time

import pytest
import trio

from udpverbs import verbs
from udpverbs.verbs.enums import (
    IBV_QPS_ERR,
    IBV_QPS_RESET,
    IBV_QPS_RTS,
    IBV_SEND_SIGNALED,
    IBV_WC_SUCCESS,
    IBV_WC_WR_FLUSH_ERR,
    IBV_WR_RDMA_WRITE,
)

from .conftest import Side


def _accept_in_thread(listener: verbs.CMListener, qp: verbs.QP, reply: bytes, out: dict) -> threading.Thread:
    def run() -> None:
        try:
            req = listener.get_request(timeout=10)
            out["req"] = req
            listener.accept(req, qp, private_data=reply)
        except Exception as e:  # surfaced by the test below
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t


def _write_and_check(a: Side, b: Side, data: bytes) -> None:
    """RDMA Write ``data`` from A's MR to the start of B's over A's (connected) QP."""
    a.mr.write(data, len(data), 0)
    wr = verbs.SendWR(wr_id=1, opcode=IBV_WR_RDMA_WRITE, sg=[verbs.SGE(a.mr.buf, len(data), a.mr.lkey)],
                      send_flags=IBV_SEND_SIGNALED)
    wr.set_wr_rdma(b.mr.rkey, b.mr.buf)
    a.qp.post_send(wr)
    (wc,) = a.cq.poll_blocking(1, timeout=10)
    assert wc.status == IBV_WC_SUCCESS and b.mr.read(len(data), 0) == data


def test_connect_accept_then_write(sides, daemons) -> None:
    a, b = sides
    with verbs.CMListener(b.ctx, port=7001) as lst:
        out: dict = {}
        t = _accept_in_thread(lst, b.qp, b"welcome", out)
        conn = verbs.connect(a.qp, "127.0.0.3", 7001, udp_port=daemons[1].port, private_data=b"hello" * 100,
                             ord=2, ird=3, timeout=10)
        t.join(10)
    assert "error" not in out, out.get("error")
    assert out["req"].private_data == b"hello" * 100 and out["req"].remote_qpn == a.qp.qp_num
    assert out["req"].host == "127.0.0.2" and out["req"].udp_port == daemons[0].port
    assert (conn.remote_qpn, conn.private_data) == (b.qp.qp_num, b"welcome")
    attr_a, _ = a.qp.query()
    attr_b, _ = b.qp.query()
    assert attr_a.qp_state == attr_b.qp_state == IBV_QPS_RTS
    assert attr_a.dest_qp_num == b.qp.qp_num and attr_b.dest_qp_num == a.qp.qp_num
    assert attr_a.max_rd_atomic <= attr_b.max_dest_rd_atomic
    _write_and_check(a, b, b"via cm")
    # Disconnect: both QPs go to ERR, and what is posted afterwards is flushed.
    verbs.disconnect(a.qp)
    b.qp.post_recv(verbs.RecvWR(wr_id=9))
    (rwc,) = b.cq.poll_blocking(1, timeout=10)
    assert (rwc.wr_id, rwc.status) == (9, IBV_WC_WR_FLUSH_ERR)
    assert a.qp.query()[0].qp_state == IBV_QPS_ERR and b.qp.query()[0].qp_state == IBV_QPS_ERR


def test_no_listener_is_refused(sides, daemons) -> None:
    a, _ = sides
    with pytest.raises(verbs.VerbsError) as e:
        verbs.connect(a.qp, "127.0.0.3", 7999, udp_port=daemons[1].port, timeout=10)
    assert e.value.error_code == errno.ECONNREFUSED and "nobody listens" in str(e.value)
    assert not isinstance(e.value, verbs.ConnectionRejected)


def _reject_in_thread(listener: verbs.CMListener, private_data: bytes) -> threading.Thread:
    t = threading.Thread(target=lambda: listener.reject(listener.get_request(timeout=10), private_data=private_data))
    t.start()
    return t


def test_rejected_by_the_application(sides, daemons) -> None:
    a, b = sides
    with verbs.CMListener(b.ctx, port=7002) as lst:
        t = _reject_in_thread(lst, b"go away")
        with pytest.raises(verbs.ConnectionRejected) as e:
            verbs.connect(a.qp, "127.0.0.3", 7002, udp_port=daemons[1].port, timeout=10)
        t.join(10)
    # its own errno, not that of nobody listening
    assert e.value.error_code == errno.ECONNABORTED and e.value.private_data == b"go away"
    assert isinstance(e.value, verbs.VerbsError) and "rejected by the peer application" in str(e.value)


def test_a_qp_refused_then_rejected_connects_afterwards(sides, daemons) -> None:
    a, b = sides
    peer = f"127.0.0.3:{daemons[1].port}"
    with pytest.raises(verbs.VerbsError) as e:
        verbs.connect(a.qp, peer, 7012, timeout=10)  # not listening yet
    assert e.value.error_code == errno.ECONNREFUSED
    assert a.qp.query()[0].qp_state == IBV_QPS_RESET and a.qp.qp_state == IBV_QPS_RESET
    with verbs.CMListener(b.ctx, port=7012) as lst:
        t = _reject_in_thread(lst, b"not now")
        with pytest.raises(verbs.ConnectionRejected):
            verbs.connect(a.qp, peer, 7012, timeout=10)
        t.join(10)
        assert a.qp.query()[0].qp_state == IBV_QPS_RESET
        out: dict = {}
        t = _accept_in_thread(lst, b.qp, b"now", out)
        conn = verbs.connect(a.qp, peer, 7012, timeout=10)
        t.join(10)
    assert "error" not in out, out.get("error")
    assert conn.private_data == b"now" and conn.remote_qpn == b.qp.qp_num
    assert a.qp.query()[0].qp_state == IBV_QPS_RTS
    _write_and_check(a, b, b"third time")


def test_the_peer_is_named_as_host_port_or_by_its_gid(sides, daemons) -> None:
    a, b = sides
    port = daemons[1].port
    gid = b.ctx.query_gid()  # as `udpverbs devinfo` prints it: 0000:...:ffff:7f00:0003
    names = [(f"127.0.0.3:{port}", {}), (gid.gid, {"udp_port": port}), (f"[{gid.gid}]:{port}", {}),
             (gid, {"udp_port": port}), (f"[::ffff:127.0.0.3]:{port}", {})]
    with verbs.CMListener(b.ctx, port=7013) as lst:
        for host, kw in names:
            qa, qb = a.new_qp(), b.new_qp()
            out: dict = {}
            t = _accept_in_thread(lst, qb, b"", out)
            conn = verbs.connect(qa, host, 7013, timeout=10, **kw)
            t.join(10)
            assert "error" not in out, (host, out.get("error"))
            assert conn.remote_qpn == qb.qp_num and out["req"].remote_qpn == qa.qp_num, host
    for bad in (f"127.0.0.3:{port + 1}", "127.0.0.3:port", "127.0.0.3:0", f"[{gid.gid}]{port}", f"[{gid.gid}"):
        with pytest.raises(verbs.UserError):
            verbs.connect(a.qp, bad, 7013, udp_port=port, timeout=1)


def test_listen_twice_on_a_port(sides) -> None:
    _, b = sides
    with verbs.CMListener(b.ctx, port=7003):
        with pytest.raises(verbs.VerbsError) as e:
            verbs.CMListener(b.ctx, port=7003)
        assert e.value.error_code == errno.EADDRINUSE


def test_get_request_times_out(sides) -> None:
    _, b = sides
    with verbs.CMListener(b.ctx, port=7004) as lst:
        with pytest.raises(verbs.VerbsError) as e:
            lst.get_request(timeout=0.2)
        assert e.value.error_code == errno.ETIMEDOUT


async def test_cm_with_trio(sides, daemons) -> None:
    a, b = sides
    with verbs.CMListener(b.ctx, port=7005) as lst:
        async def server() -> None:
            req = await lst.get_request_async(timeout=10)
            lst.accept(req, b.qp)

        with trio.fail_after(20):
            async with trio.open_nursery() as n:
                n.start_soon(server)
                conn = await verbs.connect_async(a.qp, "127.0.0.3", 7005, udp_port=daemons[1].port)
    assert conn.remote_qpn == b.qp.qp_num


def test_destroying_a_connected_qp_ends_the_peer(sides, daemons) -> None:
    a, b = sides
    with verbs.CMListener(b.ctx, port=7006) as lst:
        out: dict = {}
        t = _accept_in_thread(lst, b.qp, b"", out)
        verbs.connect(a.qp, "127.0.0.3", 7006, udp_port=daemons[1].port, timeout=10)
        t.join(10)
    a.qp.close()  # as when an application exits without disconnecting
    b.qp.post_recv(verbs.RecvWR(wr_id=4))
    (wc,) = b.cq.poll_blocking(1, timeout=10)
    assert (wc.wr_id, wc.status) == (4, IBV_WC_WR_FLUSH_ERR)


_WAIT_THEN_DIE = """
import sys
from udpverbs import verbs
ctx = verbs.Context(socket_path=sys.argv[1])
lst = verbs.CMListener(ctx, port=7011)
print("listening", flush=True)
lst.get_request(timeout=3600)
"""


def test_a_client_that_dies_while_waiting_frees_what_it_held(daemons) -> None:
    # get_request may wait for as long as its caller asked; a client killed
    # meanwhile must not keep its listener (and the rest of its context)
    # until then.
    ctx = verbs.Context(socket_path=daemons[1].socket_path)
    waits = ctx.query_stats().get("cm_get_request_waits", 0)
    proc = subprocess.Popen([sys.executable, "-c", _WAIT_THEN_DIE, daemons[1].socket_path],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
        deadline = time.monotonic() + 10
        while ctx.query_stats().get("cm_get_request_waits", 0) == waits:  # its request waits in the daemon
            assert time.monotonic() < deadline, "get_request never reached the daemon"
            time.sleep(0.01)
    finally:
        proc.kill()
        proc.wait(10)
    try:
        deadline = time.monotonic() + 5
        while True:
            try:
                verbs.CMListener(ctx, port=7011).close()
                break
            except verbs.VerbsError as e:
                assert e.error_code == errno.EADDRINUSE
                assert time.monotonic() < deadline, "the dead client's listener outlived it"
                time.sleep(0.05)
    finally:
        ctx.close()
