"""The run-based sent-packet table against the per-packet one it replaced.

``Recovery`` keeps payload runs and runs of first transmissions as runs;
``recovery_model.PacketRecovery`` (the table before runs) keeps every
message and every packet alone.  Driven by the same operations, as a link
drives them (queue, first transmissions alone or as a run, retransmissions
of what ``next_lost`` names, ACKs with SACK blocks, RTOs), they must answer
alike and hold the same state after every step.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from udpverbs.transport.recovery import Recovery, RttEstimator

from .recovery_model import PacketRecovery

SIZE = 100


def _same(rec: Recovery, model: PacketRecovery) -> None:
    assert rec.una == model.una
    assert rec.bytes_in_flight == model.bytes_in_flight
    assert rec.max_delivered_tx == model.max_delivered_tx
    assert (rec.reorder_deadline, rec.reordering_seen, rec.reo_mult, rec.spurious, rec.rack_rtt) == (
        model.reorder_deadline, model.reordering_seen, model.reo_mult, model.spurious, model.rack_rtt)
    assert rec.sacked == model.sacked
    assert list(rec.lost) == list(model.lost)
    assert rec.in_flight() == model.inflight
    assert rec.has_inflight() == bool(model.inflight)
    assert rec.queued() == set(model.messages)
    for n, payload in model.messages.items():
        assert bytes(rec.message(n)) == bytes(payload)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), threshold=st.integers(1, 4), timed=st.booleans())
def test_runs_answer_as_packets_do(data: st.DataObject, threshold: int, timed: bool) -> None:
    # timed: the clock moves and RTT samples come (RACK's time rule, the
    # reorder timer, credited and spurious retransmissions); else only the
    # packet threshold decides, as before any sample.
    rtts = RttEstimator(1.0, 0.0, 1.0), RttEstimator(1.0, 0.0, 1.0)
    rec, model = Recovery(threshold, rtts[0]), PacketRecovery(threshold, rtts[1])
    queued = sent = 0  # next message to queue, next first transmission
    now = 0.0
    for _ in range(data.draw(st.integers(1, 60))):
        if timed:
            now += data.draw(st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0, 3.0]))
            if data.draw(st.booleans()):
                sample = data.draw(st.sampled_from([0.5, 1.0, 2.0, 4.0]))
                for r in rtts:
                    r.update(sample)
        op = data.draw(st.sampled_from(["queue", "send", "retransmit", "ack", "ack", "rto", "ping", "probe",
                                        "episode", "timer"]))
        if op == "ping":
            # A ping-pong's exchange: one message queued, sent and acked
            # (Recovery's one-packet path when nothing else is in flight).
            payload = bytes([queued % 251, 2])
            model.messages[queued] = payload
            rec.add(queued, payload)
            if sent == queued:
                rec.on_sent(sent, SIZE, False, now)
                model.on_sent(sent, SIZE, False, now)
                sent += 1
            queued += 1
            cum = min(rec.una + 1, sent)
            assert rec.on_ack(cum, [], now) == model.on_ack(cum, [], now)
        elif op == "queue":
            k = data.draw(st.integers(1, 6))
            if data.draw(st.booleans()):
                # a payload run: messages in one buffer, the last shorter, back
                # to back or (the send lane's slotted runs) each after a head
                # and slot bytes from the next, with other bytes in between
                stride, last_len = 7, data.draw(st.integers(0, 7))
                head, slot = data.draw(st.sampled_from([(0, stride), (3, stride + 5)]))
                buf = bytearray(b"\xee" * (head + (k - 1) * slot + last_len + 2))
                for i in range(k):
                    n = queued + i
                    length = last_len if i == k - 1 else stride
                    at = head + i * slot
                    buf[at:at + length] = bytes([n % 251]) * length
                    model.messages[n] = bytes(buf[at:at + length])
                if (head, slot) == (0, stride):
                    rec.add_run(queued, k, memoryview(buf), stride, last_len)
                else:
                    rec.add_run(queued, k, memoryview(buf), stride, last_len, head, slot)
            else:
                for n in range(queued, queued + k):
                    payload = bytes([n % 251, 1])
                    model.messages[n] = payload
                    rec.add(n, payload)
            queued += k
        elif op == "send" and sent < queued:
            k = data.draw(st.integers(1, min(6, queued - sent)))
            if k > 1 and data.draw(st.booleans()):
                last = data.draw(st.integers(1, SIZE))
                rec.on_sent_run(sent, k, SIZE, last, now)
                model.on_sent_run(sent, k, SIZE, last, now)
            else:
                for n in range(sent, sent + k):
                    rec.on_sent(n, SIZE, False, now)
                    model.on_sent(n, SIZE, False, now)
            sent += k
        elif op == "retransmit":
            n = rec.next_lost()
            assert n == model.next_lost()
            if n is not None:
                rec.on_sent(n, SIZE, True, now)
                model.on_sent(n, SIZE, True, now)
        elif op == "ack":
            # as Link._process_ack passes them: una <= cum <= next unsent,
            # SACK blocks clipped to what was sent
            cum = data.draw(st.integers(rec.una, sent))
            blocks = []
            for _ in range(data.draw(st.integers(0, 3))):
                if sent > rec.una:
                    s = data.draw(st.integers(rec.una, sent - 1))
                    blocks.append((s, data.draw(st.integers(s + 1, sent))))
            assert rec.on_ack(cum, blocks, now) == model.on_ack(cum, blocks, now)
        elif op == "rto":
            assert rec.on_rto() == model.on_rto()
        elif op == "probe":
            assert rec.probe_last() == model.probe_last()
        elif op == "episode":
            rec.start_episode(sent)
            model.start_episode(sent)
        elif op == "timer":
            assert rec.detect_lost(now) == model.detect_lost(now)
        _same(rec, model)


def test_a_run_is_acknowledged_as_a_whole_and_split_by_sack_and_loss() -> None:
    rec = Recovery(reorder_threshold=2)
    rec.add_run(0, 10, memoryview(bytearray(100)), 10, 10)
    rec.on_sent_run(0, 10, 60, 50)
    assert rec.bytes_in_flight == 9 * 60 + 50
    # 0-2 cumulative, 5-6 selectively: tx 6 delivered, so tx <= 4 (3, 4) is lost
    assert rec.on_ack(3, [(5, 7)]) == (5 * 60, 2 * 60)
    assert list(rec.lost) == [3, 4] and rec.sacked == {5, 6}
    assert sorted(rec.in_flight()) == [7, 8, 9] and rec.in_flight()[9] == (9, 50, 9, 0.0)
    assert rec.queued() == set(range(3, 10))
    assert rec.next_lost() == 3
    rec.on_sent(3, 60, True)
    assert rec.on_ack(10, []) == (2 * 60 + 50 + 60, 0)
    assert not rec.has_inflight() and rec.queued() == set() and rec.bytes_in_flight == 0
