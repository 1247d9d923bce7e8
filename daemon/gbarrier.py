"""The barriers of one process group, as one daemon runs them (sans-IO).

Theory of operation
-------------------
The structure is over the group's *daemons* (indexed in the order they
first appear in the member list; rank 0's daemon is 0): the ranks one daemon
serves are combined there first, and only then does the daemon take part,
so every edge carries one message per barrier (RHiNET's tree followed the
process ids, not the topology; ``wire/barrier.py`` has the messages).

* ``TREE``: a k-ary tree, parent of ``i`` is ``(i - 1) // k``.  A daemon
  whose ranks have all arrived and whose children have all sent ARRIVE sends
  ARRIVE to its parent; the root's completion starts RELEASE down the tree.
* ``CENTRAL``: the tree of arity ``m - 1``: every daemon reports to the root,
  which releases everyone.
* ``DISSEMINATION``: ⌈log2 m⌉ rounds, no release: in round ``r`` daemon ``i``
  sends to ``i + 2**r`` and waits for ``i - 2**r`` (mod ``m``).

Each barrier is a *generation* (1, 2, …; a rank's k-th call is generation
k).  A daemon's ranks are all in the same generation or the next, so the
messages it may receive are for the next two generations (a faster daemon
can have finished the next one's dissemination rounds while we finish
ours); anything else is counted and dropped.  :attr:`BarrierEngine.released`
lists the generations released here, :attr:`BarrierEngine.out` the messages
for other daemons.  A disagreement (a member calling another algorithm or
arity) fails the group's barriers: ``failure`` says why.
"""

from __future__ import annotations

import collections

from ..wire.barrier import MAX_ARITY, Algorithm, BarrierMessage, BarrierType


class BarrierUsageError(Exception):
    """A rank called a barrier the group cannot run (bad algorithm or arity, a broken group)."""


class _Generation:
    __slots__ = ("algorithm", "arity", "arrived", "children", "rounds", "round", "sent_up")

    def __init__(self, algorithm: int, arity: int) -> None:
        self.algorithm = algorithm
        self.arity = arity
        self.arrived = 0  # ranks of this daemon
        self.children: set[int] = set()  # tree: children daemons heard from
        self.rounds: set[int] = set()  # dissemination: rounds heard from
        self.round = -1  # dissemination: the round we sent last
        self.sent_up = False


def rounds_for(daemons: int) -> int:
    """⌈log2 daemons⌉: the rounds of a dissemination barrier."""
    return (daemons - 1).bit_length()


class BarrierEngine:
    """The barriers of one group at one daemon.

    Args:
        group: the group id.
        daemons: how many distinct daemons serve the group.
        me: this daemon's index.
        local: how many of the group's ranks this daemon serves.
    """

    def __init__(self, group: int, daemons: int, me: int, local: int) -> None:
        self.group = group
        self.m = daemons
        self.me = me
        self.local = local
        self.done = 0  #: the last generation released here
        self.gens: dict[int, _Generation] = {}
        self.out: list[tuple[int, BarrierMessage]] = []
        self.released: list[int] = []
        self.failure = ""
        self.stats: collections.Counter[str] = collections.Counter()

    @staticmethod
    def check(algorithm: int, arity: int) -> None:
        """Raises BarrierUsageError for an algorithm or arity the wire cannot carry."""
        if algorithm not in tuple(Algorithm):
            raise BarrierUsageError(f"unknown barrier algorithm {algorithm}")
        if algorithm == Algorithm.TREE and not 2 <= arity <= MAX_ARITY:
            raise BarrierUsageError(f"a tree barrier's arity is 2..{MAX_ARITY}, not {arity}")

    def _wire_arity(self, algorithm: int, arity: int) -> int:
        return arity if algorithm == Algorithm.TREE else 0

    # -- what the ranks do ------------------------------------------------------------------
    def arrive(self, generation: int, algorithm: int, arity: int) -> None:
        """One of our ranks enters barrier ``generation``.

        Raises:
            BarrierUsageError: a bad algorithm/arity, a generation that is not
                the next one, or the group's barriers have failed.
        """
        self.check(algorithm, arity)
        if self.failure:
            raise BarrierUsageError(self.failure)
        if generation != self.done + 1:
            raise BarrierUsageError(f"barrier generation {generation} while {self.done + 1} is due")
        g = self._gen(generation, algorithm, self._wire_arity(algorithm, arity))
        if g is None:
            raise BarrierUsageError(self.failure)
        g.arrived += 1
        if g.arrived > self.local:
            raise BarrierUsageError(f"more arrivals at barrier {generation} than ranks on this daemon")
        self._progress(generation, g)

    def fail(self, why: str) -> None:
        """Fail every pending and later barrier (a member died or left)."""
        if not self.failure:
            self.failure = why
        self.gens.clear()

    # -- from the network ----------------------------------------------------------------------
    def on_message(self, sender: int, m: BarrierMessage) -> None:
        """A barrier message from daemon ``sender``.  Never raises."""
        if m.group != self.group or m.sender != sender or not sender < self.m or self.failure:
            self.stats["barrier_bad_message"] += 1
            return
        if not self.done < m.generation <= self.done + 2:
            self.stats["barrier_stale"] += 1
            return
        if m.btype == BarrierType.ABORT:
            self.fail(f"members disagree on barrier {m.generation} (daemon {sender} saw it)")
            return
        g = self._gen(m.generation, m.algorithm, m.arity)
        if g is None:
            return
        if m.btype == BarrierType.RELEASE:
            if m.algorithm == Algorithm.DISSEMINATION or sender != self._parent(g) or m.generation != self.done + 1:
                self.stats["barrier_bad_message"] += 1
                return
            self._release(m.generation, g)
            return
        if m.algorithm == Algorithm.DISSEMINATION:
            if sender != (self.me - (1 << m.round)) % self.m or m.round >= rounds_for(self.m):
                self.stats["barrier_bad_message"] += 1
                return
            g.rounds.add(m.round)
        else:
            if self._parent_of(sender, g) != self.me:
                self.stats["barrier_bad_message"] += 1
                return
            g.children.add(sender)
        self._progress(m.generation, g)

    # -- the engine -----------------------------------------------------------------------------
    def _gen(self, generation: int, algorithm: int, arity: int) -> _Generation | None:
        g = self.gens.get(generation)
        if g is None:
            g = self.gens[generation] = _Generation(algorithm, arity)
        elif (g.algorithm, g.arity) != (algorithm, arity):
            names = {a.value: a.name.lower() for a in Algorithm}
            for d in range(self.m):  # so that every member fails, not only the ones that saw it
                if d != self.me:
                    self.out.append((d, BarrierMessage(BarrierType.ABORT, g.algorithm, g.arity, 0, self.group,
                                                       generation, self.me)))
            self.fail(f"members disagree on barrier {generation}: {names.get(g.algorithm)}"
                      f"/{g.arity} against {names.get(algorithm)}/{arity}")
            return None
        return g

    def _k(self, g: _Generation) -> int:
        return g.arity if g.algorithm == Algorithm.TREE else max(1, self.m - 1)

    def _parent_of(self, i: int, g: _Generation) -> int:
        return (i - 1) // self._k(g) if i else -1

    def _parent(self, g: _Generation) -> int:
        return self._parent_of(self.me, g)

    def _children(self, g: _Generation) -> range:
        k = self._k(g)
        return range(min(self.m, k * self.me + 1), min(self.m, k * self.me + k + 1))

    def _progress(self, generation: int, g: _Generation) -> None:
        if g.arrived < self.local or generation != self.done + 1:
            return  # the next generation's messages wait for ours to finish
        if g.algorithm == Algorithm.DISSEMINATION:
            total = rounds_for(self.m)
            while True:
                if g.round < total - 1 and (g.round < 0 or g.round in g.rounds):
                    g.round += 1
                    self._send((self.me + (1 << g.round)) % self.m, BarrierType.ARRIVE, generation, g)
                    continue
                break
            if g.round == total - 1 and (total == 0 or g.round in g.rounds):
                self._release(generation, g)
            return
        if g.sent_up or len(g.children) < len(self._children(g)):
            return
        g.sent_up = True
        if self.me == 0:
            self._release(generation, g)
        else:
            self._send(self._parent(g), BarrierType.ARRIVE, generation, g)

    def _release(self, generation: int, g: _Generation) -> None:
        if g.algorithm != Algorithm.DISSEMINATION:
            for child in self._children(g):
                self._send(child, BarrierType.RELEASE, generation, g)
        del self.gens[generation]
        self.done = generation
        self.released.append(generation)
        nxt = self.gens.get(generation + 1)
        if nxt is not None:
            self._progress(generation + 1, nxt)

    def _send(self, daemon: int, btype: BarrierType, generation: int, g: _Generation) -> None:
        rnd = g.round if g.algorithm == Algorithm.DISSEMINATION and btype == BarrierType.ARRIVE else 0
        self.out.append((daemon, BarrierMessage(btype, g.algorithm, g.arity, rnd, self.group, generation, self.me)))
