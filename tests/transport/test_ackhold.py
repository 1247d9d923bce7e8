"""The rule both the link's ACK and a QP's Modified ACK hold by (transport/ackhold.py).

Each owner's own tests show the rule at work on its stream
(``tests/transport/test_link_timers.py``, ``tests/daemon/test_flow_ack.py``);
these pin the rule itself, on a clock that is a number.
"""

from __future__ import annotations

from udpverbs.transport.ackhold import AckHold

HOLD = 0.0002


def _learned(now: float = 1.0) -> AckHold:
    """A hold that has seen an answer come within the hold time of a lone acknowledgment."""
    h = AckHold()
    assert not h.owe(now, HOLD)  # nothing learned yet: it leaves now
    h.answered(now + HOLD / 2, carried=False)
    assert h.answers
    return h


def test_nothing_is_held_until_an_answer_comes_in_time() -> None:
    h = AckHold()
    assert not h.owe(1.0, HOLD)
    h.answered(1.0 + 2 * HOLD, carried=False)  # too late to have carried it
    assert not h.answers and not h.owe(2.0, HOLD) and h.until is None


def test_once_learned_an_owed_acknowledgment_waits_for_the_answer() -> None:
    h = _learned()
    assert h.owe(2.0, HOLD) and h.until == 2.0 + HOLD
    assert h.owe(2.0 + HOLD / 2, HOLD) and h.until == 2.0 + HOLD  # a hold under way keeps its time
    h.answered(2.0 + HOLD / 2, carried=True)
    assert h.until is None and h.answers  # carried: the next one waits too
    assert h.owe(3.0, HOLD) and h.until == 3.0 + HOLD


def test_a_hold_that_runs_out_stops_the_holding_until_an_answer_comes_in_time_again() -> None:
    h = _learned()
    assert h.owe(2.0, HOLD)
    h.stop()  # the owner sent it alone at h.until
    assert not h.answers and h.until is None
    assert not h.owe(3.0, HOLD)
    h.answered(3.0 + HOLD, carried=False)  # just in time
    assert h.answers and h.owe(4.0, HOLD)


def test_an_answer_that_carries_an_acknowledgment_owed_but_not_held_teaches_too() -> None:
    # a QP whose answer left in the same pass as the Send it answers
    h = AckHold()
    h.answered(5.0, carried=True)
    assert h.answers and h.owe(6.0, HOLD)
