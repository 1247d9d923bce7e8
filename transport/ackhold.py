"""Holding an acknowledgment for the answer that can carry it.

In a ping-pong each side answers what it receives at once, and the answer
can carry the acknowledgment of what it answers.  Sent alone, that
acknowledgment costs both daemons a datagram and a pass.  TCP's delayed
ACK and its ping-pong mode wait for the reply for the same reason.  Two
acknowledgments here follow the rule: the link's ACK of a packet that asks
for one at once (``transport/link.py``) and a QP's Modified ACK of a
queue-0 message (``daemon/responder.py``).

The rule, one instance per acknowledgment stream:

* Hold only after learning that we answer: an answer of ours left within
  the hold time of the last acknowledgment that went alone (or carried the
  one owed).
* A held acknowledgment waits until ``until`` (the owner's delayed-ACK
  time).  If it goes alone then, holding stops until an answer comes in
  time again, so a peer we never answer waits for one acknowledgment once,
  not on every message.

The owner decides when its acknowledgment is owed, when it leaves alone,
and what else stops the holding (the link: an answer the peer must take
apart before it can reply, ``Link.send(ack_carrier=False)``).  Pure and
deterministic: times are the owner's clock.
"""

from __future__ import annotations

INF = float("inf")


class AckHold:
    """Whether an owed acknowledgment waits for our answer, and until when."""

    __slots__ = ("answers", "until", "answer_by")

    def __init__(self) -> None:
        self.answers = False  # we answer in time: hold
        self.until: float | None = None  # held until then; None: not held
        self.answer_by = -INF  # an answer sent by then could have carried the acknowledgment that left alone

    def owe(self, now: float, hold_s: float) -> bool:
        """An acknowledgment is owed from ``now``: True if it waits for our
        answer (until ``until``; a hold under way keeps its time), False if
        it must leave now."""
        if self.answers:
            if self.until is None:
                self.until = now + hold_s
            return True
        self.acking_now(now, hold_s)
        return False

    def acking_now(self, now: float, hold_s: float) -> None:
        """The owed acknowledgment leaves now, not held (by this rule, or
        by another of the owner's): an answer by ``now + hold_s`` could
        have carried it."""
        self.answer_by = now + hold_s

    def answered(self, now: float, carried: bool) -> None:
        """An answer of ours left; ``carried``: with the owed acknowledgment."""
        if carried:
            self.until = None
            self.answers = True
        elif self.until is None and now <= self.answer_by:
            self.answers = True  # it could have carried the one that left alone: hold the next
            self.answer_by = -INF

    def stop(self) -> None:
        """The held acknowledgment left alone, or the answers are no use as
        carriers: acknowledge at once until an answer comes in time again."""
        self.answers = False
        self.until = None
