"""Control messages on the unix socket between the verbs library and the daemon.

Theory of operation
-------------------
The control path is a SOCK_SEQPACKET unix socket: one datagram per message,
boundaries kept, and file descriptors (memfd segments, eventfds) travel next
to the message as SCM_RIGHTS.  The library sends one request and waits for
its reply (pyverbs verbs are synchronous); a reply repeats the request's
``op`` with ``REPLY`` set and carries ``status``, an errno (0 = success)::

    +--------+--------+----------------+-----------------------+
    | op u16 | flg u16| status i32     | body (per-op layout)  |
    +--------+--------+----------------+-----------------------+

An error reply's body is ``ERROR``: a UTF-8 explanation, then any private
data (a connection rejected by the peer application carries the peer's
private data back, as rdma_cm's REJECTED event does).

Each body layout is declared once in ``REQUESTS`` / ``REPLIES`` as a struct
format plus field names; a layout may end in a variable ``data`` tail (CM
private data, the device name).  ``decode_request_untrusted`` is the only
parser the daemon applies to client bytes and raises only ``WireError``.

Addresses of peer daemons travel as 16-byte GIDs: an IPv4 address is an
IPv4-mapped IPv6 address (``::ffff:a.b.c.d``), as RoCEv2 and iWARP devices
report their GIDs; the peer daemon's UDP port travels beside it.
"""

from __future__ import annotations

import enum
import ipaddress
import os
import struct
from collections import namedtuple
from typing import Any

from .errors import WireError

CTL_VERSION = 3  # 2: CREATE_QP names an SRQ; SRQ and statistics requests; 3: process groups
#: bytes; the largest is a GROUP_JOIN with its member list
MAX_CTL_MESSAGE = 65536
MAX_PRIVATE_DATA = 512  #: rdma_cm's limit for iWARP (MPA, RFC 5044 §7.1)
MAX_FDS = 4
REPLY = 0x1

_HDR = struct.Struct("!HHi")
HEADER_LEN = _HDR.size


class Op(enum.IntEnum):
    HELLO = 1
    ALLOC_PD = 2
    DEALLOC_PD = 3
    REG_MR = 4
    DEREG_MR = 5
    CREATE_COMP_CHANNEL = 6
    DESTROY_COMP_CHANNEL = 7
    CREATE_CQ = 8
    DESTROY_CQ = 9
    CREATE_QP = 10
    MODIFY_QP = 11
    QUERY_QP = 12
    DESTROY_QP = 13
    QUERY_STATS = 14
    CREATE_SRQ = 15
    MODIFY_SRQ = 16
    QUERY_SRQ = 17
    DESTROY_SRQ = 18
    QUERY_STATUS = 19
    CM_LISTEN = 20
    CM_GET_REQUEST = 21
    CM_ACCEPT = 22
    CM_REJECT = 23
    CM_CONNECT = 24
    CM_DISCONNECT = 25
    CM_DESTROY_LISTENER = 26
    GROUP_JOIN = 40
    GROUP_LEAVE = 41
    LOCK_ACQUIRE = 42
    LOCK_TRY = 43
    LOCK_RELEASE = 44
    BARRIER = 45


class StatusSection(enum.IntEnum):
    """What a QUERY_STATUS asks for: the device (identity, limits, counters),
    its links to peer daemons, or its QPs; the last two come in pages."""

    DEVICE = 0
    LINKS = 1
    QPS = 2


class Layout:
    """One body layout: a big-endian struct format, field names, optional tail.

    ``encode(**fields)`` returns bytes; ``decode_untrusted(body)`` returns a
    namedtuple and raises only ``WireError``.
    """

    def __init__(self, name: str, fmt: str, fields: str, tail: bool = False) -> None:
        self.st = struct.Struct("!" + fmt)
        names = fields.split()
        if len(names) != len(self.st.unpack(bytes(self.st.size))):
            raise AssertionError(f"{name}: format {fmt!r} does not match fields {names}")
        self.tail = tail
        self.fields = tuple(names)
        self.type = namedtuple(name, names + (["data"] if tail else []))  # type: ignore[misc]

    def encode(self, **kw: Any) -> bytes:
        """Pack ``kw`` (every field; ``data`` for the tail).  Raises ValueError/struct.error."""
        values = [kw.pop(f) for f in self.fields]
        data = bytes(kw.pop("data", b"")) if self.tail else b""
        if kw:
            raise ValueError(f"unknown fields {sorted(kw)}")
        return self.st.pack(*values) + data

    def decode_untrusted(self, body: bytes | memoryview) -> Any:
        """Parse a body.  Raises WireError (``truncated``, ``bad_length``)."""
        n = self.st.size
        if len(body) < n:
            raise WireError("truncated", f"{self.type.__name__}: {len(body)} < {n} bytes")
        values = self.st.unpack_from(body)
        if self.tail:
            return self.type(*values, bytes(body[n:]))
        if len(body) != n:
            raise WireError("bad_length", f"{self.type.__name__}: {len(body)} != {n} bytes")
        return self.type(*values)


_E = Layout("Empty", "", "")
#: QP attributes, in modify requests and query replies (ibv_qp_attr's fields;
#: ``dgid``/``dlid`` are the ah_attr: peer daemon's address GID and UDP port).
_QP_ATTR_FMT = "IIIIIIIIIIIIIIIH16sI"
_QP_ATTR_FIELDS = (
    "qp_state cur_qp_state qp_access_flags pkey_index port_num path_mtu timeout "
    "retry_cnt rnr_retry min_rnr_timer rq_psn sq_psn max_rd_atomic max_dest_rd_atomic "
    "dest_qp_num dlid dgid sq_draining"
)

REQUESTS: dict[Op, Layout] = {
    Op.HELLO: Layout("HelloReq", "I", "version"),
    Op.ALLOC_PD: _E,
    Op.DEALLOC_PD: Layout("DeallocPd", "I", "pd_handle"),
    Op.REG_MR: Layout("RegMr", "IIQQ", "pd_handle access length addr"),
    Op.DEREG_MR: Layout("DeregMr", "I", "mr_handle"),
    Op.CREATE_COMP_CHANNEL: _E,
    Op.DESTROY_COMP_CHANNEL: Layout("DestroyChannel", "I", "channel_handle"),
    Op.CREATE_CQ: Layout("CreateCq", "III", "cqe channel_handle comp_vector"),
    Op.DESTROY_CQ: Layout("DestroyCq", "I", "cq_handle"),
    Op.CREATE_QP: Layout(
        "CreateQp", "IIIIIIIIIII",
        "pd_handle send_cq recv_cq qp_type max_send_wr max_recv_wr max_send_sge "
        "max_recv_sge max_inline_data sq_sig_all srq_handle",
    ),
    Op.MODIFY_QP: Layout("ModifyQp", "II" + _QP_ATTR_FMT, "qp_num attr_mask " + _QP_ATTR_FIELDS),
    Op.QUERY_QP: Layout("QueryQp", "I", "qp_num"),
    Op.DESTROY_QP: Layout("DestroyQp", "I", "qp_num"),
    Op.QUERY_STATS: _E,
    Op.CREATE_SRQ: Layout("CreateSrq", "IIII", "pd_handle max_wr max_sge srq_limit"),
    Op.MODIFY_SRQ: Layout("ModifySrq", "IIII", "srq_handle attr_mask max_wr srq_limit"),
    Op.QUERY_SRQ: Layout("QuerySrq", "I", "srq_handle"),
    Op.DESTROY_SRQ: Layout("DestroySrq", "I", "srq_handle"),
    # One page of a StatusSection, from ``start`` (a link's index, a QPN).
    Op.QUERY_STATUS: Layout("QueryStatus", "II", "section start"),
    Op.CM_LISTEN: Layout("CmListen", "HI", "port backlog"),
    Op.CM_GET_REQUEST: Layout("CmGetRequest", "II", "listener_handle timeout_ms"),
    Op.CM_ACCEPT: Layout("CmAccept", "IIII", "conn_id qp_num ord ird", tail=True),
    Op.CM_REJECT: Layout("CmReject", "I", "conn_id", tail=True),
    Op.CM_CONNECT: Layout(
        "CmConnect", "I16sHHIII", "qp_num gid udp_port port ord ird timeout_ms", tail=True
    ),
    Op.CM_DISCONNECT: Layout("CmDisconnect", "I", "qp_num"),
    Op.CM_DESTROY_LISTENER: Layout("CmDestroyListener", "I", "listener_handle"),
    # A group's connection is its own: the rank it joins as is its identity
    # there; the tail is the name and the member list (encode_members).
    Op.GROUP_JOIN: Layout("GroupJoin", "IIIII", "version rank size timeout_ms join_timeout_ms", tail=True),
    Op.GROUP_LEAVE: _E,
    Op.LOCK_ACQUIRE: Layout("LockAcquire", "II", "lock_id timeout_ms"),  # timeout 0: wait until granted
    Op.LOCK_TRY: Layout("LockTry", "I", "lock_id"),
    Op.LOCK_RELEASE: Layout("LockRelease", "I", "lock_id"),  # answered by nothing: see REPLIES
    Op.BARRIER: Layout("Barrier", "II", "algorithm arity"),
}

REPLIES: dict[Op, Layout] = {
    Op.HELLO: Layout(
        "HelloRep", "IHIIIIIIIIIQIIIQ16s",
        "ctx_handle udp_port link_mtu max_qp max_cq max_mr max_pd max_qp_wr max_cqe "
        "max_sge max_inline_data max_mr_size max_qp_rd_atom max_qp_init_rd_atom "
        "async_entries node_guid gid",
        tail=True,  # device name, UTF-8
    ),
    Op.ALLOC_PD: Layout("AllocPdRep", "I", "pd_handle"),
    Op.DEALLOC_PD: _E,
    Op.REG_MR: Layout("RegMrRep", "III", "mr_handle lkey rkey"),
    Op.DEREG_MR: _E,
    Op.CREATE_COMP_CHANNEL: Layout("CreateChannelRep", "I", "channel_handle"),
    Op.DESTROY_COMP_CHANNEL: _E,
    Op.CREATE_CQ: Layout("CreateCqRep", "III", "cq_handle cqe entries"),
    Op.DESTROY_CQ: _E,
    Op.CREATE_QP: Layout(
        "CreateQpRep", "IIIIIIII",
        "qp_num max_send_wr max_recv_wr max_send_sge max_recv_sge max_inline_data "
        "sq_entries rq_entries",
    ),
    Op.MODIFY_QP: _E,
    Op.QUERY_QP: Layout(
        "QueryQpRep", _QP_ATTR_FMT + "IIIIII",
        _QP_ATTR_FIELDS + " max_send_wr max_recv_wr max_send_sge max_recv_sge "
        "max_inline_data sq_sig_all",
    ),
    Op.DESTROY_QP: _E,
    # The device's counters (``rdma statistic`` of a real RNIC): "name value" lines, ASCII.
    Op.QUERY_STATS: Layout("StatsRep", "I", "count", tail=True),
    Op.CREATE_SRQ: Layout("CreateSrqRep", "III", "srq_handle max_wr max_sge"),
    Op.MODIFY_SRQ: _E,
    Op.QUERY_SRQ: Layout("QuerySrqRep", "III", "max_wr max_sge srq_limit"),
    Op.DESTROY_SRQ: _E,
    # What the operator's tools show (``daemon/status.py`` has the JSON's
    # shape): UTF-8 JSON, and where the section's next page starts (0: none).
    Op.QUERY_STATUS: Layout("StatusRep", "I", "next", tail=True),
    Op.CM_LISTEN: Layout("CmListenRep", "I", "listener_handle"),
    Op.CM_GET_REQUEST: Layout(
        "CmRequest", "IIII16sH", "conn_id remote_qpn ord ird gid udp_port", tail=True
    ),
    Op.CM_ACCEPT: _E,
    Op.CM_REJECT: _E,
    Op.CM_CONNECT: Layout("CmConnectRep", "III", "remote_qpn ord ird", tail=True),
    Op.CM_DISCONNECT: _E,
    Op.CM_DESTROY_LISTENER: _E,
    Op.GROUP_JOIN: Layout("GroupJoinRep", "III", "group_id daemons local_ranks"),
    Op.GROUP_LEAVE: _E,
    Op.LOCK_ACQUIRE: _E,
    Op.LOCK_TRY: Layout("LockTryRep", "I", "granted"),
    Op.LOCK_RELEASE: _E,  # never sent: a release is not waited for (the library checks what it holds)
    Op.BARRIER: Layout("BarrierRep", "I", "generation"),
}

#: the most ranks a group may have, and the longest group name (UTF-8 bytes)
MAX_GROUP_SIZE = 4096
MAX_GROUP_NAME = 255
_MEMBER = struct.Struct("!16sH")


def encode_members(name: str, members: list[tuple[str, int]]) -> bytes:
    """GROUP_JOIN's tail: name length u16, name, member count u32, then the
    distinct daemons (count u32, each GID + UDP port) and each rank's daemon
    index (u16), so a large group of few daemons stays small.

    Raises:
        ValueError: a name or member list out of range, or a bad address.
    """
    raw = name.encode()
    if not raw or len(raw) > MAX_GROUP_NAME or not 0 < len(members) <= MAX_GROUP_SIZE:
        raise ValueError("a group needs a name of 1..255 bytes and 1..4096 members")
    daemons: dict[tuple[str, int], int] = {}
    index = [daemons.setdefault((ip, port), len(daemons)) for ip, port in members]
    out = [struct.pack("!H", len(raw)), raw, struct.pack("!II", len(members), len(daemons))]
    out += [_MEMBER.pack(gid_from_ip(ip), port) for ip, port in daemons]
    out.append(struct.pack(f"!{len(index)}H", *index))
    return b"".join(out)


def decode_members_untrusted(data: bytes | memoryview) -> tuple[str, list[tuple[str, int]]]:
    """Parse GROUP_JOIN's tail: ``(name, members)``.

    Raises:
        WireError: ``truncated``, ``bad_length`` or ``bad_reserved`` (an
            out-of-range count, index, port or name); nothing else.
    """
    data = bytes(data)
    try:
        (n,) = struct.unpack_from("!H", data)
        name = data[2:2 + n].decode()
        size, nd = struct.unpack_from("!II", data, 2 + n)
        off = 10 + n
        daemons = [_MEMBER.unpack_from(data, off + i * _MEMBER.size) for i in range(nd)] if nd <= size else []
        off += nd * _MEMBER.size
        index = struct.unpack_from(f"!{size}H", data, off) if size <= MAX_GROUP_SIZE else ()
    except struct.error:
        raise WireError("truncated", "group member list") from None
    except UnicodeDecodeError:
        raise WireError("bad_reserved", "group name is not UTF-8") from None
    if not 0 < n <= MAX_GROUP_NAME or len(name.encode()) != n or not 0 < size <= MAX_GROUP_SIZE or not 0 < nd <= size:
        raise WireError("bad_reserved", "group name or member count out of range")
    if off + 2 * size != len(data):
        raise WireError("bad_length", "group member list")
    try:
        addrs = [(ip_from_gid(gid), port) for gid, port in daemons]
    except ValueError:
        raise WireError("bad_reserved", "member address") from None
    if any(not 0 < port <= 0xFFFF or ip.startswith("::") and ip != "::1" for ip, port in addrs) \
            or any(i >= nd for i in index) or len(set(index)) != nd or len(set(addrs)) != nd:
        raise WireError("bad_reserved", "member daemon out of range")
    return name, [addrs[i] for i in index]

ERROR = Layout("Error", "I", "text_len", tail=True)

#: Attribute names of a QP (for building MODIFY_QP from an object).
QP_ATTR_FIELDS: tuple[str, ...] = tuple(_QP_ATTR_FIELDS.split())


def encode_request(op: Op, **fields: Any) -> bytes:
    """Build a request message.  Raises ValueError/struct.error on a caller bug."""
    return _HDR.pack(op, 0, 0) + REQUESTS[op].encode(**fields)


def decode_request_untrusted(data: bytes | memoryview) -> tuple[Op, Any]:
    """Parse a request from a client.

    Returns ``(op, fields)``.

    Raises:
        WireError: ``truncated``, ``bad_op``, ``bad_flags``, ``bad_length``.
    """
    if len(data) < HEADER_LEN:
        raise WireError("truncated", "control header")
    op, flags, _status = _HDR.unpack_from(data)
    try:
        op = Op(op)
    except ValueError:
        raise WireError("bad_op", str(op)) from None
    if flags:
        raise WireError("bad_flags", str(flags))
    return op, REQUESTS[op].decode_untrusted(memoryview(data)[HEADER_LEN:])


def encode_reply(op: Op, **fields: Any) -> bytes:
    """Build a success reply for ``op``."""
    return _HDR.pack(op, REPLY, 0) + REPLIES[op].encode(**fields)


def encode_error(op: Op, errno_: int, text: str, private_data: bytes = b"") -> bytes:
    """Build an error reply: errno, explanation, optional private data."""
    t = text.encode()[:1024]
    return _HDR.pack(op, REPLY, errno_) + ERROR.encode(text_len=len(t), data=t + private_data)


def decode_reply(data: bytes | memoryview, op: Op) -> tuple[int, Any]:
    """Parse the daemon's reply to a request ``op``.

    Returns ``(0, fields)`` on success or ``(errno, (text, private_data))``.

    Raises:
        WireError: the reply is malformed or answers another op.
    """
    if len(data) < HEADER_LEN:
        raise WireError("truncated", "control reply header")
    rop, flags, status = _HDR.unpack_from(data)
    if rop != op or flags != REPLY:
        raise WireError("bad_op", f"reply for {rop}, expected {int(op)}")
    body = memoryview(data)[HEADER_LEN:]
    if status:
        err = ERROR.decode_untrusted(body)
        text = err.data[: err.text_len].decode(errors="replace")
        return status, (text, err.data[err.text_len:])
    return 0, REPLIES[op].decode_untrusted(body)


def gid_from_ip(ip: str) -> bytes:
    """The 16-byte GID of a daemon's IP address (IPv4 becomes ``::ffff:a.b.c.d``)."""
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv4Address):
        addr = ipaddress.IPv6Address("::ffff:" + str(addr))
    return addr.packed


def ip_from_gid(gid: bytes) -> str:
    """The IP address string a GID names (IPv4-mapped GIDs give dotted quads).

    Raises:
        ValueError: ``gid`` is not 16 bytes.
    """
    if len(gid) != 16:
        raise ValueError(f"a GID is 16 bytes, got {len(gid)}")
    addr = ipaddress.IPv6Address(bytes(gid))
    return str(addr.ipv4_mapped) if addr.ipv4_mapped else str(addr)


def runtime_dir() -> str:
    """The per-user directory holding daemons' control sockets (not created).

    ``$UDPVERBS_RUNTIME_DIR`` if set, else ``$XDG_RUNTIME_DIR/udpverbs``,
    else ``/tmp/udpverbs-<uid>``.
    """
    d = os.environ.get("UDPVERBS_RUNTIME_DIR")
    if d:
        return d
    x = os.environ.get("XDG_RUNTIME_DIR")
    if x:
        return os.path.join(x, "udpverbs")
    return f"/tmp/udpverbs-{os.getuid()}"


def socket_path(name: str) -> str:
    """The control socket of device ``name``: ``<runtime dir>/<name>.sock``.

    A ``name`` with a ``/`` in it is already a socket's path (``./uvA.sock``,
    ``/tmp/d/uvA.sock``) and is returned as it is: wherever a device is
    named, its socket's path may stand instead (device names have no ``/``).
    """
    if "/" in name:
        return name
    return os.path.join(runtime_dir(), f"{name}.sock")


def device_name(name: str) -> str:
    """The device name of ``name``, a device name or a socket path (``socket_path``'s argument)."""
    if "/" in name:
        return os.path.basename(name).removesuffix(".sock")
    return name


def private_dir_problem(path: str) -> str | None:
    """Why ``path`` is no safe home for a control socket, or None if it is.

    The uid is the trust boundary: whoever can write in the directory can
    replace the socket, so it must be the user's own and closed to everybody
    else (mode 0700), and so must a symlink leading to it (``/tmp`` is
    shared: another uid may have created ``/tmp/udpverbs-<uid>`` first).
    A directory that does not exist is no problem here (nothing serves in it).
    """
    uid = os.getuid()
    try:
        link_st = os.lstat(path)
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{path}: {e.strerror}"
    for what, s in (("it", st), ("the symlink to it", link_st)):
        if s.st_uid != uid:
            return f"{path} is not ours: {what} belongs to uid {s.st_uid}, we are uid {uid}"
    if st.st_mode & 0o077:
        return f"{path} is open to other users (mode {st.st_mode & 0o777:04o}, must be 0700)"
    return None
