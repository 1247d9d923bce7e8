"""Shared-memory layout between the verbs library and the daemon.

Theory of operation
-------------------
Everything on the data path between an application and its local daemon
lives in memfd segments that both processes map (the fds travel over the
control socket with SCM_RIGHTS, see ``wire/ctl.py``):

* a **context page** per client session: the ``need_wakeup`` flag and the
  async-event ring;
* per QP one segment holding two rings, the **send queue** (WQEs the app
  produces, the daemon consumes) and the **receive queue**;
* per CQ one segment holding the **completion ring** (CQEs the daemon
  produces, the app consumes);
* per memory region one segment: the application's buffer itself, which the
  daemon places into directly (the daemon's "NIC memory" *is* the app's).

Every ring is single-producer / single-consumer: a header with the
producer index (written only by the producer), the consumer index (written
only by the consumer) on separate cache lines, then ``entries`` slots of
``entry_size`` bytes.  Indices are free-running u32 and wrap; a slot is
``index & (entries - 1)``.  The producer writes the slot, then the index
(x86 keeps stores in order).  The daemon never trusts what an application
wrote: indices that claim more than ``entries`` items, opcodes, SGE counts
and lengths are checked where they are read (``Ring.available``).

Doorbells follow io_uring's SQ_NEED_WAKEUP / AF_XDP's need_wakeup: the
daemon sets ``need_wakeup`` in the context page only when it is about to
sleep, and the application writes the doorbell eventfd only when it finds
the flag set, so a busy daemon costs no syscall per post.  Each side stores
(its index, or the flag) and then loads the other's: x86 may reorder a store
after a later load, so both put ``full_fence()`` in between, or each could
miss the other and the post would wait for the daemon's periodic rescan.  Completions are
the mirror image: ``req_notify`` sets ``armed`` in the CQ header, and the
daemon writes the CQ's (or its channel's) eventfd only for an armed CQ.

The constants below carry the libibverbs names **and values** (verbs.h),
because the same numbers travel in WQEs and CQEs and the verbs library
re-exports them.

Layouts are declared once, as C declarations for cffi (ABI mode: nothing is
compiled), in host byte order: both ends of a mapping run on the same host.
The per-WQE / per-CQE hot paths read and write through ``struct.Struct``
twins of those declarations instead (``SEND_WQE_HEAD``, ``SGE``,
``RECV_WQE_HEAD``, ``CQE``): a cffi field access costs ~0.1 µs and a WQE
has a dozen fields, while one ``pack_into`` of a whole header costs about
two of them.  The C declarations stay the authority: at import every twin
is checked field by field against ``ffi.offsetof`` / ``ffi.sizeof`` and the
module refuses to load on a mismatch.
"""

from __future__ import annotations

import enum
import fcntl
import mmap
import os
import re
import struct
import threading
from typing import Any

import cffi

# --- libibverbs constants (rdma-core libibverbs/verbs.h) ----------------------


class WrOpcode(enum.IntEnum):
    """``enum ibv_wr_opcode``."""

    IBV_WR_RDMA_WRITE = 0
    IBV_WR_RDMA_WRITE_WITH_IMM = 1
    IBV_WR_SEND = 2
    IBV_WR_SEND_WITH_IMM = 3
    IBV_WR_RDMA_READ = 4
    IBV_WR_ATOMIC_CMP_AND_SWP = 5
    IBV_WR_ATOMIC_FETCH_AND_ADD = 6
    IBV_WR_LOCAL_INV = 7
    IBV_WR_BIND_MW = 8
    IBV_WR_SEND_WITH_INV = 9


class WcStatus(enum.IntEnum):
    """``enum ibv_wc_status``."""

    IBV_WC_SUCCESS = 0
    IBV_WC_LOC_LEN_ERR = 1
    IBV_WC_LOC_QP_OP_ERR = 2
    IBV_WC_LOC_EEC_OP_ERR = 3
    IBV_WC_LOC_PROT_ERR = 4
    IBV_WC_WR_FLUSH_ERR = 5
    IBV_WC_MW_BIND_ERR = 6
    IBV_WC_BAD_RESP_ERR = 7
    IBV_WC_LOC_ACCESS_ERR = 8
    IBV_WC_REM_INV_REQ_ERR = 9
    IBV_WC_REM_ACCESS_ERR = 10
    IBV_WC_REM_OP_ERR = 11
    IBV_WC_RETRY_EXC_ERR = 12
    IBV_WC_RNR_RETRY_EXC_ERR = 13
    IBV_WC_LOC_RDD_VIOL_ERR = 14
    IBV_WC_REM_INV_RD_REQ_ERR = 15
    IBV_WC_REM_ABORT_ERR = 16
    IBV_WC_INV_EECN_ERR = 17
    IBV_WC_INV_EEC_STATE_ERR = 18
    IBV_WC_FATAL_ERR = 19
    IBV_WC_RESP_TIMEOUT_ERR = 20
    IBV_WC_GENERAL_ERR = 21


class WcOpcode(enum.IntEnum):
    """``enum ibv_wc_opcode``."""

    IBV_WC_SEND = 0
    IBV_WC_RDMA_WRITE = 1
    IBV_WC_RDMA_READ = 2
    IBV_WC_COMP_SWAP = 3
    IBV_WC_FETCH_ADD = 4
    IBV_WC_BIND_MW = 5
    IBV_WC_LOCAL_INV = 6
    IBV_WC_RECV = 1 << 7
    IBV_WC_RECV_RDMA_WITH_IMM = (1 << 7) + 1


class WcFlags(enum.IntFlag):
    """``enum ibv_wc_flags``."""

    IBV_WC_GRH = 1
    IBV_WC_WITH_IMM = 2
    IBV_WC_IP_CSUM_OK = 4
    IBV_WC_WITH_INV = 8


class SrqAttrMask(enum.IntFlag):
    """``enum ibv_srq_attr_mask``."""

    IBV_SRQ_MAX_WR = 1
    IBV_SRQ_LIMIT = 2


class AtomicCap(enum.IntEnum):
    """``enum ibv_atomic_cap``: our atomics are atomic among all QPs of a daemon (HCA)."""

    IBV_ATOMIC_NONE = 0
    IBV_ATOMIC_HCA = 1
    IBV_ATOMIC_GLOB = 2


class AccessFlags(enum.IntFlag):
    """``enum ibv_access_flags``."""

    IBV_ACCESS_LOCAL_WRITE = 1
    IBV_ACCESS_REMOTE_WRITE = 1 << 1
    IBV_ACCESS_REMOTE_READ = 1 << 2
    IBV_ACCESS_REMOTE_ATOMIC = 1 << 3
    IBV_ACCESS_MW_BIND = 1 << 4
    IBV_ACCESS_ZERO_BASED = 1 << 5


class SendFlags(enum.IntFlag):
    """``enum ibv_send_flags``."""

    IBV_SEND_FENCE = 1
    IBV_SEND_SIGNALED = 1 << 1
    IBV_SEND_SOLICITED = 1 << 2
    IBV_SEND_INLINE = 1 << 3


class QPState(enum.IntEnum):
    """``enum ibv_qp_state``."""

    IBV_QPS_RESET = 0
    IBV_QPS_INIT = 1
    IBV_QPS_RTR = 2
    IBV_QPS_RTS = 3
    IBV_QPS_SQD = 4
    IBV_QPS_SQE = 5
    IBV_QPS_ERR = 6
    IBV_QPS_UNKNOWN = 7


class QPAttrMask(enum.IntFlag):
    """``enum ibv_qp_attr_mask``."""

    IBV_QP_STATE = 1 << 0
    IBV_QP_CUR_STATE = 1 << 1
    IBV_QP_EN_SQD_ASYNC_NOTIFY = 1 << 2
    IBV_QP_ACCESS_FLAGS = 1 << 3
    IBV_QP_PKEY_INDEX = 1 << 4
    IBV_QP_PORT = 1 << 5
    IBV_QP_QKEY = 1 << 6
    IBV_QP_AV = 1 << 7
    IBV_QP_PATH_MTU = 1 << 8
    IBV_QP_TIMEOUT = 1 << 9
    IBV_QP_RETRY_CNT = 1 << 10
    IBV_QP_RNR_RETRY = 1 << 11
    IBV_QP_RQ_PSN = 1 << 12
    IBV_QP_MAX_QP_RD_ATOMIC = 1 << 13
    IBV_QP_ALT_PATH = 1 << 14
    IBV_QP_MIN_RNR_TIMER = 1 << 15
    IBV_QP_SQ_PSN = 1 << 16
    IBV_QP_MAX_DEST_RD_ATOMIC = 1 << 17
    IBV_QP_PATH_MIG_STATE = 1 << 18
    IBV_QP_CAP = 1 << 19
    IBV_QP_DEST_QPN = 1 << 20


class QPType(enum.IntEnum):
    """``enum ibv_qp_type`` (only RC is implemented)."""

    IBV_QPT_RC = 2
    IBV_QPT_UC = 3
    IBV_QPT_UD = 4


class EventType(enum.IntEnum):
    """``enum ibv_event_type`` (the subset the daemon raises, same values)."""

    IBV_EVENT_CQ_ERR = 0
    IBV_EVENT_QP_FATAL = 1
    IBV_EVENT_QP_REQ_ERR = 2
    IBV_EVENT_QP_ACCESS_ERR = 3
    IBV_EVENT_COMM_EST = 4
    IBV_EVENT_SQ_DRAINED = 5
    IBV_EVENT_DEVICE_FATAL = 8
    IBV_EVENT_PORT_ACTIVE = 9
    IBV_EVENT_PORT_ERR = 10
    IBV_EVENT_SRQ_LIMIT_REACHED = 15
    IBV_EVENT_QP_LAST_WQE_REACHED = 16


# --- layout ------------------------------------------------------------------

MAX_SGE = 16  #: SGEs per WQE (send and receive)
MAX_INLINE = MAX_SGE * 16  #: inline bytes per send WQE: shares room with the SGE list
#: the largest message (port attribute max_msg_sz): a Read Request's size and
#: a Send's MO are 32-bit fields (RFC 5040 §4.4, RFC 5041 §6.3)
MAX_MSG_SZ = 1 << 31
CACHE_LINE = 64

CDEF = """
struct uv_ring_hdr {
    uint32_t producer;          /* written by the producer only */
    uint32_t _pad0[15];
    uint32_t consumer;          /* written by the consumer only */
    uint32_t _pad1[15];
    uint32_t entries;           /* power of two, written by the daemon at creation */
    uint32_t entry_size;
    uint32_t armed;             /* CQ: app sets by req_notify, daemon clears when it signals */
    uint32_t solicited_only;    /* CQ: armed for solicited completions only */
    uint32_t event_pending;     /* CQ: daemon sets when it signalled a channel */
    uint32_t overrun;           /* CQ: daemon sets when the app let the ring overflow */
    uint32_t _pad2[10];
};

struct uv_sge {
    uint64_t addr;
    uint32_t length;
    uint32_t lkey;
};

struct uv_send_wqe {
    uint64_t wr_id;
    uint64_t remote_addr;
    uint32_t opcode;
    uint32_t send_flags;
    uint32_t num_sge;
    uint32_t imm_data;          /* network byte order, as in ibv_send_wr; for
                                   IBV_WR_SEND_WITH_INV the rkey to invalidate
                                   (a union in ibv_send_wr too) */
    uint32_t rkey;
    uint32_t inline_len;        /* IBV_SEND_INLINE: bytes in inline_data */
    uint64_t compare_add;       /* atomics: CmpSwap compare value / FetchAdd addend */
    uint64_t swap;              /* atomics: CmpSwap swap value */
    union {
        struct uv_sge sg[16];
        uint8_t inline_data[256];
    };
};

struct uv_recv_wqe {
    uint64_t wr_id;
    uint32_t num_sge;
    uint32_t _pad;
    struct uv_sge sg[16];
};

struct uv_cqe {
    uint64_t wr_id;
    uint32_t status;
    uint32_t opcode;
    uint32_t vendor_err;
    uint32_t byte_len;
    uint32_t imm_data;
    uint32_t qp_num;
    uint32_t src_qp;
    uint32_t wc_flags;
};

struct uv_async_event {
    uint32_t event_type;
    uint32_t element;           /* QPN for QP events, CQ handle for CQ events */
};

struct uv_ctx_page {
    uint32_t need_wakeup;       /* daemon sets before it sleeps on the doorbells */
    uint32_t _pad0[15];
    uint32_t device_fatal;
    uint32_t _pad1[15];
};
"""

ffi = cffi.FFI()
ffi.cdef(CDEF)

RING_HDR_SIZE: int = ffi.sizeof("struct uv_ring_hdr")
SEND_WQE_SIZE: int = ffi.sizeof("struct uv_send_wqe")
RECV_WQE_SIZE: int = ffi.sizeof("struct uv_recv_wqe")
CQE_SIZE: int = ffi.sizeof("struct uv_cqe")
ASYNC_EVENT_SIZE: int = ffi.sizeof("struct uv_async_event")
CTX_PAGE_SIZE: int = ffi.sizeof("struct uv_ctx_page")
ASYNC_RING_ENTRIES = 64
_U32 = 0xFFFFFFFF
PAGE = mmap.PAGESIZE

# --- struct fast paths ---------------------------------------------------------
# "=": host byte order (as the C declarations), standard sizes and no implicit
# alignment, so every pad byte is spelled out ("x") and checked below.

#: ``struct uv_send_wqe`` up to its ``sg`` / ``inline_data`` union.
SEND_WQE_HEAD = struct.Struct("=QQIIIIIIQQ")
SEND_WQE_HEAD_FIELDS = ("wr_id", "remote_addr", "opcode", "send_flags", "num_sge", "imm_data", "rkey",
                        "inline_len", "compare_add", "swap")
#: ``struct uv_sge``, one element of a WQE's ``sg`` array.
SGE = struct.Struct("=QII")
SGE_FIELDS = ("addr", "length", "lkey")
#: ``struct uv_recv_wqe`` up to its ``sg`` array (``_pad`` packs as zero).
RECV_WQE_HEAD = struct.Struct("=QI4x")
RECV_WQE_HEAD_FIELDS = ("wr_id", "num_sge")
#: The whole ``struct uv_cqe``.
CQE = struct.Struct("=QIIIIIIII")
CQE_FIELDS = ("wr_id", "status", "opcode", "vendor_err", "byte_len", "imm_data", "qp_num", "src_qp", "wc_flags")

SEND_WQE_SG_OFFSET: int = ffi.offsetof("struct uv_send_wqe", "sg")
SEND_WQE_INLINE_OFFSET: int = ffi.offsetof("struct uv_send_wqe", "inline_data")
RECV_WQE_SG_OFFSET: int = ffi.offsetof("struct uv_recv_wqe", "sg")
SGE_SIZE: int = ffi.sizeof("struct uv_sge")

_STRUCT_CODE = {"uint8_t": "B", "uint16_t": "H", "uint32_t": "I", "uint64_t": "Q"}


def _check_fast_layout(st: struct.Struct, ctype: str, names: tuple[str, ...], end: int) -> None:
    """Refuse a Struct twin that does not match the C declaration byte for byte.

    ``st`` must pack ``names`` (fields of ``ctype``) at their cffi offsets
    with their C widths, cover exactly bytes ``[0, end)``, and leave out only
    padding (``_pad*``) fields, which it must skip with ``x``.

    Raises:
        RuntimeError: on any mismatch (a layout edited on one side only).
    """
    cfields = dict(ffi.typeof(ctype).fields)
    m = re.fullmatch(r"=((?:\d*[xBHIQ])*)", st.format)
    if m is None:
        raise RuntimeError(f"{ctype}: unsupported struct format {st.format!r}")
    pos = 0
    left = list(names)
    for count, code in re.findall(r"(\d*)([xBHIQ])", m.group(1)):
        reps = int(count or 1)
        if code == "x":
            pos += reps
            continue
        for _ in range(reps):
            if not left:
                raise RuntimeError(f"{ctype}: struct format {st.format!r} has more fields than {names}")
            name = left.pop(0)
            f = cfields.get(name)
            if f is None:
                raise RuntimeError(f"{ctype} has no field {name!r}")
            if f.offset != pos or _STRUCT_CODE.get(f.type.cname) != code:
                raise RuntimeError(f"{ctype}.{name}: C has {f.type.cname} at {f.offset}, struct has {code!r} at {pos}")
            pos += struct.calcsize("=" + code)
    if left:
        raise RuntimeError(f"{ctype}: struct format {st.format!r} lacks fields {left}")
    if pos != st.size or st.size != end:
        raise RuntimeError(f"{ctype}: struct covers {st.size} bytes, C layout needs {end}")
    skipped = [n for n, f in cfields.items() if f.offset < end and n not in names and not n.startswith("_pad")]
    if skipped:
        raise RuntimeError(f"{ctype}: struct skips fields {skipped}")


_check_fast_layout(SEND_WQE_HEAD, "struct uv_send_wqe", SEND_WQE_HEAD_FIELDS, SEND_WQE_SG_OFFSET)
_check_fast_layout(SGE, "struct uv_sge", SGE_FIELDS, SGE_SIZE)
_check_fast_layout(RECV_WQE_HEAD, "struct uv_recv_wqe", RECV_WQE_HEAD_FIELDS, RECV_WQE_SG_OFFSET)
_check_fast_layout(CQE, "struct uv_cqe", CQE_FIELDS, CQE_SIZE)
if SEND_WQE_INLINE_OFFSET != SEND_WQE_SG_OFFSET:
    raise RuntimeError("struct uv_send_wqe: inline_data must share the sg array's place")


def ring_bytes(entries: int, entry_size: int) -> int:
    """Bytes one ring of ``entries`` slots takes, rounded up to a cache line."""
    n = RING_HDR_SIZE + entries * entry_size
    return (n + CACHE_LINE - 1) // CACHE_LINE * CACHE_LINE


def round_entries(n: int) -> int:
    """The power of two a ring needs to hold ``n`` items (at least 1)."""
    return 1 << max(0, (max(1, n) - 1).bit_length())


def page_round(n: int) -> int:
    """``n`` rounded up to a whole page, at least one page (mmap needs > 0)."""
    return max(PAGE, (n + PAGE - 1) // PAGE * PAGE)


class QPLayout:
    """Where the SQ and RQ live in a QP's segment: SQ at 0, RQ after it."""

    def __init__(self, sq_entries: int, rq_entries: int) -> None:
        self.sq_entries = sq_entries
        self.rq_entries = rq_entries
        self.sq_offset = 0
        self.rq_offset = ring_bytes(sq_entries, SEND_WQE_SIZE)
        self.size = page_round(self.rq_offset + ring_bytes(rq_entries, RECV_WQE_SIZE))


class CtxLayout:
    """The context page followed by the async-event ring."""

    page_offset = 0
    async_offset = (CTX_PAGE_SIZE + CACHE_LINE - 1) // CACHE_LINE * CACHE_LINE
    size = page_round(async_offset + ring_bytes(ASYNC_RING_ENTRIES, ASYNC_EVENT_SIZE))


_FENCE = threading.Lock()


def full_fence() -> None:
    """A full memory barrier between the caller's stores and its later loads.

    An uncontended lock acquire is an atomic read-modify-write (``lock
    cmpxchg`` on x86), which orders every earlier store before every later
    load; about 0.1 µs, far cheaper than the syscall it saves.
    """
    _FENCE.acquire()
    _FENCE.release()


class RingError(Exception):
    """A ring's shared indices are inconsistent (the peer process misbehaved)."""


class Ring:
    """A typed, single-producer / single-consumer view of one ring.

    Each side keeps its own index privately and only *publishes* it to the
    shared header, so a misbehaving peer can at worst make ``available`` or
    ``free`` report an inconsistency (``RingError``), never redirect a write.

    Slots are reached two ways: as cffi structs (``next_slot`` / ``peek``) or,
    on hot paths, as byte offsets into ``buf`` (``next_slot_offset`` /
    ``slot_offset``) for the ``struct.Struct`` twins (``SEND_WQE_HEAD`` ...).

    Args:
        buf: a writable buffer (the segment's mmap).
        offset: byte offset of the ring header in ``buf``.
        ctype: C type of a slot, e.g. ``"struct uv_cqe"``.
        entries: slots; trusted value from the creator (never re-read from shm).
        init: write ``entries``/``entry_size`` into the header (the creator).

    Attributes:
        buf: a memoryview of ``buf`` (the whole segment) for ``pack_into`` /
            ``unpack_from``; unusable after ``release``.
        entry_size: bytes per slot (``ffi.sizeof(ctype)``, trusted like
            ``entries``).
    """

    __slots__ = ("_base", "buf", "hdr", "entries", "mask", "entry_size", "_slots", "_slots_offset", "_ctype_ptr",
                 "prod", "cons", "hdr_addr", "slots_addr")

    def __init__(self, buf: Any, offset: int, ctype: str, entries: int, *, init: bool = False) -> None:
        if entries <= 0 or entries & (entries - 1):
            raise ValueError(f"ring entries must be a power of two, got {entries}")
        self._base = ffi.from_buffer(buf)
        self.entry_size: int = ffi.sizeof(ctype)
        if offset + ring_bytes(entries, self.entry_size) > len(self._base):
            ffi.release(self._base)  # a refused ring must not keep the mmap exported
            raise ValueError("ring does not fit in its segment")
        self.buf = memoryview(buf)
        self.hdr = ffi.cast("struct uv_ring_hdr *", self._base + offset)
        self.entries = entries
        self.mask = entries - 1
        self._ctype_ptr = ctype + " *"
        self._slots_offset = offset + RING_HDR_SIZE
        self._slots = ffi.cast(self._ctype_ptr, self._base + self._slots_offset)
        # for compiled code that fills or drains many slots in one call
        self.hdr_addr = int(ffi.cast("uintptr_t", self.hdr))
        self.slots_addr = int(ffi.cast("uintptr_t", self._slots))
        if init:
            self.hdr.entries = entries
            self.hdr.entry_size = self.entry_size
        self.prod = self.hdr.producer
        self.cons = self.hdr.consumer

    # -- producer side --
    def free(self) -> int:
        """Slots the producer may fill now.  Raises RingError if the consumer lied."""
        used = (self.prod - self.hdr.consumer) & _U32
        if used > self.entries:
            raise RingError(f"consumer index ahead of producer by {used}")
        return self.entries - used

    def next_slot(self) -> Any:
        """The slot to fill next (call ``free()`` first); ``publish`` makes it visible."""
        return self._slots[self.prod & self.mask]

    def next_slot_offset(self) -> int:
        """Byte offset in ``buf`` of the slot ``next_slot`` returns."""
        return self._slots_offset + (self.prod & self.mask) * self.entry_size

    def push(self, n: int = 1) -> None:
        """Advance the private producer index past the ``n`` slots just filled."""
        self.prod = (self.prod + n) & _U32

    def publish(self) -> None:
        """Write the producer index to shared memory (after the slots)."""
        self.hdr.producer = self.prod

    # -- consumer side --
    def available(self) -> int:
        """Items ready for the consumer.  Raises RingError if the producer lied."""
        n = (self.hdr.producer - self.cons) & _U32
        if n > self.entries:
            raise RingError(f"producer index ahead of consumer by {n}")
        return n

    def peek(self, i: int = 0) -> Any:
        """The ``i``-th unconsumed slot (``i < available()``)."""
        return self._slots[(self.cons + i) & self.mask]

    def slot_offset(self, i: int = 0) -> int:
        """Byte offset in ``buf`` of the slot ``peek(i)`` returns."""
        return self._slots_offset + ((self.cons + i) & self.mask) * self.entry_size

    def pop(self, n: int = 1) -> None:
        """Consume ``n`` slots and publish the consumer index."""
        self.cons = (self.cons + n) & _U32
        self.hdr.consumer = self.cons

    def release(self) -> None:
        """Drop the buffer exports (cffi's and ``buf``) so the underlying mmap can be closed."""
        ffi.release(self._base)
        self.buf.release()
        self.hdr_addr = self.slots_addr = 0  # compiled code must not reach an unmapped ring


def new_segment(size: int, name: str) -> tuple[int, mmap.mmap]:
    """Create a sealed-size memfd of ``size`` bytes and map it.

    Returns ``(fd, mapping)``; the caller owns both.  The size is sealed
    (F_SEAL_SHRINK | F_SEAL_GROW) so the other process can never shrink it
    under a mapping, which would turn a placement into SIGBUS.
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        seal(fd)
        return fd, mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise


def seal(fd: int) -> None:
    """Forbid resizing the memfd ``fd`` (idempotent)."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)


def map_segment_untrusted(fd: int, size: int) -> mmap.mmap:
    """Map a memfd received from another process, after sealing its size.

    Raises:
        OSError: the fd is not a sealable memfd, or it is smaller than ``size``.
    """
    seal(fd)
    st = os.fstat(fd)
    if st.st_size < size:
        raise OSError(22, f"segment is {st.st_size} bytes, need {size}")
    return mmap.mmap(fd, size)
