"""The lock and barrier engines over lossy, reordering links, on a fake clock.

Every pair of daemons is joined by two real ``transport.Link`` objects in
the network simulator, with loss, duplication, reordering and jitter in
both directions; the engines' messages travel on those links, encoded as
the daemons encode them.  Ranks act at random times drawn from one seed
(acquire, hold a while, release; trylock; die).  Checked at every step:

* at most one rank holds a lock (a trylock grant included);
* the manager grants a trylock only when no rank holds or waits for it;
* ranks that acquire are granted in the order their manager saw the requests;
* at the end every live rank got every lock it waited for and every
  manager's table is empty (nothing leaked, nothing is stuck).

Barriers: every algorithm, random arrival times; no rank leaves barrier g
before every rank entered it, and generations never mix.
"""

from __future__ import annotations

import collections
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from udpverbs.daemon.gbarrier import BarrierEngine
from udpverbs.daemon.qlock import HOLDING, LockEngine
from udpverbs.transport.link import Link, LinkConfig
from udpverbs.transport.netsim import Impairments, Simulator, pair
from udpverbs.wire import barrier as wbarrier
from udpverbs.wire import lock as wlock
from udpverbs.wire.barrier import Algorithm
from udpverbs.wire.lock import LockStatus

LOSSY = Impairments(loss=0.1, duplicate=0.03, reorder=0.1, jitter_s=40e-6, reorder_delay_s=80e-6)
CONFIG = LinkConfig(cc="fixed", cc_params={"window_packets": 32})
SEEDS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Net:
    """``m`` daemons, a lossy link pair between every two, messages as bytes."""

    def __init__(self, rng: random.Random, m: int, engines: list[Any], encode: Any, decode: Any) -> None:
        self.sim = Simulator(rng)
        self.engines = engines
        self.encode = encode
        self.ends: dict[tuple[int, int], Any] = {}
        #: what the world does after each delivery (collect the engines' outcomes)
        self.after: Any = self.pump
        for i in range(m):
            for j in range(i + 1, m):
                a, b = pair(self.sim, Link(CONFIG, rng=random.Random(rng.getrandbits(64)), incarnation=2 * i + 1),
                            Link(CONFIG, rng=random.Random(rng.getrandbits(64)), incarnation=2 * j + 2),
                            20e-6, impairments=LOSSY)
                a.on_delivery = self._receiver(j, i, decode)
                b.on_delivery = self._receiver(i, j, decode)
                self.ends[(i, j)], self.ends[(j, i)] = a, b
                self.sim.schedule(0.0, lambda _, a=a: a.connect())

    def _receiver(self, sender: int, me: int, decode: Any) -> Any:
        def deliver(ep: Any, msgs: list[bytes], now: float) -> None:
            for raw in msgs:
                self.engines[me].on_message(sender, decode(raw))
            self.after()
        return deliver

    def pump(self) -> None:
        """Put every engine's output on its links (as the daemon's flush does)."""
        for i, e in enumerate(self.engines):
            for d, msg in e.out:
                ep = self.ends[(i, d)]
                ep.source.append(self.encode(msg))
                ep.service()
            e.out.clear()


class RecordingLock(LockEngine):
    """A LockEngine that logs what its manager decides, for the checks."""

    def __init__(self, *a: Any, world: "LockWorld") -> None:
        super().__init__(*a)
        self.world = world

    def _manager_request(self, m: wlock.LockMessage) -> None:
        self.world.request_order[m.lock_id].append((m.proc, m.seq))
        super()._manager_request(m)

    def _manager_trylock(self, m: wlock.LockMessage) -> None:
        free = m.lock_id not in self.last
        if free:
            self.world.check_nobody_holds_or_waits(m.lock_id, (m.proc, m.lock_id))
            self.world.request_order[m.lock_id].append((m.proc, m.seq))
        super()._manager_trylock(m)


class LockWorld:
    def __init__(self, seed: int, m: int, n: int, locks: int, deaths: bool) -> None:
        self.rng = random.Random(seed)
        self.n = n
        self.locks = locks
        self.daemon_of = [r * m // n for r in range(n)]
        self.request_order: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
        self.grant_order: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
        self.engines = [RecordingLock(7, n, self.daemon_of.__getitem__, i, world=self) for i in range(m)]
        self.net = Net(self.rng, m, self.engines, wlock.encode, wlock.decode_untrusted)
        self.net.after = self.outcomes
        self.holder: dict[int, int] = {}
        self.waiting: dict[int, int] = {}  # rank -> lock it waits for
        self.dead: set[int] = set()
        self.deaths = deaths
        self.granted = 0

    def engine(self, rank: int) -> LockEngine:
        return self.engines[self.daemon_of[rank]]

    def check_nobody_holds_or_waits(self, lock: int, asking: tuple[int, int]) -> None:
        """No rank holds ``lock``, and none whose request the manager has
        seen still waits (a request still on its way queues behind the trylock)."""
        seen = set(self.request_order[lock])
        for e in self.engines:
            for key, a in e.acq.items():
                if key[1] != lock or key == asking:
                    continue
                assert a.state not in HOLDING, f"trylock of lock {lock} granted while rank {key[0]} holds it"
                assert (key[0], a.seq) not in seen, f"trylock of lock {lock} granted while rank {key[0]} waits"

    def outcomes(self) -> None:
        for e in self.engines:
            while e.events:
                ev = e.events.pop(0)
                r, lk = ev.rank, ev.lock_id
                assert self.waiting.get(r) == lk, f"an outcome for rank {r} that waits for nothing"
                del self.waiting[r]
                if ev.status == LockStatus.BUSY:
                    continue
                assert ev.status in (LockStatus.GRANTED, LockStatus.OWNER_DIED)
                assert lk not in self.holder, f"lock {lk} granted to {r} while {self.holder[lk]} holds it"
                self.holder[lk] = r
                self.grant_order[lk].append((r, e.acq[(r, lk)].seq))
                self.granted += 1
                self.sim_after(self.rng.uniform(0, 300e-6), self.release, (r, lk))
        self.net.pump()

    def sim_after(self, dt: float, fn: Any, arg: Any) -> None:
        self.net.sim.schedule(self.net.sim.now + dt, lambda a: (fn(*a), self.outcomes()), arg)

    def release(self, r: int, lk: int) -> None:
        if r in self.dead or self.holder.get(lk) != r:
            return
        del self.holder[lk]
        self.engine(r).release(r, lk)

    def act(self, r: int, _: Any = None) -> None:
        if r in self.dead or r in self.waiting or r in self.holder.values():
            return
        lk = self.rng.randrange(self.locks)
        e = self.engine(r)
        self.waiting[r] = lk
        if self.rng.random() < 0.25:
            e.trylock(r, lk)
        else:
            e.acquire(r, lk)

    def die(self, r: int, _: Any = None) -> None:
        self.dead.add(r)
        for lk, h in list(self.holder.items()):
            if h == r:
                del self.holder[lk]
        self.waiting.pop(r, None)
        self.engine(r).rank_gone(r)

    def run(self, actions: int) -> None:
        t = 1e-3
        for _ in range(actions):
            t += self.rng.expovariate(1 / 60e-6)
            self.sim_after(t, self.act, (self.rng.randrange(self.n),))
        if self.deaths:
            for r in self.rng.sample(range(self.n), 2):
                self.sim_after(self.rng.uniform(1e-3, t), self.die, (r,))
        self.net.sim.run(60.0, max_events=3_000_000)


@SEEDS
@given(seed=st.integers(0, 2**32 - 1), deaths=st.booleans())
def test_locks_exclude_grant_in_request_order_and_never_leak(seed: int, deaths: bool) -> None:
    w = LockWorld(seed, m=3, n=7, locks=3, deaths=deaths)
    w.run(actions=300)
    assert not w.waiting, f"ranks still waiting at the end: {w.waiting}"
    assert not w.holder
    for e in w.engines:
        assert not e.last, f"daemon {e.me}'s manager table is not empty: {e.last}"
        assert not any(a.state in HOLDING for a in e.acq.values())
    assert w.granted > 5  # the schedule exercised the lock
    if not deaths:
        for lk, grants in w.grant_order.items():
            assert grants == w.request_order[lk], f"lock {lk}: grants out of request order"
    else:  # with deaths, every live grant still comes in request order
        for lk, grants in w.grant_order.items():
            order = {acq: i for i, acq in enumerate(w.request_order[lk])}
            positions = [order[g] for g in grants]
            assert positions == sorted(positions), f"lock {lk}: grants out of request order"


def test_the_lock_test_catches_a_manager_that_forgets() -> None:
    """The checks above fail on a broken engine: a manager that grants every
    request at once (never forwards) breaks exclusion."""

    class Broken(RecordingLock):
        def _manager_request(self, m: wlock.LockMessage) -> None:
            self.last.pop(m.lock_id, None)
            super()._manager_request(m)

    w = LockWorld(1, m=3, n=7, locks=2, deaths=False)
    w.engines[:] = [Broken(7, w.n, w.daemon_of.__getitem__, i, world=w) for i in range(3)]
    with pytest.raises(AssertionError, match="while|order|waiting|table"):
        w.run(actions=150)
        assert not w.waiting and all(not e.last for e in w.engines)
        for lk, grants in w.grant_order.items():
            assert grants == w.request_order[lk], "order"


class BarrierWorld:
    def __init__(self, seed: int, n: int, m: int, algorithm: int, arity: int) -> None:
        self.rng = random.Random(seed)
        self.n = n
        self.daemon_of = [r * m // n for r in range(n)]
        local = collections.Counter(self.daemon_of)
        self.engines = [BarrierEngine(5, m, i, local[i]) for i in range(m)]
        self.net = Net(self.rng, m, self.engines, wbarrier.encode, wbarrier.decode_untrusted)
        self.algorithm, self.arity = algorithm, arity
        self.entered = [0] * n  # the generation each rank entered last
        self.left = [0] * n
        self.waiting: set[int] = set()

    def enter(self, r: int) -> None:
        self.entered[r] += 1
        self.waiting.add(r)
        self.engines[self.daemon_of[r]].arrive(self.entered[r], self.algorithm, self.arity)
        self.released()

    def released(self) -> None:
        for i, e in enumerate(self.engines):
            for gen in e.released:
                assert min(self.entered) >= gen, f"daemon {i} released barrier {gen} before everyone entered"
                for r in range(self.n):
                    if self.daemon_of[r] == i and r in self.waiting:
                        assert self.entered[r] == gen, "generations mixed"
                        self.waiting.discard(r)
                        self.left[r] = gen
                        if gen < self.count:
                            t = self.net.sim.now + self.rng.expovariate(1 / 50e-6)
                            self.net.sim.schedule(t, lambda rr: self.enter(rr), r)
            e.released.clear()
        self.net.pump()

    def run(self, count: int) -> None:
        self.count = count
        for e in self.engines:
            e.on_message = self._wrap(e.on_message)
        for r in range(self.n):
            self.net.sim.schedule(1e-3 + self.rng.uniform(0, 200e-6), lambda rr: self.enter(rr), r)
        self.net.sim.run(60.0, max_events=3_000_000)

    def _wrap(self, fn: Any) -> Any:
        def on_message(sender: int, m: Any) -> None:
            fn(sender, m)
            self.released()
        return on_message


@SEEDS
@given(seed=st.integers(0, 2**32 - 1), shape=st.sampled_from([(5, 3), (8, 4), (7, 7), (6, 1), (9, 5)]),
       alg=st.sampled_from([(Algorithm.TREE, 2), (Algorithm.TREE, 3), (Algorithm.DISSEMINATION, 0),
                            (Algorithm.CENTRAL, 0)]))
def test_barriers_release_nobody_early_over_lossy_links(seed: int, shape: tuple[int, int], alg: tuple[int, int]) -> None:
    n, m = shape
    w = BarrierWorld(seed, n, m, *alg)
    w.run(count=12)
    assert w.left == [12] * n, f"ranks stopped at {w.left}"
    assert all(not e.gens for e in w.engines)
