"""Recovery: the RFC 6298 estimator and the sent-packet table on their own."""

from __future__ import annotations

import pytest

from udpverbs.transport.recovery import Recovery, RttEstimator


def test_rtt_estimator_rfc6298() -> None:
    r = RttEstimator(initial_rto_s=1.0, min_rto_s=0.001, max_rto_s=60.0)
    assert r.rto_s == 1.0 and r.srtt_s is None
    r.update(0.1)
    assert (r.srtt_s, r.rttvar_s, r.rto_s) == pytest.approx((0.1, 0.05, 0.3))
    r.update(0.2)
    # rttvar = 3/4 0.05 + 1/4 |0.1 - 0.2|; srtt = 7/8 0.1 + 1/8 0.2
    assert r.rttvar_s == pytest.approx(0.0625) and r.srtt_s == pytest.approx(0.1125)
    assert r.rto_s == pytest.approx(0.1125 + 4 * 0.0625)
    r.update(1000.0)
    assert r.rto_s == 60.0  # clamped


def sent(rec: Recovery, n: int, size: int = 100, retx: bool = False) -> None:
    if n not in rec.queued():
        rec.add(n, b"x")
    rec.on_sent(n, size, retx)


def test_cumulative_and_selective_acks_and_packet_threshold() -> None:
    rec = Recovery(reorder_threshold=3)
    for n in range(10):
        sent(rec, n)
    acked, lost = rec.on_ack(2, [(3, 5)])  # 0,1 cumulative; 3,4 SACKed; 2 still a hole
    assert (acked, lost) == (400, 0) and rec.una == 2 and rec.sacked == {3, 4}
    acked, lost = rec.on_ack(2, [(3, 6)])  # 5 delivered: tx 5 >= tx 2 + 3: 2 is lost
    assert (acked, lost) == (100, 100) and list(rec.lost) == [2]
    assert rec.next_lost() == 2 and rec.next_lost() is None
    sent(rec, 2, retx=True)
    # A delivered retransmission does not advance the delivered tx id
    # (ambiguous), so it declares nothing lost behind it.
    acked, lost = rec.on_ack(6, [])
    assert (acked, lost) == (100, 0) and rec.bytes_in_flight == 400


def test_a_late_sack_of_a_lost_message_prevents_its_retransmission() -> None:
    rec = Recovery(reorder_threshold=1)
    for n in range(4):
        sent(rec, n)
    rec.on_ack(0, [(1, 2)])  # 0 declared lost
    assert list(rec.lost) == [0]
    rec.on_ack(0, [(0, 2)])  # ...but it had arrived
    assert rec.next_lost() is None


def test_repeated_sack_blocks_are_applied_once() -> None:
    rec = Recovery(reorder_threshold=100)
    for n in range(50):
        sent(rec, n)
    assert rec.on_ack(0, [(10, 20)]) == (1000, 0)
    assert rec.on_ack(0, [(10, 20)]) == (0, 0)
    assert rec.on_ack(0, [(5, 20), (10, 25)]) == (1000, 0)
    assert rec.bytes_in_flight == 3000


def test_rto_declares_everything_unsacked_lost() -> None:
    rec = Recovery()
    for n in range(6):
        sent(rec, n)
    rec.on_ack(1, [(3, 4)])
    assert rec.on_rto() == 4  # 1, 2, 4, 5
    assert [rec.next_lost() for _ in range(5)] == [1, 2, 4, 5, None]
    assert rec.bytes_in_flight == 0
