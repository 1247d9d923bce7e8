"""The compiled lanes for DDP segments (cffi API mode): receive and send.

Theory of operation
-------------------
In a bulk RDMA Write the receiving daemon's Python path takes 11–17 µs per
datagram (in-process, ``python -m udpverbs.bench.inprocess_bw --no-native``) for
work that is the same every time: check the CRC and the link header, see
that the packet is the next in order, parse envelope and DDP header, check
the STag and bounds, copy the payload.  ``_native.c`` does that
for a *run* of datagrams (a GRO buffer, or one datagram) in one call, under
conditions the daemon checks once per call (see ``daemon/rxlane.py``,
``ReceiveLane.setup``): one established link with nothing out of order, one
QP able to receive, one STag naming a region that QP may write.  The call
stops at the first datagram it does not recognise, and the Python path
handles that one, so the C code never produces an error or a Terminate; the
link then applies the run's bookkeeping in one step
(``Link.data_run_received``).  ``tests/wire/test_native.py`` proves that
both paths leave the same bytes in memory and the same link state.  Read
Responses take the same lane into the sink of the Read at the ORRQ head (its
sink STag, whatever Read set the hint), with ``sequential`` set (each
segment must start where the last ended).  So do Sends (``untagged``: queue
0, the MSN of the message, the message offset sequential) into a one-SGE
receive: the one under way, or the next posted one, which the daemon takes
from the ring only if the lane placed the first segment there.  With
``last_ends``, a message's last segment ends the run (``ended``), and the
daemon completes the Read or the receive before anything later is placed;
a Read's last response must fill its sink, and a Send's may carry a
Modified ACK (``flow_ack``, ``flow_ack_msn``).  A Send with Invalidate's
last segment (the STag is invalidated first) and Immediate Data stay in
Python.  Read and atomic requests, and the Atomic Responses to ours
(``whole``: one segment each, the last; ``qn`` 1 or 3; ``last_fills``:
of the message's own size; ``many``: one after another, MSN by MSN) are
checked (with no buffer, ``mem`` NULL, nothing is copied), and the daemon
answers or completes them from the datagrams with the Python path's own
checks: what the lane saves is
the link's per-datagram Python, the segment's decoding, and with a batch
(an ORD window's requests or answers in one GRO buffer) the per-call
set-up too.

The send lane is the mirror image, in two steps that keep the link's
decisions where they are.  ``udpv_tx_bodies`` builds the bodies of a run of
one message's segments (an RDMA Write's, a Read Response's or a Send's,
within one SGE) straight from the registered memory into one buffer, from
the two headers Python packed (``wire/segment.py``), stamping each
segment's offset, each body where its link packet will be
(``transport.link.run_slots``); ``Link.send_run`` queues them and
``udpv_tx_frame_slots`` writes link headers and CRCs around those the link
lets leave (``Builder.bursts_to_send``), so the buffer goes to the socket as it
is and the payload is copied once.  Both produce exactly the bytes of the Python
encoders (``tests/wire/test_native.py``), and a device with the lanes sends
what a device without them sends (``tests/daemon/test_native_send_lane.py``).

The armed read, ``udpv_rx_recv_run``, puts the socket read in front of
the receive lane: one non-blocking ``recvmsg`` (with its GRO size and
kernel arrival stamp), then, if the datagram came from the peer the
caller armed it for, the lane over it with a run the daemon set up before
the datagram came (``ReceiveLane.arm``).  Whatever it does not take stays in
the buffer for the Python path, with its source.

The batches (``_native_batch.c``, compiled with it) take a stream's small
messages as one: ``udpv_tx_take_small`` takes the next WQEs of an SQ that
are alike and builds their segments into run slots, as ``udpv_tx_bodies``
does one message's (``daemon/txbatch.py``); ``udpv_rx_send_batch`` runs
the receive lane over a buffer of one-segment Sends, one message a call,
each into the next posted receive, and writes their CQEs
(``daemon/rxsends.py``); ``udpv_atomic_batch`` applies a GRO batch of
Atomic Requests to one region and builds their Atomic Responses into run
slots, and ``udpv_atomic_take`` takes an ORD window of atomic WQEs off an
SQ and builds their Atomic Requests the same way (``daemon/atombatch.py``); ``_native_read.c`` does
the same for an ORD window of Reads (``udpv_read_take``, ``udpv_read_batch`` with ``udpv_read_fill``, and
``udpv_read_responses``, a buffer of one-segment Read Responses placed into their sinks: ``daemon/readbatch.py``).  All stop at the first item that is not
like the others, and Python takes it.  ``udpv_rx_recv_send`` (``_native_send.c``)
is the armed read for a Send: when its run ends the Send, it also writes
the receive's CQE, so that an application answering Sends sees it
without waiting for the daemon's Python (``daemon/rxlane.py``).

One more, outside the lanes: ``udpv_rings_moved`` tells the data loop which
idle QPs have new WQEs, comparing producer and consumer index in each SQ's
header in one call instead of one Python step per QP (``daemon/scheduler.py``,
``SQWatch``).

The extension is built on first use with the machine's C compiler into a
cache directory (``$XDG_CACHE_HOME/udpverbs``, else ``~/.cache/udpverbs``),
named by a hash of the C source and the Python ABI, so a changed source is
rebuilt and two daemons starting at once do not corrupt each other's build
(each builds in its own directory and renames into place).  Without a
compiler, or with ``UDPVERBS_NATIVE=0``, :func:`load` returns None and the
daemon uses the Python path alone.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import pathlib
import sys
import sysconfig
import tempfile
from types import ModuleType
from typing import Callable

log = logging.getLogger(__name__)

CDEF = """
typedef struct {
    uint32_t conn_tag;
    uint32_t seq;
    uint32_t max_count;
    uint32_t w0, w1;
    uint8_t ctrl_more;
    uint8_t ctrl_last;
    uint8_t rctl;
    uint32_t stag;
    uint64_t base;
    uint64_t length;
    uint64_t next_to;
    uint32_t sequential;
    uint32_t untagged;
    uint32_t msn;
    uint32_t first_ack, first_ts, first_echo, last_ts;
    uint32_t first_rwnd, last_rwnd;
    uint32_t first_flags, flags_or;
    uint64_t bytes;
    uint32_t peeked;
    uint32_t next_w0, next_w1, next_stag;
    uint8_t next_ctrl, next_rctl;
    uint32_t last_ends;
    uint32_t ended, flow_ack, flow_ack_msn;
    uint32_t qn, last_fills, whole, many;
} udpv_rx_run;

size_t udpv_rx_write_run(udpv_rx_run *r, const uint8_t *buf, size_t len, size_t seg, uint8_t *mem);

typedef struct {
    uint8_t more[32];
    uint8_t last[32];
    uint32_t prefix;
    uint32_t off_at;
    uint32_t off_len;
    uint64_t off;
    uint8_t tail[4];
    uint32_t tail_len;
} udpv_tx_segments;

void udpv_tx_bodies(const udpv_tx_segments *t, uint8_t *out, const uint8_t *src, size_t k, size_t stride,
                    size_t last_len, int ends, size_t spacing);

typedef struct {
    uint32_t path_id, conn_tag, seq, ack, ts, echo, rwnd;
    size_t flag_at;
    uint32_t flag;
    uint32_t prefix;
    uint32_t pow_len[2], pow_k[2];
} udpv_tx_frame;

size_t udpv_tx_frame_slots(udpv_tx_frame *f, uint8_t *out, size_t k, size_t stride, size_t last_len);
uint32_t udpv_crc32c(uint32_t crc, const uint8_t *p, size_t n);
int udpv_crc32c_level(int level);

typedef struct {
    int fd;
    uint32_t peer_addr;
    uint16_t peer_port;
    uint32_t n;
    uint32_t seg;
    uint32_t truncated;
    uint32_t from_peer;
    int64_t ts_sec, ts_nsec;
    uint32_t src_addr;
    uint16_t src_port;
    int err;
} udpv_rx_recv;

long udpv_rx_recv_run(udpv_rx_recv *a, udpv_rx_run *r, uint8_t *buf, size_t cap, uint8_t *mem);

size_t udpv_rings_moved(const volatile uint32_t *const *hdr, const uint8_t *watched, size_t n, size_t cons_word,
                        uint32_t *out);

typedef struct {
    const uint8_t *slots;
    uint32_t cons, mask, entry_size, sg_at, avail;
    uint32_t opcode, flags_ok, inline_flag, signaled_flag, sig_all, max_inline;
    uint32_t lkey;
    uint64_t addr, len;
    uint8_t hdr[32];
    uint8_t more[32];
    uint32_t prefix, seg, untagged, msn;
    uint32_t length;
    uint64_t *wr_id;
    uint64_t *raddr;
    uint32_t *rkey;
    uint64_t *src_off;
    uint8_t *signaled;
} udpv_tx_take;

size_t udpv_tx_take_small(udpv_tx_take *t, const uint8_t *mem, uint8_t *out, size_t max, size_t spacing);

typedef struct {
    const uint8_t *rq;
    uint32_t rq_cons, rq_mask, rq_entry_size, rq_sg_at, rq_avail;
    uint32_t lkey;
    uint64_t addr, len;
    uint8_t *cq;
    uint32_t cq_prod, cq_mask, cq_entry_size, cq_room;
    uint32_t qp_num, src_qp, wc_recv;
    uint32_t ack, ts, echo, rwnd, flags, last_ts, last_rwnd, flags_or;
    uint32_t flow_ack, flow_ack_msn;
    uint32_t last_len;
} udpv_rx_sends;

size_t udpv_rx_send_batch(udpv_rx_sends *s, udpv_rx_run *r, const uint8_t *buf, size_t len, size_t seg,
                          uint8_t *mem);

typedef struct {
    uint32_t stag;
    uint64_t base, len;
    uint8_t hdr[32];
    uint32_t prefix, msn;
} udpv_atomics;

size_t udpv_atomic_batch(udpv_atomics *a, const uint8_t *buf, size_t k, size_t seg, uint8_t *mem, uint8_t *out,
                         size_t spacing);

typedef struct {
    const uint8_t *slots;
    uint32_t cons, mask, entry_size, sg_at, avail;
    uint32_t opcode, flags_ok, signaled_flag, sig_all;
    uint32_t lkey;
    uint64_t addr, len;
    uint8_t hdr[32];
    uint32_t prefix, msn, req_id, aop;
    uint64_t *wr_id, *raddr, *sink_off;
    uint32_t *rkey;
    uint8_t *signaled;
} udpv_atomic_wqes;

size_t udpv_atomic_take(udpv_atomic_wqes *t, uint8_t *out, size_t max, size_t spacing);

typedef struct {
    uint8_t *cq;
    const volatile uint32_t *cq_consumer;
    volatile uint32_t *cq_producer;
    uint32_t cq_prod, cq_mask, cq_entry_size, cq_entries;
    uint64_t wr_id;
    uint32_t placed;
    volatile uint32_t *rq_consumer;
    uint32_t rq_next;
    uint32_t rq_take;
    uint32_t qp_num, src_qp, wc_recv;
    uint32_t on;
    uint32_t written;
} udpv_rx_send_cqe;

long udpv_rx_recv_send(udpv_rx_recv *a, udpv_rx_run *r, udpv_rx_send_cqe *c, uint8_t *buf, size_t cap,
                       uint8_t *mem);

typedef struct {
    uint32_t stag;
    uint64_t base, len;
    uint32_t size;
    uint8_t hdr[32];
    uint32_t prefix;
    uint64_t *src_off;
} udpv_reads;

size_t udpv_read_batch(udpv_reads *a, const uint8_t *buf, size_t k, size_t seg, uint8_t *out, size_t spacing);
void udpv_read_fill(uint8_t *out, size_t spacing, size_t prefix, const uint8_t *mem, const uint64_t *src_off,
                    size_t k, size_t size);

typedef struct {
    const uint8_t *slots;
    uint32_t cons, mask, entry_size, sg_at, avail;
    uint32_t opcode, flags_ok, signaled_flag, sig_all;
    uint32_t lkey;
    uint64_t addr, len;
    uint32_t max_len;
    uint8_t hdr[32];
    uint32_t prefix, msn, sink;
    uint64_t *wr_id, *raddr, *sink_off;
    uint32_t *rkey, *length;
    uint8_t *signaled;
} udpv_read_wqes;

size_t udpv_read_take(udpv_read_wqes *t, uint8_t *out, size_t max, size_t spacing);

typedef struct {
    const uint32_t *stag, *size;
    const uint64_t *off;
    uint32_t ack, ts, echo, rwnd, flags, last_ts, last_rwnd, flags_or;
} udpv_read_sinks;

size_t udpv_read_responses(udpv_read_sinks *s, udpv_rx_run *r, const uint8_t *buf, size_t len, size_t seg,
                           uint8_t *mem, size_t reads);
"""

_SOURCE = pathlib.Path(__file__).with_name("_native.c")
#: compiled after ``_native.c``, in the same unit (it uses that file's helpers)
_BATCH_SOURCE = _SOURCE.with_name("_native_batch.c")
#: and after it, the same way
_ATOMIC_SOURCE = _SOURCE.with_name("_native_atomic.c")
#: and after that: the armed read of a Send with its receive's CQE
_SEND_SOURCE = _SOURCE.with_name("_native_send.c")
#: and after that: the ORD window of Reads
_READ_SOURCE = _SOURCE.with_name("_native_read.c")
_loaded: ModuleType | None = None
_tried = False


def cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "udpverbs"


def _module_name(source: str) -> str:
    tag = sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag
    digest = hashlib.sha256((CDEF + source + str(tag)).encode()).hexdigest()[:16]
    return f"_udpverbs_native_{digest}"


def _import(name: str, path: pathlib.Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def build(target_dir: pathlib.Path) -> pathlib.Path:
    """Compile the extension into ``target_dir``; return the library's path.

    Raises:
        Exception: whatever the compiler or cffi raised (no compiler, no headers).
    """
    import cffi

    source = (_SOURCE.read_text() + _BATCH_SOURCE.read_text() + _ATOMIC_SOURCE.read_text()
              + _SEND_SOURCE.read_text() + _READ_SOURCE.read_text())
    name = _module_name(source)
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    final = target_dir / (name + suffix)
    if final.exists():
        return final
    target_dir.mkdir(parents=True, exist_ok=True)
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source(name, source, extra_compile_args=["-O2"])
    with tempfile.TemporaryDirectory(dir=target_dir) as tmp:
        built = pathlib.Path(ffi.compile(tmpdir=tmp, verbose=False))
        # rename is atomic: a concurrent build of the same source wins or loses whole
        os.replace(built, final)
    for stale in target_dir.glob("_udpverbs_native_*"):
        if stale != final and stale.is_file():
            stale.unlink(missing_ok=True)
    return final


def load() -> ModuleType | None:
    """The compiled module (``.ffi``, ``.lib``), or None if disabled or not buildable.

    Built once per process; a failure is logged once and not retried.
    """
    global _loaded, _tried
    if not _tried:
        _tried = True
        _loaded = build_and_import(build, "compiled lanes")
    return _loaded


def build_and_import(builder: Callable[[pathlib.Path], pathlib.Path], what: str) -> ModuleType | None:
    """Build an extension with ``builder`` into :func:`cache_dir` and import
    it; None with ``UDPVERBS_NATIVE=0``, or if it cannot be built (logged,
    naming ``what``): every compiled part has a Python path beside it."""
    if os.environ.get("UDPVERBS_NATIVE", "1") == "0":
        return None
    try:
        path = builder(cache_dir())
        return _import(path.name.split(".")[0], path)
    except Exception as e:  # no compiler, no Python headers, read-only home...
        log.warning("%s unavailable (%s: %s): using the Python path", what, type(e).__name__, e)
        return None

