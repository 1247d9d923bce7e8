"""The impairment model (transport/impair.py): the spec it reads and what it does to datagrams.

Time is a number and randomness a seeded ``random.Random``, so each
outcome below is exact for its seed; the rates are checked against their
expectation within about four standard deviations.
"""

from __future__ import annotations

import math
import random

import pytest

from udpverbs.transport.impair import DEFAULT_LIMIT, DEFAULT_REORDER_DELAY_S, Impairment, ImpairSpec, parse_spec


def _model(spec: str, seed: int = 1) -> Impairment:
    return Impairment(parse_spec(spec), random.Random(seed))


def _datagram(i: int, size: int = 64) -> bytes:
    return (i.to_bytes(4, "big") * (size // 4 + 1))[:size]


def _within(count: int, n: int, p: float) -> bool:
    """``count`` of ``n`` draws is what probability ``p`` gives, within four standard deviations."""
    return abs(count - n * p) <= 4 * math.sqrt(n * p * (1 - p)) + 1


# -- the spec ------------------------------------------------------------------------


def test_the_spec_reads_netem_keys_and_units() -> None:
    s = parse_spec("loss=0.05,dup=0.02,reorder=5%,corrupt=0.001,delay=200us,jitter=50us,rate=1gbit")
    assert s == ImpairSpec(loss=0.05, dup=0.02, reorder=0.05, corrupt=0.001, delay_s=200e-6, jitter_s=50e-6,
                           rate_bps=1e9)
    assert s.limit == DEFAULT_LIMIT and s.hold_back_s == 200e-6  # reordered: held one more delay
    assert parse_spec("reorder=0.1").hold_back_s == DEFAULT_REORDER_DELAY_S
    assert parse_spec("delay=1.5ms").delay_s == pytest.approx(1.5e-3)
    assert parse_spec("delay=0.5s, duplicate=1%").delay_s == 0.5 and parse_spec("duplicate=1%").dup == 0.01
    assert parse_spec("reorder_delay=3ms,limit=50") == ImpairSpec(reorder_delay_s=3e-3, limit=50)
    # tc's rates: bit forms in bits per second, bps forms in bytes per second, ki.. in powers of 1024
    for text, bps in [("100kbit", 1e5), ("10mbit", 1e7), ("1gbit", 1e9), ("1kibit", 1024), ("1mbps", 8e6),
                      ("2gbps", 16e9), ("500bit", 500), ("1MBit", 1e6)]:
        assert parse_spec(f"rate={text}").rate_bps == pytest.approx(bps), text
    # a TOML table: numbers for probabilities and the limit, strings with units for the rest
    assert ImpairSpec.from_items({"loss": 0.01, "delay": "1ms", "limit": 10}) == ImpairSpec(
        loss=0.01, delay_s=1e-3, limit=10)


@pytest.mark.parametrize("spec", [
    "loss=0.05,dup=0.02,reorder=0.05,corrupt=0.001",
    "delay=200us,jitter=50us,rate=1gbit,limit=64,reorder=0.5,reorder_delay=2ms",
])
def test_a_spec_describes_itself_in_its_own_terms(spec: str) -> None:
    s = parse_spec(spec)
    assert parse_spec(s.describe()) == s


@pytest.mark.parametrize("spec, fragment", [
    ("", "empty spec"),
    ("loss", "not KEY=VALUE"),
    ("loss=", "not KEY=VALUE"),
    ("frob=1", "unknown key 'frob'"),
    ("loss=1.5", "from 0 to 1"),
    ("loss=150%", "from 0 to 1"),
    ("loss=-0.1", "from 0 to 1"),
    ("loss=lots", "not a number"),
    ("loss=nan", "not a number"),
    ("loss=1e999", "not a finite number"),
    ("corrupt=5ms", "a probability is a number"),
    ("delay=200", "give a time with its unit"),
    ("delay=200xs", "give a time with its unit"),
    ("jitter=-1ms", "not negative"),
    ("rate=1000", "give a rate with tc's units"),
    ("rate=0bit", "more than 0"),
    ("limit=0", "a whole number of datagrams"),
    ("limit=2.5", "a whole number of datagrams"),
    ("loss=0.1,loss=0.2", "given twice"),
    ("dup=0.1,duplicate=0.2", "given twice"),
])
def test_a_bad_spec_is_a_value_error_naming_the_part(spec: str, fragment: str) -> None:
    with pytest.raises(ValueError, match="impair") as e:
        parse_spec(spec)
    assert fragment in str(e.value)


def test_a_toml_value_of_the_wrong_type_is_refused() -> None:
    with pytest.raises(ValueError, match="not a number or a string"):
        ImpairSpec.from_items({"loss": True})
    with pytest.raises(ValueError, match="not a number or a string"):
        ImpairSpec.from_items({"delay": ["1ms"]})


# -- what it does ----------------------------------------------------------------------


def test_each_effect_happens_at_its_rate() -> None:
    n = 40_000
    m = _model("loss=0.05,dup=0.02,reorder=0.05,corrupt=0.01,limit=100000", seed=7)
    for i in range(n):
        m.offer(_datagram(i), 0.0)
    out = m.due(10.0)
    st = m.stats
    assert st["offered"] == n and _within(st["lost"], n, 0.05)
    survivors = n - st["lost"]
    assert _within(st["duplicated"], survivors, 0.02)
    copies = survivors + st["duplicated"]
    assert _within(st["reordered"], copies, 0.05) and _within(st["corrupted"], copies, 0.01)
    assert len(out) == st["released"] == copies and m.held == 0 and m.next_deadline() is None
    assert st["tail_dropped"] == 0


def test_corruption_flips_exactly_one_bit() -> None:
    m = _model("corrupt=0.5", seed=3)
    sent = [random.Random(i).randbytes(1472) for i in range(400)]
    for d in sent:
        m.offer(d, 0.0)
    out = m.due(0.0)
    assert len(out) == len(sent)  # no delay: in the order offered
    flipped = 0
    for d, r in zip(sent, out):
        bits = sum(bin(a ^ b).count("1") for a, b in zip(d, r[1]))
        assert len(r[1]) == len(d) and bits in (0, 1)
        flipped += bits
    assert flipped == m.stats["corrupted"] and _within(flipped, len(sent), 0.5)


def test_the_same_seed_gives_the_same_datagrams_at_the_same_times() -> None:
    spec = "loss=0.1,dup=0.1,reorder=0.2,corrupt=0.05,delay=1ms,jitter=300us,rate=100mbit"

    def run(seed: int) -> list[tuple[float, bytes, int]]:
        m = _model(spec, seed)
        for i in range(2000):
            m.offer(_datagram(i, 1000), i * 20e-6, to=i)
        return [(r[0], bytes(r[1]), r[2]) for r in m.due(100.0)]

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_without_reordering_order_is_kept_and_with_it_later_datagrams_overtake() -> None:
    def order(spec: str) -> list[int]:
        m = _model(spec, seed=5)
        released: list[int] = []
        for i in range(3000):  # one every 10 µs, released as a daemon's passes would
            m.offer(_datagram(i), i * 10e-6, to=i)
            released += [r[2] for r in m.due(i * 10e-6)]
        return released + [r[2] for r in m.due(1.0)]

    assert order("loss=0.1,delay=500us") == sorted(order("loss=0.1,delay=500us"))
    reordered = order("reorder=0.05")
    assert sorted(reordered) == list(range(3000))
    # each held-back datagram (1 ms) is passed by the next hundred sent, and
    # comes out after a later one: a descent in the order for each (5%)
    descents = sum(1 for a, b in zip(reordered, reordered[1:]) if b < a)
    assert 0.03 * 3000 < descents < 0.08 * 3000
    # jitter larger than the spacing reorders too, as netem's does
    jittered = order("delay=1ms,jitter=100us")
    assert jittered != sorted(jittered)


def test_delay_and_jitter_bound_each_datagram_and_the_deadline_says_when() -> None:
    m = _model("delay=2ms,jitter=500us,limit=5000", seed=9)
    offered = {i: i * 1e-4 for i in range(5000)}
    for i, t in offered.items():
        m.offer(_datagram(i), t, to=i)
    first = m.next_deadline()
    assert first is not None and 1.5e-3 <= first <= 2.5e-3
    assert m.due(first - 1e-9) == [] and m.due(first)[0][0] == first
    waits = [r[0] - offered[r[2]] for r in m.due(10.0)]
    assert len(waits) == 4999 and all(1.5e-3 - 1e-12 <= w <= 2.5e-3 + 1e-12 for w in waits)
    assert sum(waits) / len(waits) == pytest.approx(2e-3, abs=3e-5)


def test_the_bottleneck_serializes_at_its_rate() -> None:
    # 1250-byte datagrams through 1 Mbit/s: one every 10 ms, whenever they were offered
    m = _model("rate=1mbit")
    for i in range(50):
        m.offer(_datagram(i, 1250), 0.0, to=i)
    m.offer(_datagram(50, 1250), 0.2, to=50)  # queued behind the burst (which ends at 0.5 s)
    assert m.due(0.0) == []
    out = m.due(10.0)
    assert [r[2] for r in out] == list(range(51))
    assert [round(r[0], 9) for r in out] == [round(0.01 * (i + 1), 9) for i in range(51)]
    # idle again: the next one leaves after its own serialization time only
    m.offer(_datagram(99, 1250), 5.0)
    assert m.next_deadline() == pytest.approx(5.01)


def test_what_is_held_is_bounded_by_the_limit_and_the_rest_dropped_at_the_tail() -> None:
    # twice what the bottleneck carries, for 2 s: the queue fills to the limit and stays there
    m = _model("rate=8mbit,delay=5ms,limit=64")  # 1000 B per ms
    most = 0
    for i in range(4000):
        now = i * 0.5e-3
        m.offer(_datagram(i, 1000), now)
        most = max(most, m.held)
        m.due(now)
    assert most == 64
    st = m.stats
    assert st["offered"] == 4000 and st["tail_dropped"] > 1800
    assert st["released"] + m.held + st["tail_dropped"] == 4000


def test_an_empty_model_has_no_deadline_and_releases_nothing() -> None:
    m = _model("loss=0.5")
    assert m.next_deadline() is None and m.due(1e9) == [] and m.held == 0
    buf = bytearray(_datagram(1))
    m2 = _model("delay=1ms")
    m2.offer(memoryview(buf), 0.0)
    buf[:] = bytes(len(buf))  # the caller reuses its buffer: the model kept its own copy
    assert m2.due(1.0)[0][1] == _datagram(1)
