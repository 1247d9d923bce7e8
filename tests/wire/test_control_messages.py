"""Connection management, QP flow control, lock, barrier and group messages."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import construct as c
import pytest
from hypothesis import given
from hypothesis import strategies as st

from udpverbs.wire import barrier, cm, flow, group, lock
from udpverbs.wire.barrier import Algorithm, BarrierMessage, BarrierType
from udpverbs.wire.cm import Accept, ConnectRequest, Disconnect, Reject, RejectReason
from udpverbs.wire.errors import WireError
from udpverbs.wire.flow import FlowMessage, FlowType
from udpverbs.wire.group import GroupMessage, GroupType, LeaveStatus
from udpverbs.wire.lock import LockMessage, LockStatus, LockType

from .strategies import SETTINGS, reference_parser, assert_flips_detected, mutated, outcome, u16, u32

# (message, hand-written hex)
KNOWN: list[tuple[Any, str]] = [
    # CONNECT_REQUEST: type 1 | rsvd 0 | pd len 2 | req id 7 |
    #   port 80 | IRD 4 | ORD 2 | rsvd 0 | QPN 0x123 | max msg 1 MiB | "hi"
    (ConnectRequest(7, 80, 0x123, 4, 2, 1 << 20, b"hi"),
     "01000002" "00000007" "0050" "0004" "0002" "0000" "00000123" "00100000" "6869"),
    # ACCEPT: type 2 | 0 | pd 0 | req 7 | QPN 0x456 | IRD 2 | ORD 4 | max msg 4096
    (Accept(7, 0x456, 2, 4, 4096), "02000000" "00000007" "00000456" "0002" "0004" "00001000"),
    # REJECT: type 3 | 0 | pd 1 | req 7 | reason NO_LISTENER(1) | rsvd | "x"
    (Reject(7, RejectReason.NO_LISTENER, b"x"), "03000001" "00000007" "0001" "0000" "78"),
    # DISCONNECT: type 4 | 0 | pd 0 | req 9 | QPN 0x123
    (Disconnect(9, 0x123), "04000000" "00000009" "00000123"),
    # flow RNR_NACK: type 2 | 0 | 0 | MSN 5 | back-off 100 us
    (FlowMessage(FlowType.RNR_NACK, 5, 100), "02000000" "00000005" "00000064"),
    (FlowMessage(FlowType.RESUME, 5), "03000000" "00000005" "00000000"),
    (FlowMessage(FlowType.ACK, 6), "01000000" "00000006" "00000000"),
    # lock: type | status | rsvd | group | lock id | proc | seq | succ proc | succ seq
    (LockMessage(LockType.LOCK_REQ, 9, 1, 2, 3), "01000000" "00000009" "00000001" "00000002" "00000003" "00000000" "00000000"),
    (LockMessage(LockType.LOCK_FORW, 9, 1, 2, 3, 4, 5),
     "02000000" "00000009" "00000001" "00000002" "00000003" "00000004" "00000005"),
    (LockMessage(LockType.LOCK_REPLY, 9, 1, 4, 5), "03000000" "00000009" "00000001" "00000004" "00000005" "00000000" "00000000"),
    (LockMessage(LockType.LOCK_REPLY, 9, 1, 4, 5, status=LockStatus.REFUSED),
     "03020000" "00000009" "00000001" "00000004" "00000005" "00000000" "00000000"),
    (LockMessage(LockType.LOCK_REPLY, 9, 1, 4, 5, 2, status=LockStatus.OWNER_DIED),
     "03030000" "00000009" "00000001" "00000004" "00000005" "00000002" "00000000"),
    (LockMessage(LockType.UNLOCK, 9, 1, 2, 3), "04000000" "00000009" "00000001" "00000002" "00000003" "00000000" "00000000"),
    (LockMessage(LockType.TRYLOCK_REQ, 9, 1, 2, 6), "05000000" "00000009" "00000001" "00000002" "00000006" "00000000" "00000000"),
    (LockMessage(LockType.TRYLOCK_REPLY, 9, 1, 2, 6, status=LockStatus.BUSY),
     "06010000" "00000009" "00000001" "00000002" "00000006" "00000000" "00000000"),
    # barrier: type | algorithm | arity | round | group | generation | sender
    (BarrierMessage(BarrierType.ARRIVE, Algorithm.TREE, 2, 0, 9, 10, 3), "01010200" "00000009" "0000000a" "00000003"),
    (BarrierMessage(BarrierType.RELEASE, Algorithm.TREE, 4, 0, 9, 10, 0), "02010400" "00000009" "0000000a" "00000000"),
    (BarrierMessage(BarrierType.ARRIVE, Algorithm.DISSEMINATION, 0, 2, 9, 10, 1), "01020002" "00000009" "0000000a" "00000001"),
    (BarrierMessage(BarrierType.RELEASE, Algorithm.CENTRAL, 0, 0, 9, 1, 0), "02030000" "00000009" "00000001" "00000000"),
    (BarrierMessage(BarrierType.ABORT, Algorithm.TREE, 3, 0, 9, 1, 2), "03010300" "00000009" "00000001" "00000002"),
    # group: type | status | rsvd | group | rank | generation
    (GroupMessage(GroupType.JOIN, 9, 3), "01000000" "00000009" "00000003" "00000000"),
    (GroupMessage(GroupType.LEAVE, 9, 3, 7, LeaveStatus.DIED), "02010000" "00000009" "00000003" "00000007"),
    (GroupMessage(GroupType.PING, 9), "03000000" "00000009" "00000000" "00000000"),
    (GroupMessage(GroupType.PONG, 9), "04000000" "00000009" "00000000" "00000000"),
]

CODEC: dict[type, tuple[Callable[[Any], bytes], Callable[[bytes], Any], c.Construct]] = {
    ConnectRequest: (cm.encode, cm.decode_untrusted, cm.CM_MESSAGE),
    Accept: (cm.encode, cm.decode_untrusted, cm.CM_MESSAGE),
    Reject: (cm.encode, cm.decode_untrusted, cm.CM_MESSAGE),
    Disconnect: (cm.encode, cm.decode_untrusted, cm.CM_MESSAGE),
    FlowMessage: (flow.encode, flow.decode_untrusted, flow.FLOW_MESSAGE),
    LockMessage: (lock.encode, lock.decode_untrusted, lock.LOCK_MESSAGE),
    BarrierMessage: (barrier.encode, barrier.decode_untrusted, barrier.BARRIER_MESSAGE),
    GroupMessage: (group.encode, group.decode_untrusted, group.GROUP_MESSAGE),
}


@pytest.mark.parametrize(("msg", "hexstr"), KNOWN, ids=[f"{type(m).__name__}-{i}" for i, (m, _) in enumerate(KNOWN)])
def test_known_answer(msg: Any, hexstr: str) -> None:
    enc, dec, ref = CODEC[type(msg)]
    wire = bytes.fromhex(hexstr)
    assert enc(msg) == wire
    assert dec(wire) == msg
    ref.parse(wire)


@pytest.mark.parametrize(("msg", "hexstr"), KNOWN, ids=[f"{type(m).__name__}-{i}" for i, (m, _) in enumerate(KNOWN)])
def test_every_single_bit_flip_is_caught(msg: Any, hexstr: str) -> None:
    assert_flips_detected(bytes.fromhex(hexstr), CODEC[type(msg)][1], lambda v: (type(v), *v))


@pytest.mark.parametrize(("msg", "hexstr"), KNOWN, ids=[f"{type(m).__name__}-{i}" for i, (m, _) in enumerate(KNOWN)])
def test_truncated_at_every_length(msg: Any, hexstr: str) -> None:
    wire = bytes.fromhex(hexstr)
    for n in range(len(wire)):
        with pytest.raises(WireError):
            CODEC[type(msg)][1](wire[:n])
    with pytest.raises(WireError):
        CODEC[type(msg)][1](wire + b"\x00")


private_data = st.binary(max_size=cm.MAX_PRIVATE_DATA)
cm_messages = st.one_of(
    st.builds(lambda *f: ConnectRequest(*f), u32, u16, u32, u16, u16, u32, private_data),
    st.builds(lambda *f: Accept(*f), u32, u32, u16, u16, u32, private_data),
    st.builds(lambda *f: Reject(*f), u32, st.sampled_from(sorted(RejectReason)), private_data),
    st.builds(Disconnect, u32, u32),
)
flow_messages = st.one_of(
    st.builds(FlowMessage, st.just(FlowType.RNR_NACK), u32, u32),
    st.builds(lambda t, msn: FlowMessage(t, msn), st.sampled_from([FlowType.ACK, FlowType.RESUME]), u32),
)
lock_messages = st.one_of(
    st.builds(
        lambda t, *f: LockMessage(t, *f),
        st.sampled_from([LockType.LOCK_REQ, LockType.UNLOCK, LockType.TRYLOCK_REQ]), u32, u32, u32, u32,
    ),
    st.builds(lambda *f: LockMessage(LockType.LOCK_FORW, *f), u32, u32, u32, u32, u32, u32),
    st.builds(lambda *f: LockMessage(LockType.LOCK_REPLY, *f[:4], status=f[4]), u32, u32, u32, u32,
              st.sampled_from([LockStatus.GRANTED, LockStatus.REFUSED])),
    st.builds(lambda *f: LockMessage(LockType.LOCK_REPLY, *f, status=LockStatus.OWNER_DIED), u32, u32, u32, u32, u32),
    st.builds(lambda *f: LockMessage(LockType.TRYLOCK_REPLY, *f[:4], status=f[4]), u32, u32, u32, u32,
              st.sampled_from([LockStatus.GRANTED, LockStatus.BUSY, LockStatus.REFUSED])),
)
barrier_messages = st.one_of(
    st.builds(lambda t, *f: BarrierMessage(t, Algorithm.TREE, f[0], 0, *f[1:]), st.sampled_from(sorted(BarrierType)),
              st.integers(2, 255), u32, u32, u32),
    st.builds(lambda *f: BarrierMessage(BarrierType.ARRIVE, Algorithm.DISSEMINATION, 0, *f), st.integers(0, 31), u32, u32, u32),
    st.builds(lambda t, *f: BarrierMessage(t, Algorithm.CENTRAL, 0, 0, *f), st.sampled_from(sorted(BarrierType)), u32, u32, u32),
    st.builds(lambda *f: BarrierMessage(BarrierType.ABORT, Algorithm.DISSEMINATION, 0, 0, *f), u32, u32, u32),
)
group_messages = st.one_of(
    st.builds(lambda t, *f: GroupMessage(t, *f), st.sampled_from([GroupType.JOIN, GroupType.PING, GroupType.PONG]), u32, u32, u32),
    st.builds(lambda *f: GroupMessage(GroupType.LEAVE, *f), u32, u32, u32, st.sampled_from(sorted(LeaveStatus))),
)

def _ref_cm(m: Any) -> bytes:
    fixed = {k: v for k, v in m._asdict().items() if k not in ("request_id", "private_data")}
    if isinstance(m, ConnectRequest):
        ctype = cm.CmType.CONNECT_REQUEST
    elif isinstance(m, Accept):
        ctype = cm.CmType.ACCEPT
    elif isinstance(m, Reject):
        ctype = cm.CmType.REJECT
    else:
        ctype = cm.CmType.DISCONNECT
    pd = getattr(m, "private_data", b"")
    return cm.CM_MESSAGE.build(dict(type=ctype, pd_len=len(pd), request_id=m.request_id, fixed=fixed, private_data=pd))


def _ref_fields(ref: c.Construct, names: dict[str, str]) -> Callable[[Any], bytes]:
    def build(m: Any) -> bytes:
        d = m._asdict()
        return ref.build({names.get(k, k): v for k, v in d.items()})

    return build


FAMILIES = [
    (cm_messages, cm.encode, cm.decode_untrusted, cm.CM_MESSAGE, _ref_cm),
    (flow_messages, flow.encode, flow.decode_untrusted, flow.FLOW_MESSAGE, _ref_fields(flow.FLOW_MESSAGE, {"ftype": "type"})),
    (lock_messages, lock.encode, lock.decode_untrusted, lock.LOCK_MESSAGE, _ref_fields(lock.LOCK_MESSAGE, {"ltype": "type"})),
    (barrier_messages, barrier.encode, barrier.decode_untrusted, barrier.BARRIER_MESSAGE,
     _ref_fields(barrier.BARRIER_MESSAGE, {"btype": "type"})),
    (group_messages, group.encode, group.decode_untrusted, group.GROUP_MESSAGE, _ref_fields(group.GROUP_MESSAGE, {"gtype": "type"})),
]
FAMILY_IDS = ["cm", "flow", "lock", "barrier", "group"]


@pytest.mark.parametrize(("values", "enc", "dec", "ref", "ref_build"), FAMILIES, ids=FAMILY_IDS)
def test_round_trips_and_reference_agreement(values: Any, enc: Any, dec: Any, ref: c.Construct, ref_build: Any) -> None:
    @SETTINGS
    @given(values)
    def check(m: Any) -> None:
        wire = enc(m)
        assert dec(wire) == m
        assert enc(dec(wire)) == wire
        assert ref_build(m) == wire

    check()


@pytest.mark.parametrize(("values", "enc", "dec", "ref", "ref_build"), FAMILIES, ids=FAMILY_IDS)
def test_fast_decoder_rejects_what_construct_rejects(
    values: Any, enc: Any, dec: Any, ref: c.Construct, ref_build: Any
) -> None:
    ref_parse = reference_parser(ref)

    @SETTINGS
    @given(st.one_of(st.binary(max_size=40), mutated(values.map(enc))))
    def check(data: bytes) -> None:
        assert outcome(dec, data)[0] == outcome(ref_parse, data)[0]

    check()


@pytest.mark.parametrize(
    ("dec", "hexstr", "reason"),
    [
        (cm.decode_untrusted, "05000000" "00000001" "00000000", "bad_type"),
        (cm.decode_untrusted, "04010000" "00000009" "00000123", "bad_reserved"),
        (cm.decode_untrusted, "04000001" "00000009" "00000123" "00", "bad_length"),  # private data on DISCONNECT
        (cm.decode_untrusted, "03000000" "00000007" "0005" "0000", "bad_reason"),
        (cm.decode_untrusted, "03000201" "00000007" "0001" "0000" + "00" * 513, "bad_length"),  # 513 B private data
        (cm.decode_untrusted, "0100", "truncated"),
        (flow.decode_untrusted, "04000000" "00000005" "00000000", "bad_type"),
        (flow.decode_untrusted, "03000000" "00000005" "00000001", "bad_reserved"),  # back-off on RESUME
        (flow.decode_untrusted, "02000100" "00000005" "00000001", "bad_reserved"),
        (lock.decode_untrusted, "07000000" + "00000001" * 6, "bad_type"),
        (lock.decode_untrusted, "01010000" + "00000001" * 4 + "00000000" * 2, "bad_status"),
        (lock.decode_untrusted, "03010000" + "00000001" * 4 + "00000000" * 2, "bad_status"),  # BUSY on a grant
        (lock.decode_untrusted, "06030000" + "00000001" * 4 + "00000000" * 2, "bad_status"),
        (lock.decode_untrusted, "03030000" + "00000001" * 6, "bad_reserved"),  # OWNER_DIED with a successor seq
        (lock.decode_untrusted, "01000001" + "00000001" * 4 + "00000000" * 2, "bad_reserved"),
        (lock.decode_untrusted, "03000000" + "00000001" * 5 + "00000000", "bad_reserved"),  # a successor on a grant
        (lock.decode_untrusted, "01000000" + "00000001" * 4, "bad_length"),
        (barrier.decode_untrusted, "04010200" "00000001" "00000002" "00000003", "bad_type"),
        (barrier.decode_untrusted, "03020001" "00000001" "00000002" "00000003", "bad_reserved"),  # a round on ABORT
        (barrier.decode_untrusted, "01040000" "00000001" "00000002" "00000003", "bad_reserved"),  # no such algorithm
        (barrier.decode_untrusted, "01010100" "00000001" "00000002" "00000003", "bad_reserved"),  # arity 1
        (barrier.decode_untrusted, "01010201" "00000001" "00000002" "00000003", "bad_reserved"),  # a round on a tree
        (barrier.decode_untrusted, "02020000" "00000001" "00000002" "00000003", "bad_reserved"),  # RELEASE in dissemination
        (barrier.decode_untrusted, "01020020" "00000001" "00000002" "00000003", "bad_reserved"),  # round 32
        (barrier.decode_untrusted, "01010200" "00000001" "00000002", "bad_length"),
        (group.decode_untrusted, "05000000" "00000001" "00000002" "00000003", "bad_type"),
        (group.decode_untrusted, "01010000" "00000001" "00000002" "00000003", "bad_status"),
        (group.decode_untrusted, "02020000" "00000001" "00000002" "00000003", "bad_status"),
        (group.decode_untrusted, "03000100" "00000001" "00000002" "00000003", "bad_reserved"),
    ],
)
def test_malformed_reason(dec: Any, hexstr: str, reason: str) -> None:
    with pytest.raises(WireError) as e:
        dec(bytes.fromhex(hexstr))
    assert e.value.reason == reason


def test_encoders_refuse_caller_mistakes() -> None:
    with pytest.raises(ValueError):
        cm.encode(Reject(1, 99))
    with pytest.raises(ValueError):
        cm.encode(Accept(1, 2, 3, 4, 5, bytes(513)))
    with pytest.raises(ValueError):
        flow.encode(FlowMessage(FlowType.ACK, 1, 5))
    with pytest.raises(ValueError):
        lock.encode(LockMessage(LockType.LOCK_REQ, 1, 2, 3, 4, status=LockStatus.BUSY))
    with pytest.raises(ValueError):
        lock.encode(LockMessage(LockType.UNLOCK, 1, 2, 3, 4, succ_proc=5))
    with pytest.raises(ValueError):
        barrier.encode(BarrierMessage(9, Algorithm.TREE, 2, 0, 1, 2, 3))
    with pytest.raises(ValueError):
        barrier.encode(BarrierMessage(BarrierType.ARRIVE, Algorithm.TREE, 1, 0, 1, 2, 3))
    with pytest.raises(ValueError):
        barrier.encode(BarrierMessage(BarrierType.ARRIVE, Algorithm.CENTRAL, 0, 0, 1 << 32, 2, 3))
    with pytest.raises(ValueError):
        group.encode(GroupMessage(GroupType.PING, 1, status=1))


@SETTINGS
@given(st.binary(max_size=40))
def test_arbitrary_bytes_raise_only_wire_error(data: bytes) -> None:
    for dec in (cm.decode_untrusted, flow.decode_untrusted, lock.decode_untrusted, barrier.decode_untrusted,
                group.decode_untrusted):
        outcome(dec, data)
