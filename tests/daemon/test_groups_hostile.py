"""The group service fed hostile and mistaken input: never an exception, never a wrong grant.

A real ``Device`` and ``GroupService`` with one local rank joined to a group
of three (the other two ranks on two peer daemons that are only addresses).
Then random and mutated LOCK, BARRIER and GROUP messages arrive through
``Receiver.dispatch`` from a member's link and from a stranger's, exactly
where the data loop hands them in, and requests arrive on the rank's
connection as the data loop reads them.
"""

from __future__ import annotations

import random
import socket

import trio

from udpverbs.daemon.control import Session
from udpverbs.daemon.device import Device, DeviceConfig
from udpverbs.daemon.groups import MAX_PENDING_GROUPS, GroupService
from udpverbs.wire import barrier, ctl, envelope, group, lock
from udpverbs.wire.barrier import Algorithm, BarrierMessage, BarrierType
from udpverbs.wire.ctl import Op
from udpverbs.wire.envelope import Kind
from udpverbs.wire.group import GroupMessage, GroupType
from udpverbs.wire.lock import LockMessage, LockType

ME = ("127.0.0.1", 7000)
PEERS = [("127.0.0.9", 9000), ("127.0.0.10", 9001)]
MEMBERS = [ME, *PEERS]


class Rank:
    """The local rank: a session whose replies are read from a socketpair."""

    def __init__(self, dev: Device) -> None:
        self.mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.mine.setblocking(False)
        self.sess = Session(dev, trio.socket.from_stdlib_socket(theirs), pid=1)
        dev.sessions.add(self.sess)
        self.dev = dev

    def ask(self, op: Op, **fields: object) -> bytes | None:
        _, req = ctl.decode_request_untrusted(ctl.encode_request(op, **fields))
        try:
            return self.dev.groups.handle(self.sess, op, req)
        except Exception as e:  # TableError: what the data loop would send back
            return ctl.encode_error(op, getattr(e, "errno", 0), str(e))

    def replies(self) -> list[bytes]:
        out = []
        while True:
            try:
                out.append(self.mine.recv(65536))
            except BlockingIOError:
                return out


def make() -> tuple[Device, Rank, int]:
    dev = Device(DeviceConfig(name="uvh", addr=ME[0], port=ME[1], native=False))
    dev.clock = lambda: 100.0
    GroupService(dev)
    rank = Rank(dev)
    assert rank.ask(Op.GROUP_JOIN, version=ctl.CTL_VERSION, rank=0, size=3, timeout_ms=2000,
                    join_timeout_ms=30000, data=ctl.encode_members("hostile", MEMBERS)) is None
    gid = group.group_id("hostile", MEMBERS)
    for i, addr in enumerate(PEERS):
        dev.receiver.dispatch(dev.get_link(addr), envelope.encode(Kind.GROUP, 0, 0, group.encode(
            GroupMessage(GroupType.JOIN, gid, i + 1))))
    got = rank.replies()
    assert len(got) == 1 and ctl.decode_reply(got[0], Op.GROUP_JOIN)[0] == 0
    return dev, rank, gid


def messages(rng: random.Random, gid: int, impostor: int) -> bytes:
    """A random message of the group's (mostly) or another group's.  Lock
    requests and unlocks name ranks the sending daemon does not serve
    (``impostor`` is the one it serves): a member's daemon speaking for its
    own ranks is protocol, not an attack, and a LEAVE is news."""
    u32 = lambda: rng.choice([0, 1, 2, 3, 0xFFFFFFFF, rng.getrandbits(32)])  # noqa: E731
    gid_ = lambda: gid if rng.random() < 0.8 else u32()  # noqa: E731
    kind = rng.choice([Kind.LOCK, Kind.BARRIER, Kind.GROUP])
    if kind == Kind.LOCK:
        t = rng.choice(list(LockType))
        proc = u32()
        if t in (LockType.LOCK_REQ, LockType.UNLOCK, LockType.TRYLOCK_REQ) and proc == impostor:
            proc = 0
        body = lock.encode(LockMessage(t, gid_(), rng.choice([0, 1, u32()]), proc, u32(),
                                       *((u32(), u32()) if t == LockType.LOCK_FORW else ()),
                                       status=rng.choice([0, 1]) if t == LockType.TRYLOCK_REPLY else 0))
    elif kind == Kind.BARRIER:
        alg = rng.choice(list(Algorithm))
        t = BarrierType.ARRIVE if alg == Algorithm.DISSEMINATION else rng.choice(list(BarrierType))
        body = barrier.encode(BarrierMessage(t, alg, rng.randint(2, 5) if alg == Algorithm.TREE else 0,
                                             rng.randint(0, 3) if alg == Algorithm.DISSEMINATION and t == 1 else 0,
                                             gid_(), u32(), u32()))
    else:
        t = rng.choice([GroupType.JOIN, GroupType.PING, GroupType.PONG])
        body = group.encode(GroupMessage(t, gid_(), u32(), u32()))
    raw = bytearray(body)
    if rng.random() < 0.3:  # and some bytes flipped
        for _ in range(rng.randint(1, 3)):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
    return envelope.encode(kind, 0, 0, bytes(raw))


def test_hostile_group_messages_never_raise_and_never_grant_a_held_lock() -> None:
    dev, rank, gid = make()
    g = dev.groups.groups[gid]
    assert rank.ask(Op.LOCK_ACQUIRE, lock_id=0, timeout_ms=0) is None  # lock 0 is managed here: granted
    assert ctl.decode_reply(rank.replies()[0], Op.LOCK_ACQUIRE)[0] == 0
    sent: list[LockMessage] = []
    send = dev.groups._send_to_daemon

    def record(g_: object, d: int, kind: int, body: bytes) -> None:
        if kind == Kind.LOCK:
            sent.append(lock.decode_untrusted(body))
        send(g_, d, kind, body)

    dev.groups._send_to_daemon = record  # type: ignore[method-assign]
    rng = random.Random(5)
    stranger = dev.get_link(("127.0.0.77", 7777))
    for i in range(20000):
        who = rng.randrange(len(PEERS))
        pl = stranger if i % 5 == 0 else dev.get_link(PEERS[who])
        dev.receiver.dispatch(pl, messages(rng, gid, -1 if pl is stranger else who + 1))
    assert dev.stats["rx_exception"] == 0
    assert not g.locks_broken  # (a member's daemon naming another barrier algorithm does break the barriers)
    # Whatever arrived, rank 0 still holds lock 0, and this daemon (its
    # manager) granted it to nobody else meanwhile.
    assert g.lock.holds(0, 0)
    assert not [m for m in sent if m.ltype in (LockType.LOCK_REPLY, LockType.TRYLOCK_REPLY) and m.lock_id == 0
                and m.status == 0]
    assert g.lock.stats["lock_bad_message"] > 1000  # requests for ranks their sender does not serve
    assert dev.stats["group_bad_length"] + dev.stats["group_bad_type"] + dev.stats["group_bad_reserved"] \
        + dev.stats["group_bad_status"] > 0
    assert dev.stats["group_not_member"] + dev.stats["group_unknown"] > 0


def test_joins_of_unknown_groups_cost_bounded_state() -> None:
    dev, _, _ = make()
    pl = dev.get_link(PEERS[0])
    for gid in range(10 * MAX_PENDING_GROUPS):
        dev.receiver.dispatch(pl, envelope.encode(Kind.GROUP, 0, 0, group.encode(GroupMessage(GroupType.JOIN, gid, 1))))
    assert len(dev.groups.pending) == MAX_PENDING_GROUPS
    assert dev.stats["group_pending_evicted"] == 9 * MAX_PENDING_GROUPS


def test_a_rank_that_asks_out_of_turn_gets_an_error() -> None:
    dev, rank, _ = make()
    assert rank.ask(Op.LOCK_ACQUIRE, lock_id=1, timeout_ms=0) is None  # managed by rank 1's daemon: waits
    err = rank.ask(Op.BARRIER, algorithm=1, arity=2)
    assert err is not None and ctl.decode_reply(err, Op.BARRIER)[0] == 16  # EBUSY
    assert rank.ask(Op.LOCK_RELEASE, lock_id=5) is None  # never answered: a release not held is counted
    assert dev.stats["group_release_refused"] == 1
    assert dev.groups._request(rank.sess, ctl.encode_request(Op.ALLOC_PD)) is not None  # not a group request
    assert dev.groups._request(rank.sess, b"\x00\x28garbage") is not None


def test_a_rank_told_of_a_death_by_the_lock_it_waited_for_may_wait_again() -> None:
    """The news of rank 2's death reaches rank 0 twice: first with the lock
    rank 2 died holding (OWNER_DIED, which fails rank 0's wait), then as
    rank 2's LEAVE.  Rank 0, told once, asks again: the LEAVE must not fail
    that second wait."""
    dev, rank, gid = make()
    assert rank.ask(Op.LOCK_ACQUIRE, lock_id=1, timeout_ms=0) is None  # managed by rank 1's daemon
    rank2 = dev.get_link(PEERS[1])
    dev.receiver.dispatch(rank2, envelope.encode(Kind.LOCK, 0, 0, lock.encode(
        LockMessage(LockType.LOCK_REPLY, gid, 1, 0, 1, 2, status=lock.LockStatus.OWNER_DIED))))
    (err,) = rank.replies()
    status, (text, private) = ctl.decode_reply(err, Op.LOCK_ACQUIRE)
    assert status == 103 and "rank 2 died holding lock 1" in text and private == (2).to_bytes(4, "big")
    assert rank.ask(Op.LOCK_ACQUIRE, lock_id=1, timeout_ms=0) is None  # again
    dev.receiver.dispatch(rank2, envelope.encode(Kind.GROUP, 0, 0, group.encode(
        GroupMessage(GroupType.LEAVE, gid, 2, 0, 1))))
    assert rank.replies() == []  # still waiting for the lock, not failed a second time
