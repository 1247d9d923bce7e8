"""The batch take (``daemon/txbatch.py``) does what the per-WQE path does.

Two sending devices built from the same seed, one with the compiled lanes
(where streams of small Writes and Sends that are alike are taken off the
SQ in one call) and one without, are given the same WQEs: runs of alike
messages, mixed with ones the batch must leave to the per-WQE path (other
lengths, several SGEs, fence or solicited flags, multi-segment messages)
and with faults (an unknown lkey, an SGE outside its region, an rkey the
peer does not know, Sends with no receive posted yet).  One receiver talks
to the first; what it sends back reaches both.  After every step the two
must send the same datagrams byte for byte, be in the same link state and
have written the same CQEs; at the end the receiver holds what was sent.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from udpverbs.bench.inprocess import MR_LEN, Host
from udpverbs.daemon.policy import IN_PASS_ORDER
from udpverbs.wire import native, shm
from udpverbs.wire.shm import SendFlags as F, WcStatus as W, WrOpcode

from .twins import twins, twins_round

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler here: the daemon uses the Python path")

_STEP_S = 0.001
_WRITE = WrOpcode.IBV_WR_RDMA_WRITE
_SEND = WrOpcode.IBV_WR_SEND
#: where the peer's receives start in its region (the Writes land below)
_RECV_AT = MR_LEN // 2
_RECV_LEN = 4096
_CAPS = {"max_send_wr": 64, "max_recv_wr": 64, "max_inline_data": 128}


def _post(host: Host, peer: Host, wr_id: int, opcode: int, flags: int, payload: list[tuple[int, int]] | bytes,
          dst: int, fault: str) -> None:
    """A send WQE written into ``host``'s SQ by hand: ``payload`` SGEs
    ((offset, length) in its region) or inline bytes; ``fault`` makes one
    of its keys or addresses wrong ("lkey", "bounds", "rkey")."""
    ring = host.qp.sq
    ring.prod = ring.hdr.producer
    at = ring.next_slot_offset()
    inline = type(payload) is bytes
    rkey = peer.mr.stag ^ 0x5A00 if fault == "rkey" else peer.mr.stag
    shm.SEND_WQE_HEAD.pack_into(ring.buf, at, wr_id, peer.mr.addr + dst, int(opcode),
                                int(F.IBV_SEND_SIGNALED) | flags | (int(F.IBV_SEND_INLINE) if inline else 0),
                                0 if inline else len(payload), 0, rkey, len(payload) if inline else 0, 0, 0)
    if inline:
        ring.buf[at + shm.SEND_WQE_SG_OFFSET:at + shm.SEND_WQE_SG_OFFSET + len(payload)] = payload
    else:
        for i, (off, n) in enumerate(payload):  # type: ignore[misc]
            lkey = host.mr.stag ^ 0x100 if fault == "lkey" else host.mr.stag
            addr = host.mr.addr + (MR_LEN - n // 2 if fault == "bounds" else off)
            shm.SGE.pack_into(ring.buf, at + shm.SEND_WQE_SG_OFFSET + i * shm.SGE_SIZE, addr, n, lkey)
    ring.push()
    ring.publish()


def _q0_state(qp: Any) -> tuple[int, int, int]:
    return qp.send_msn, qp.q0_cursor, len(qp.q0)


#: a run of alike messages: (Send?, length, inline?, extra flags, fault, how many)
_RUN = st.tuples(st.booleans(), st.sampled_from([1, 8, 64, 100, 1024, 1422, 1446, 2900, 3000, 4096]), st.booleans(),
                 st.sampled_from([0, 0, 0, int(F.IBV_SEND_FENCE), int(F.IBV_SEND_SOLICITED)]),
                 st.sampled_from(["", "", "", "", "", "", "lkey", "bounds", "rkey", "split"]), st.integers(1, 12))


def _stream(seed: int, runs: list[tuple[bool, int, bool, int, str, int]], late_recvs: int,
            loss: float) -> tuple[Host, Host, Host, list[tuple[int, ...]]]:
    """Post ``runs`` on both twins (at most 60 WQEs), the receives for all
    Sends but the last ``late_recvs`` at once and those later; turn until
    every WR completed; return the hosts and the CQEs."""
    rng = random.Random(seed)
    fast, slow = (Host("127.0.0.2", gso=True, native=on, policy=IN_PASS_ORDER) for on in (True, False))
    peer = Host("127.0.0.3", gso=False, native=True, policy=IN_PASS_ORDER)
    clock, pp, pf, ps = twins(peer, fast, slow)
    fast.mr.view[:] = slow.mr.view[:] = rng.randbytes(MR_LEN)
    wqes: list[tuple[int, int, int, list[tuple[int, int]] | bytes, int, str]] = []
    at = 0
    for send, n, inline, flags, fault, count in runs:
        for _ in range(count):
            if len(wqes) == 60:
                break
            src = rng.randrange(0, MR_LEN // 2 - n)
            if fault == "split" and n > 1:  # two SGEs: the per-WQE path's
                payload: list[tuple[int, int]] | bytes = [(src, n // 2), (src + n // 2, n - n // 2)]
            elif inline and n <= _CAPS["max_inline_data"]:
                payload = bytes(fast.mr.view[src:src + n])
            else:
                payload = [(src, n)]
            wqes.append((len(wqes), _SEND if send else _WRITE, flags, payload, at, fault))
            at += n
    sends = [w for w in wqes if w[1] == _SEND]
    for i, _ in enumerate(sends[:max(0, len(sends) - late_recvs)]):
        peer.post_recv(1000 + i, _RECV_AT + i * _RECV_LEN, _RECV_LEN)
    for w in wqes:
        for h in (fast, slow):
            _post(h, peer, *w[:3], w[3], w[4], w[5])  # type: ignore[arg-type]
    cqes: tuple[list[tuple[int, ...]], list[tuple[int, ...]]] = ([], [])
    held: list[bytes] = []
    late = len(sends) - late_recvs
    for step in range(3000):
        clock[0] += _STEP_S
        if step == 40:
            for i in range(max(0, late), len(sends)):
                peer.post_recv(1000 + i, _RECV_AT + i * _RECV_LEN, _RECV_LEN)
        held = twins_round((fast, slow, peer), (pf, ps, pp), held, cqes, rng, loss, clock[0], _q0_state)
        if len(cqes[0]) == len(wqes) and step > 40:
            break
    cqes_f = cqes[0]
    assert sorted(c[0] for c in cqes_f) == list(range(len(wqes)))
    return fast, slow, peer, cqes_f


def _close(*hosts: Host) -> None:
    for h in hosts:
        h.close()


@pytest.fixture(autouse=True)
def _roomy_qps(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in _CAPS.items():
        monkeypatch.setitem(Host.QP_CAPS, k, v)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32), runs=st.lists(_RUN, min_size=1, max_size=8), late_recvs=st.integers(0, 6),
       loss=st.sampled_from([0.0, 0.0, 0.03, 0.1]))
def test_the_batch_take_and_the_per_wqe_path_agree(seed: int, runs: list[tuple[bool, int, bool, int, str, int]],
                                                    late_recvs: int, loss: float) -> None:
    _close(*_stream(seed, runs, late_recvs, loss)[:3])


@pytest.mark.parametrize("send", [False, True])
@pytest.mark.parametrize("size", [64, 1024, 4096])
@pytest.mark.parametrize("inline", [False, True])
def test_a_stream_of_small_messages_is_taken_in_batches(send: bool, size: int, inline: bool) -> None:
    runs = [(send, size, inline, 0, "", 50)]
    fast, slow, peer, cqes = _stream(7, runs, 0, 0.0)
    try:
        assert [c[:2] for c in cqes] == [(i, W.IBV_WC_SUCCESS) for i in range(50)]
        src = bytes(fast.mr.view)
        # (inline only up to 128 bytes: the longer ones take an SGE; a Send
        # of several segments goes the per-WQE way, through the send lane)
        batched = fast.dev.dump_stats().get("tx_batched_wqes", 0)
        assert batched == 0 if send and size > 1024 else batched >= 40
        assert "tx_batched_wqes" not in slow.dev.dump_stats()
        if send:
            received = [bytes(peer.mr.view[_RECV_AT + i * _RECV_LEN:][:size]) for i in range(50)]
        else:
            received = [bytes(peer.mr.view[i * size:(i + 1) * size]) for i in range(50)]
        assert len(set(received)) > 1 and all(r in src for r in received)
    finally:
        _close(fast, slow, peer)


@pytest.mark.parametrize(("fault", "send"), [("lkey", False), ("bounds", False), ("rkey", False), ("lkey", True),
                                             ("bounds", True)])
def test_a_fault_in_the_middle_of_a_stream_completes_alike(fault: str, send: bool) -> None:
    runs = [(send, 64, False, 0, "", 10), (send, 64, False, 0, fault, 1), (send, 64, False, 0, "", 10)]
    fast, slow, peer, cqes = _stream(3, runs, 0, 0.0)
    try:
        statuses = [c[1] for c in sorted(cqes)]
        # (a local error fails the QP at once: what was not yet acknowledged is flushed)
        assert set(statuses[:10]) <= {W.IBV_WC_SUCCESS, W.IBV_WC_WR_FLUSH_ERR}
        assert statuses[10] == {"lkey": W.IBV_WC_LOC_PROT_ERR, "bounds": W.IBV_WC_LOC_PROT_ERR,
                                "rkey": W.IBV_WC_REM_ACCESS_ERR}[fault]
        assert set(statuses[11:]) == {W.IBV_WC_WR_FLUSH_ERR}
    finally:
        _close(fast, slow, peer)


def test_sends_without_receives_are_sent_again_from_the_batch() -> None:
    runs = [(True, 64, True, 0, "", 20), (True, 64, False, 0, "", 20)]
    fast, slow, peer, cqes = _stream(11, runs, 6, 0.0)
    try:
        assert [c[:2] for c in sorted(cqes)] == [(i, W.IBV_WC_SUCCESS) for i in range(40)]
        assert fast.qp.rnr_nacks_received == slow.qp.rnr_nacks_received > 0
        src = bytes(fast.mr.view)
        for i in range(40):
            assert bytes(peer.mr.view[_RECV_AT + i * _RECV_LEN:][:64]) in src
    finally:
        _close(fast, slow, peer)
