"""The armed receive: the lane set up before its datagram comes.

A device arms the compiled lane for the run its link's hint expects next
(``ReceiveLane.arm``) while it waits, and the next pass reads the socket and
places the data in one compiled call (``Receiver.read_armed``).  It must
place exactly what the Python path would, take anything else the usual
way, and never use a set-up that the tables moved under: a region gone or
invalidated, a QP that left RTS.  Real sockets on loopback; each loop is
turned by hand.
"""

from __future__ import annotations

import socket

import pytest
import trio

from udpverbs.daemon.control import modify_qp
from udpverbs.wire import native
from udpverbs.wire.shm import QPAttrMask as M, QPState as S, WcStatus as W, WrOpcode

from udpverbs.bench.inprocess import Host, complete, connected


def arm(h: Host) -> None:
    """Arm ``h``'s receive lane for what its QP 1's link expects next, as the data loop does."""
    h.dev.lane.arm(h.qp.link, h.dev.links, h.dev.arm_limit)

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler here: the daemon uses the Python path")


def _armed(a: Host, b: Host) -> None:
    """One Write A -> B first (it sets B's hint and gives the link an RTT
    sample), then B arms for A's next Write."""
    a.mr.view[:8] = b"first!!!"
    a.post_write(1, 0, 8, b, 0)
    assert complete(a, b, 1) == [(1, W.IBV_WC_SUCCESS)]
    arm(b)
    assert b.dev.lane.armed is not None


async def _wait_readable(h: Host) -> None:
    """Wait until ``h``'s socket has something to read."""
    for _ in range(200):
        if h.dev.udp.rx_epoll.poll(0):
            return
        await trio.sleep(0.001)
    raise AssertionError("nothing arrived")


async def _arrived(a: Host, b: Host) -> None:
    """A's loop sends what A posted; wait until B's socket has it."""
    a.dev.poll_once()
    await _wait_readable(b)


async def test_an_armed_write_is_placed_by_the_read() -> None:
    async with connected() as (a, b):
        _armed(a, b)
        b.dev.poll_once()  # nothing to read: still armed
        assert b.dev.lane.armed is not None and b.dev.stats["rx_armed"] == 0
        a.mr.view[100:164] = bytes(range(64))
        a.post_write(2, 100, 64, b, 4096)
        await _arrived(a, b)
        b.dev.poll_once()
        assert b.dev.stats["rx_armed"] == 1
        # used up; armed again only for the datagram after it
        assert b.dev.lane.armed is None or b.dev.lane.armed[3] == b.qp.link.link.rcv_nxt
        assert bytes(b.mr.view[4096:4160]) == bytes(range(64))
        assert not any(b.mr.view[8:4096]) and not any(b.mr.view[4160:8192])
        assert complete(a, b, 1) == [(2, W.IBV_WC_SUCCESS)]
        assert b.qp.state == S.IBV_QPS_RTS


@pytest.mark.parametrize("change", ["invalidated", "qp in error"])
async def test_an_arming_the_tables_moved_under_is_not_used(change: str) -> None:
    # After B armed, its region is invalidated (as deregistration does
    # first) or its QP goes to ERR: A's Write must not land, and the Python
    # path decides what becomes of it.
    async with connected() as (a, b):
        _armed(a, b)
        if change == "invalidated":
            b.dev.stags.invalidate(b.mr.stag)
        else:
            modify_qp(b.qp, M.IBV_QP_STATE, dict(b.qp.attrs, qp_state=S.IBV_QPS_ERR))
        a.mr.view[100:164] = b"\xff" * 64
        a.post_write(2, 100, 64, b, 4096)
        await _arrived(a, b)
        b.dev.poll_once()
        assert b.dev.stats["rx_armed_stale"] == 1 and b.dev.stats["rx_armed"] == 0
        assert not any(b.mr.view[4096:4160])
        if change == "invalidated":
            # the Python path's answer: a Terminate, and A's Write fails
            assert complete(a, b, 1) == [(2, W.IBV_WC_REM_ACCESS_ERR)]


async def test_what_the_armed_lane_does_not_take_goes_the_python_path() -> None:
    # B is armed for A's Writes; A sends a Send instead (B has a receive
    # posted): the read finds a segment the run does not take, and the
    # Python path places it in the receive and completes it.
    async with connected() as (a, b):
        _armed(a, b)
        b.post_recv(50, 8192, 64)
        a.mr.view[200:210] = b"0123456789"
        a.post_write(3, 200, 10, b, 0, opcode=WrOpcode.IBV_WR_SEND)
        await _arrived(a, b)
        b.dev.poll_once()
        assert b.dev.stats["rx_armed"] == 1
        assert bytes(b.mr.view[8192:8202]) == b"0123456789"
        got = b.completions()
        for _ in range(50):
            if got:
                break
            b.dev.poll_once()
            got += b.completions()
        assert got == [(50, W.IBV_WC_SUCCESS)]
        assert complete(a, b, 1) == [(3, W.IBV_WC_SUCCESS)]


async def test_a_datagram_from_elsewhere_while_armed_is_judged_alone() -> None:
    # Garbage from an address B has no link with: counted and dropped, and
    # B's link to A carries on (A's next Write lands).
    async with connected() as (a, b):
        _armed(a, b)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
            stranger.bind(("127.0.0.4", 0))
            stranger.sendto(b"\x01" * 40, b.dev.udp.sock.getsockname())
            await _wait_readable(b)
            b.dev.poll_once()
        assert b.dev.stats["rx_armed"] == 1
        assert b.dev.stats["rx_garbage"] + b.dev.stats["rx_unknown_peer"] == 1
        a.mr.view[300:304] = b"next"
        a.post_write(4, 300, 4, b, 64)
        assert complete(a, b, 1) == [(4, W.IBV_WC_SUCCESS)]
        assert bytes(b.mr.view[64:68]) == b"next"


async def test_an_armed_send_lands_in_its_receive_and_completes_it() -> None:
    # The third receive is in another region than the second, which the
    # lane was last armed for: the arming must follow the receive.
    async with connected() as (a, b):
        spare = b.dev.stags.lookup(b.spare_stag())
        assert spare is not None
        for i in range(3):  # the first sets B's hint
            if i < 2:
                b.post_recv(60 + i, 8192 + 64 * i, 64)
            else:
                b.post_recv(62, 128, 64, local=spare)
            a.mr.view[i:i + 5] = b"abcde"[i:] + b"!" * i
            a.post_write(10 + i, i, 5, b, 0, opcode=WrOpcode.IBV_WR_SEND)
            if i:
                arm(b)
                assert b.dev.lane.armed is not None
                await _arrived(a, b)
            assert complete(a, b, 1) == [(10 + i, W.IBV_WC_SUCCESS)]
        assert b.dev.stats["rx_armed"] == 2
        assert [bytes(b.mr.view[8192 + 64 * i:8197 + 64 * i]) for i in range(2)] == [b"abcde", b"bcde!"]
        assert bytes(spare.view[128:133]) == b"cde!!" and not any(b.mr.view[128:133])
        assert b.completions() == [(60, W.IBV_WC_SUCCESS), (61, W.IBV_WC_SUCCESS), (62, W.IBV_WC_SUCCESS)]


async def test_an_armed_read_response_completes_the_read() -> None:
    async with connected() as (a, b):
        b.mr.view[0:16] = bytes(range(16, 32))
        for i in range(2):  # the first sets A's hint
            a.post_write(20 + i, 1024 + 16 * i, 16, b, 0, opcode=WrOpcode.IBV_WR_RDMA_READ)
            if i:
                a.dev.poll_once()  # the request leaves: its Read heads the ORRQ
                arm(a)
                assert a.dev.lane.armed is not None
                b.dev.poll_once()  # B answers
                await _wait_readable(a)
            assert complete(a, b, 1) == [(20 + i, W.IBV_WC_SUCCESS)]
        assert a.dev.stats["rx_armed"] >= 1
        assert bytes(a.mr.view[1024:1056]) == bytes(range(16, 32)) * 2


async def test_an_armed_read_of_a_batch_of_requests_keeps_the_pass_budget() -> None:
    # 16 Fetch-and-Adds reach B in one GRO buffer while B is armed for
    # them: the read takes the budget's worth (8) and leaves the rest for
    # the next pass, as the usual read does, so the first answers leave in
    # between (the README's "Which daemon sets the pace").
    async with connected() as (a, b):
        for h in (a, b):
            h.qp.attrs["max_rd_atomic"] = h.qp.attrs["max_dest_rd_atomic"] = 16
        if not (a.dev.udp.gso and b.dev.udp.gro):
            pytest.skip("this kernel has no UDP_SEGMENT / UDP_GRO")
        a.post_write(0, 1024, 8, b, 64, opcode=WrOpcode.IBV_WR_ATOMIC_FETCH_AND_ADD, compare_add=1)
        assert complete(a, b, 1) == [(0, W.IBV_WC_SUCCESS)]  # B's hint: atomic requests
        arm(b)
        assert b.dev.lane.armed is not None
        for i in range(16):
            a.post_write(1 + i, 2048 + 8 * i, 8, b, 64, opcode=WrOpcode.IBV_WR_ATOMIC_FETCH_AND_ADD, compare_add=1)
        await _arrived(a, b)
        before, armed = b.dev.stats["rx_native_requests"], b.dev.stats["rx_armed"]
        b.dev.poll_once()
        assert b.dev.stats["rx_armed"] == armed + 1
        assert b.dev.stats["rx_native_requests"] - before == b.dev.config.rx_dispatch_budget == 8
        assert b.dev.receiver.rest is not None
        done = complete(a, b, 16)
        assert done == [(1 + i, W.IBV_WC_SUCCESS) for i in range(16)]
        assert int.from_bytes(b.mr.view[64:72], "little") == 17
