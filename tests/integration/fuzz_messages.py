"""Hypothesis strategies for fuzzing a real daemon from outside: link datagrams,
messages inside valid link framing, and control-socket requests.

Payloads are drawn as a length and a seed, not as hypothesis bytes: a
1,400-byte Write costs nothing to draw and shrinks to a short one.
Addresses a fuzzed request may make the daemon send to are loopback
addresses nobody serves (``NOWHERE``), the fake peer's or the other test
daemon's: never a routable address.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass

from hypothesis import strategies as st

from udpverbs.wire import barrier, cm, ctl, envelope, flow, group, lock, rdmap, shm
from udpverbs.wire import link as wl
from udpverbs.wire.crc import crc32c
from udpverbs.wire.rdmap import Opcode

from tests.wire.strategies import mutated, terminates, u8, u16, u24, u32, u64

#: a loopback network no test serves: where fuzzed addresses point
NOWHERE = "127.66.0."


@dataclass(frozen=True)
class Targets:
    """What a fuzzer acting as the peer knows of the daemon it talks to."""

    qpn: int  #: the daemon's QP connected to the fake peer
    peer_qpn: int  #: the QPN the fake peer's end claims
    other_qpns: tuple[int, ...]  #: the daemon's QPs connected elsewhere
    regions: tuple[tuple[int, int, int], ...]  #: (STag, address, length) of every region registered
    max_body: int  #: the largest link message


def filled(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n) if seed % 3 else bytes([seed & 0xFF]) * n


@st.composite
def payloads(draw: st.DrawFn, max_size: int) -> bytes:
    n = draw(st.one_of(st.integers(0, 16), st.integers(0, max(0, max_size))))
    return filled(n, draw(st.integers(0, 1 << 16)))


# --- link datagrams (what reaches the link layer) ------------------------------

@st.composite
def link_bodies(draw: st.DrawFn, ptype: int) -> bytes:
    if ptype in (wl.PacketType.INIT, wl.PacketType.INIT_ACK) and draw(st.booleans()):
        cookie = draw(st.sampled_from([b"", None, b"short"]))
        if cookie is None:
            cookie = draw(st.binary(min_size=wl.COOKIE_LEN, max_size=wl.COOKIE_LEN))
        body = struct.pack("!IIHHQ", draw(st.one_of(st.just(0), u32)), draw(u32), draw(u16), draw(u16), draw(u64))
        return body + cookie
    if ptype == wl.PacketType.COOKIE and draw(st.booleans()):
        return draw(st.binary(min_size=wl.COOKIE_LEN, max_size=wl.COOKIE_LEN))
    return draw(payloads(200))


@st.composite
def link_datagrams(draw: st.DrawFn, tags: tuple[int, ...] = ()) -> bytes:
    """A link packet with random fields: every packet type (and unknown ones),
    any tag (``tags``: ones worth naming), SACK blocks, a good or a bad CRC,
    now and then a bad version or reserved byte."""
    ptype = draw(st.one_of(st.sampled_from(list(wl.PacketType)), u8))
    tag = draw(st.one_of(st.just(0), st.sampled_from(tags) if tags else u32, u32))
    nsack = draw(st.sampled_from([0, 0, 1, 4, 5, 255]))
    head = struct.pack("!BBBBIIIIIHBB", draw(st.sampled_from([wl.LINK_VERSION] * 8 + [0, wl.LINK_VERSION - 1, wl.LINK_VERSION + 1, 255])), ptype,
                       draw(u8), draw(st.sampled_from([0, 0, 1, 255])), tag, draw(u32), draw(u32), draw(u32),
                       draw(u32), draw(u16), nsack, draw(st.sampled_from([0] * 8 + [1])))
    sack = b"".join(struct.pack("!II", draw(u32), draw(u32)) for _ in range(min(nsack, 6)))
    data = head + sack + draw(link_bodies(ptype))
    crc = crc32c(data)
    if draw(st.integers(0, 3)) == 0:
        crc ^= 1 << draw(st.integers(0, 31))
    out = data + struct.pack("!I", crc)
    if draw(st.integers(0, 7)) == 0:
        out = out[: draw(st.integers(0, len(out)))]  # cut anywhere, even inside the header
    return out


random_datagrams = st.one_of(st.binary(max_size=64), st.builds(filled, st.integers(0, 1500), st.integers(0, 999)))


# --- messages inside the link (what reaches DDP/RDMAP and the other engines) -----

@st.composite
def stag_and_to(draw: st.DrawFn, t: Targets, size: int = 8) -> tuple[int, int]:
    """An STag and tagged offset: half the time a valid access of ``size``
    bytes to the first region, else a real region near or past its bounds,
    or anything."""
    how = draw(st.integers(0, 9))
    if how >= 5 and t.regions:
        stag, addr, length = t.regions[0]
        return stag, addr + draw(st.integers(0, max(0, length - size)))
    if how >= 2 and t.regions:
        stag, addr, length = draw(st.sampled_from(t.regions))
        off = draw(st.one_of(st.integers(-64, length + 64), st.sampled_from([0, length - 1, length, length - 8])))
        return stag, (addr + off) & ((1 << 64) - 1)
    if how == 1 and t.regions:
        stag = draw(st.sampled_from(t.regions))[0]
        return stag, draw(st.sampled_from([0, (1 << 64) - 1, (1 << 63), draw(u64)]))
    return draw(u32), draw(u64)


@st.composite
def ddp_segments(draw: st.DrawFn, t: Targets) -> bytes:
    """An RDMAP message as DDP segment bytes: every opcode, valid and mangled."""
    room = t.max_body - envelope.ENVELOPE_LEN - 32
    msn = draw(st.one_of(st.integers(0, 4), u32))
    # most messages could be valid, or every batch would end its QP at once
    kind = draw(st.sampled_from([0] * 5 + [1] * 2 + [3] * 2 + [5] * 2 + [2, 4, 6, 7, 8, 9, 10]))
    if kind == 0:  # RDMA Write
        payload = draw(payloads(room))
        stag, to = draw(stag_and_to(t, len(payload)))
        return rdmap.encode_tagged(Opcode.RDMA_WRITE, draw(st.booleans()), stag, to, payload)
    if kind == 1:  # Read Request: any size, any source
        size = draw(st.one_of(st.integers(0, 4096), st.sampled_from([1 << 20, (1 << 32) - 1]), u32))
        stag, to = draw(stag_and_to(t, size))
        body = rdmap.encode_read_request(rdmap.ReadRequest(draw(u32), draw(u64), size, stag, to))
        return rdmap.encode_untagged(Opcode.RDMA_READ_REQUEST, True, msn, 0, body)
    if kind == 2:  # an unsolicited Read Response
        stag, to = draw(stag_and_to(t))
        return rdmap.encode_tagged(Opcode.RDMA_READ_RESPONSE, draw(st.booleans()), stag, to, draw(payloads(room)))
    if kind == 3:  # Send variants, any MSN and MO, Invalidate naming real STags
        op = draw(st.sampled_from([Opcode.SEND, Opcode.SEND_SE, Opcode.SEND_INVALIDATE, Opcode.SEND_SE_INVALIDATE]))
        inv = draw(stag_and_to(t))[0] if op in rdmap.INVALIDATE_OPCODES else 0
        mo = draw(st.one_of(st.just(0), st.integers(0, 8192), u32))
        return rdmap.encode_untagged(op, draw(st.booleans()), msn, mo, draw(payloads(room)), inv)
    if kind == 4:  # Immediate Data, of the right size or not
        op = draw(st.sampled_from([Opcode.IMMEDIATE_DATA, Opcode.IMMEDIATE_DATA_SE]))
        return rdmap.encode_untagged(op, True, msn, 0, draw(st.one_of(st.binary(min_size=8, max_size=8),
                                                                       st.binary(max_size=20))))
    if kind == 5:  # Atomic Request: every operation (and unknown ones), aligned or not
        stag, to = draw(stag_and_to(t))
        req = rdmap.AtomicRequest(draw(st.one_of(st.sampled_from(list(rdmap.AtomicOp)), st.integers(0, 15))),
                                  draw(u32), stag, to & ~7 if draw(st.booleans()) else to, draw(u64), draw(u64),
                                  draw(u64), draw(u64))
        body = struct.pack("!IIIQQQQQ", req.aop << 28 if req.aop < 16 else 0, *req[1:])
        body = rdmap.encode_atomic_request(req) if req.aop in rdmap.AtomicOp._value2member_map_ and draw(st.booleans()) else body
        return rdmap.encode_untagged(Opcode.ATOMIC_REQUEST, True, msn, 0, body)
    if kind == 6:  # an unsolicited Atomic Response
        body = rdmap.encode_atomic_response(rdmap.AtomicResponse(draw(u32), draw(u64)))
        return rdmap.encode_untagged(Opcode.ATOMIC_RESPONSE, True, msn, 0, body)
    if kind == 7:  # Terminate, well-formed or not
        body = rdmap.encode_terminate(draw(terminates())) if draw(st.booleans()) else draw(st.binary(max_size=60))
        return rdmap.encode_untagged(Opcode.TERMINATE, True, msn, 0, body)
    if kind == 8:  # an untagged header with any queue number and control bits
        ctrl = draw(st.sampled_from([0x01, 0x41, 0x00, 0x02, 0xC1])) | (draw(u8) & 0x3C if draw(st.booleans()) else 0)
        rctl = draw(st.one_of(st.sampled_from([0x40 | op for op in range(16)]), u8))
        head = struct.pack("!BBIIII", ctrl, rctl, draw(u32), draw(st.one_of(st.integers(0, 7), u32)), msn,
                           draw(st.one_of(st.just(0), u32)))
        return head + draw(payloads(room))
    # a valid segment of any kind with a few bytes changed, cut short or extended
    stag, to = draw(stag_and_to(t))
    valid = rdmap.encode_tagged(Opcode.RDMA_WRITE, True, stag, to, filled(draw(st.integers(0, 64)), 7))
    return draw(mutated(st.just(valid)))


def _encoded(draw: st.DrawFn, encode: object, fields: st.SearchStrategy[tuple[int, ...]]) -> bytes:
    try:
        return encode(draw(fields))  # type: ignore[operator,no-any-return]
    except (ValueError, OverflowError):
        return draw(st.binary(max_size=40))


@st.composite
def engine_bodies(draw: st.DrawFn, kind: int, t: Targets) -> bytes:
    """The body of a FLOW, CM, LOCK, BARRIER or GROUP message: encoded with random fields, or noise."""
    if draw(st.integers(0, 3)) == 0:
        return draw(st.binary(max_size=64))
    small = st.one_of(st.integers(0, 8), u32)
    if kind == envelope.Kind.FLOW:
        return _encoded(draw, flow.encode, st.builds(flow.FlowMessage, st.integers(0, 5), small, small))
    if kind == envelope.Kind.CM:
        msg = st.one_of(
            st.builds(cm.ConnectRequest, u32, u16, u24, st.integers(0, 300), st.integers(0, 300), u32,
                      st.binary(max_size=600)),
            st.builds(cm.Accept, u32, u24, u8, u8, u32, st.binary(max_size=40)),
            st.builds(cm.Reject, u32, st.integers(0, 6), st.binary(max_size=40)),
            st.builds(cm.Disconnect, u32, st.one_of(st.sampled_from((t.qpn, t.peer_qpn) + t.other_qpns), u24)))
        return _encoded(draw, cm.encode, msg)
    if kind == envelope.Kind.LOCK:
        return _encoded(draw, lock.encode, st.builds(lock.LockMessage, st.integers(0, 7), small, small, small, small,
                                                     small, small, st.integers(0, 4)))
    if kind == envelope.Kind.BARRIER:
        return _encoded(draw, barrier.encode, st.builds(barrier.BarrierMessage, st.integers(0, 4),
                                                        st.integers(0, 4), st.integers(0, 20), small, small,
                                                        small, small))
    return _encoded(draw, group.encode, st.builds(group.GroupMessage, st.integers(0, 5), small, small, small,
                                                  st.integers(0, 2)))


@st.composite
def link_messages(draw: st.DrawFn, t: Targets) -> bytes:
    """One message a peer's link delivers: an envelope (any kind, flags and QPNs,
    mostly the fuzzer's own QP pair) and a body."""
    kind = draw(st.sampled_from([envelope.Kind.DDP] * 12 + list(envelope.Kind) + [0, 7, 255]))
    dst = draw(st.sampled_from([t.qpn] * 8 + list(t.other_qpns) + [0, draw(u24)]))
    src = draw(st.sampled_from([t.peer_qpn] * 8 + [draw(u24)]))
    flags = draw(st.sampled_from([0] * 6 + [envelope.Flags.IMM_FOLLOWS, envelope.Flags.FLOW_ACK, draw(u8)]))
    if kind == envelope.Kind.DDP:
        body = draw(ddp_segments(t))
    elif kind in envelope.Kind._value2member_map_:
        body = draw(engine_bodies(kind, t))
    else:
        body = draw(st.binary(max_size=64))
    if flags & envelope.Flags.FLOW_ACK and draw(st.booleans()):
        body += struct.pack("!I", draw(st.one_of(st.integers(0, 8), u32)))
    msg = struct.pack("!II", (kind << 24) | dst, (flags << 24) | src) + body
    return msg[: t.max_body]


# --- control requests ----------------------------------------------------------

#: ops whose answer may wait (for a peer, a lock, a barrier) or never come
BLOCKING_OPS = frozenset({ctl.Op.CM_GET_REQUEST, ctl.Op.CM_CONNECT, ctl.Op.GROUP_JOIN, ctl.Op.LOCK_ACQUIRE,
                          ctl.Op.LOCK_RELEASE, ctl.Op.BARRIER})

_EDGES = {"B": [0, 1, 0xFF], "H": [0, 1, 2, 0x7FFF, 0xFFFF], "I": [0, 1, 2, 3, 4, 5, 8, 0x7FFFFFFF, 0xFFFFFFFF],
          "Q": [0, 1, 4096, 1 << 40, (1 << 63), (1 << 64) - 1]}
_BITS = {"B": 8, "H": 16, "I": 32, "Q": 64}


def gids(extra: tuple[str, ...]) -> st.SearchStrategy[bytes]:
    """GIDs a fuzzed request may name: unserved loopback, the test's own daemons, and invalid ones."""
    mapped = [ctl.gid_from_ip(ip) for ip in extra] + [ctl.gid_from_ip(NOWHERE + str(i)) for i in (1, 2)]
    return st.one_of(st.sampled_from(mapped), st.sampled_from([bytes(16), ctl.gid_from_ip("::1"),
                                                               ctl.gid_from_ip("2001:db8::1"), b"\xff" * 16]))


#: request fields that name a resource: drawn from the session's own handles half the time
HANDLE_FIELDS = frozenset({"pd_handle", "mr_handle", "cq_handle", "send_cq", "recv_cq", "channel_handle", "qp_num",
                           "srq_handle", "listener_handle", "conn_id"})
_M = shm.QPAttrMask
#: the masks of the usual QP transitions (any other mask is refused before anything happens)
QP_MASKS = tuple(int(m) for m in (_M.IBV_QP_STATE, _M.IBV_QP_STATE | _M.IBV_QP_PKEY_INDEX | _M.IBV_QP_PORT | _M.IBV_QP_ACCESS_FLAGS,
            _M.IBV_QP_STATE | _M.IBV_QP_AV | _M.IBV_QP_PATH_MTU | _M.IBV_QP_DEST_QPN | _M.IBV_QP_RQ_PSN
            | _M.IBV_QP_MAX_DEST_RD_ATOMIC | _M.IBV_QP_MIN_RNR_TIMER,
            _M.IBV_QP_STATE | _M.IBV_QP_SQ_PSN | _M.IBV_QP_TIMEOUT | _M.IBV_QP_RETRY_CNT | _M.IBV_QP_RNR_RETRY
            | _M.IBV_QP_MAX_QP_RD_ATOMIC))


class Handle(int):
    """A field to fill, when the request is sent, with the session's own handle of this index."""


#: which learned handle a request field names
_KIND_OF = {"send_cq": "cq_handle", "recv_cq": "cq_handle"}


def resolve(kw: dict[str, object], learned: dict[str, int]) -> dict[str, object]:
    """``kw`` with each ``Handle`` replaced by a handle the session learned:
    mostly one of the field's kind, else any (or the index itself)."""
    every = sorted(set(learned.values()))
    out = {}
    for k, v in kw.items():
        if isinstance(v, Handle):
            own = learned.get(_KIND_OF.get(k, k))
            v = own if own is not None and v < 5 else every[v % len(every)] if every else int(v)
        out[k] = v
    return out


def _field(draw: st.DrawFn, code: str, name: str, extra: tuple[str, ...]) -> object:
    if code == "16s":
        return draw(gids(extra))
    if name in ("timeout_ms", "join_timeout_ms"):
        return draw(st.sampled_from([0, 1, 50, 200]))  # a wait is bounded: the client gives up after a while
    if name in HANDLE_FIELDS and draw(st.booleans()):
        return Handle(draw(st.integers(0, 7)))
    if name in ("qp_state", "cur_qp_state") and draw(st.booleans()):
        return draw(st.integers(0, 7))
    if name == "port_num" and draw(st.booleans()):
        return 1
    return draw(st.one_of(st.sampled_from(_EDGES[code]), st.integers(0, (1 << _BITS[code]) - 1)))


@st.composite
def valid_requests(draw: st.DrawFn, extra: tuple[str, ...]) -> tuple[ctl.Op, dict[str, object]]:
    """A well-formed request of any op with edge and random field values, and
    (``Handle``) the session's own handles among them: ``ctl.encode_request(op, **resolve(kw, handles))``."""
    op = draw(st.sampled_from(list(ctl.Op)))
    lay = ctl.REQUESTS[op]
    codes = [c for c in struct.Struct(lay.st.format).format.lstrip("!")]
    kw: dict[str, object] = {}
    i = 0
    for name in lay.fields:
        code = codes[i]
        if code.isdigit():  # "16s"
            code, i = "16s", i + 3
        else:
            i += 1
        kw[name] = _field(draw, code, name, extra)
    if op == ctl.Op.MODIFY_QP and draw(st.booleans()):  # a transition the state table knows
        kw["attr_mask"], kw["qp_state"] = draw(st.sampled_from(list(zip(QP_MASKS, (6, 1, 2, 3))) + [(QP_MASKS[0], 0)]))
    if lay.tail:
        if op == ctl.Op.GROUP_JOIN and draw(st.booleans()):
            members = draw(st.lists(st.sampled_from([(ip, p) for ip in (NOWHERE + "1", *extra) for p in (1, 9)]),
                                    min_size=1, max_size=6))
            kw["data"] = ctl.encode_members("fuzz", members)
        else:
            kw["data"] = draw(st.one_of(st.binary(max_size=16), st.builds(filled, st.integers(0, 700),
                                                                           st.integers(0, 99))))
    return op, kw


@st.composite
def raw_requests(draw: st.DrawFn) -> bytes:
    """A control header with any op, flags and status, and a body of about the right size, or noise."""
    if draw(st.integers(0, 3)) == 0:
        return draw(st.one_of(st.binary(max_size=40),
                              st.builds(filled, st.sampled_from([ctl.MAX_CTL_MESSAGE, ctl.MAX_CTL_MESSAGE + 1,
                                                                 ctl.MAX_CTL_MESSAGE + 100]), st.integers(0, 9))))
    op = draw(st.one_of(st.sampled_from(list(ctl.Op)), u16))
    size = ctl.REQUESTS[ctl.Op(op)].st.size if op in ctl.Op._value2member_map_ else draw(st.integers(0, 64))
    n = draw(st.sampled_from([size, size, max(0, size - 1), size + 1, 0, size + 600]))
    head = struct.pack("!HHi", op, draw(st.sampled_from([0] * 6 + [1, 0xFFFF])), draw(st.integers(-2**31, 2**31 - 1)))
    return head + filled(n, draw(st.integers(0, 1 << 16)))

