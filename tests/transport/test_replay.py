"""The anti-replay window and the clock-derived packet numbers (``transport/replay.py``)."""

from __future__ import annotations

import random

import pytest

from udpverbs.transport.replay import ReplayWindow, first_packet_number


def test_in_order_numbers_are_all_accepted_once() -> None:
    w = ReplayWindow(64)
    assert all(w.accept(pn) for pn in range(1000, 1300))
    assert w.top == 1299
    assert not any(w.fresh(pn) for pn in range(1236, 1300))  # the last 64, seen
    assert not any(w.accept(pn) for pn in range(1236, 1300))


def test_reordered_within_the_window_is_accepted() -> None:
    w = ReplayWindow(64)
    order = [10, 12, 11, 15, 13, 14, 20, 16, 19, 18, 17]
    assert [w.accept(pn) for pn in order] == [True] * len(order)
    assert w.top == 20
    assert w.accept(20 - 63)  # the window's lowest number, never seen
    assert not w.accept(20 - 64)  # just below it: too old


def test_a_duplicate_is_refused_wherever_it_falls() -> None:
    w = ReplayWindow(64)
    for pn in (100, 90, 101):
        assert w.accept(pn)
    for pn in (100, 90, 101):
        assert not w.fresh(pn) and not w.accept(pn)
    assert (w.top, w.bits) == (101, 0b1 | 0b10 | 1 << 11)  # refusals change nothing


def test_too_old_is_refused_even_if_never_seen() -> None:
    w = ReplayWindow(128)
    w.accept(1_000)
    assert not w.accept(1_000 - 128) and not w.accept(0)
    assert w.accept(1_000 - 127)


def test_a_big_jump_forgets_everything_below_the_new_window() -> None:
    w = ReplayWindow(64)
    for pn in range(5):
        w.accept(pn)
    big = first_packet_number(1_800_000_000 * 10**9)  # a restarted sender
    assert w.accept(big)
    assert w.bits == 1  # no huge shift: the old bitmap is gone
    assert not w.accept(4) and not w.accept(big)
    assert w.accept(big - 63) and w.accept(big + 1)
    assert not w.accept(big - 64)


def test_the_window_agrees_with_a_set_of_seen_numbers() -> None:
    rng = random.Random(7)
    w, seen, top = ReplayWindow(32), set(), -1
    for _ in range(5000):
        pn = max(0, top + rng.randint(-40, 8))
        expect = pn not in seen and pn > top - 32
        assert w.fresh(pn) == expect
        assert w.accept(pn) == expect
        if expect:
            seen.add(pn)
            top = max(top, pn)


def test_numbers_of_a_later_start_are_above_any_an_earlier_start_could_have_used() -> None:
    t0 = 1_764_000_000_000_000_000  # ns
    first = first_packet_number(t0)
    # one second of sending at 1,000 datagrams per µs (far beyond any daemon)
    last_possible = first + 1000 * 1_000_000
    assert first_packet_number(t0 + 1_000_000_000 + 1_000) > last_possible
    assert first_packet_number(t0) < 1 << 64 and first_packet_number(18_000_000_000 * 10**9) < 1 << 64


def test_a_window_spans_at_least_one_number() -> None:
    with pytest.raises(ValueError):
        ReplayWindow(0)
