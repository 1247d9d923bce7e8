"""Completion queues, completion channels and work completions.

Theory of operation
-------------------
The daemon writes CQEs into a ring in shared memory; ``CQ.poll`` reads them
directly (no syscall, as a hardware CQ).  To wait, a caller arms the CQ
(``req_notify``: a flag in the ring header); the daemon, after writing a CQE
into an armed CQ, disarms it and writes the CQ's eventfd — or, for a CQ
bound to a ``CompChannel``, the channel's eventfd, marking the CQ
``event_pending`` so ``get_cq_event`` can say which CQ fired.

``CQ.wait`` is the blocking helper: it may spin for ``spin_s`` (worth it
only with a core to spare: a sleeping vCPU costs ~60 µs to wake, but a
spinning application takes the CPU its daemon needs), then arms and sleeps
on the eventfd, re-checking at a bounded interval.  ``await CQ.wait_async()`` is the trio flavour: the same arm-then-
check, with ``trio.lowlevel.wait_readable`` on the eventfd.
"""

from __future__ import annotations

import errno
import mmap
import os
import select
import threading
import time
from typing import Any

from ..wire import shm
from ..wire.ctl import Op
from .device import Context, Resource, _close_all, _drain_eventfd
from .errors import UserError, VerbsError
from .fastpath import load as _load_fastpath

#: Default busy-poll before sleeping.  0: on a host with few cores the daemons
#: need the CPU an application spins on (measured here, 2 vCPUs: an 8-byte
#: Write completes in ~200 µs without the spin, ~330 µs with 100 µs of it).
#: Pass ``spin_s`` to ``wait`` where cores are to spare.
SPIN_S = 0.0
RECHECK_S = 0.01  #: bounded sleep: covers a wake-up lost to store/load reordering
#: empty polls in a row after which ``poll`` looks whether the daemon is gone
EMPTY_POLLS = 1024


#: value -> enum member, for the fields a WC shows by name (a dict lookup
#: is a fraction of what calling the enum class costs on the poll path)
_STATUS = {int(m): m for m in shm.WcStatus}
_OPCODE = {int(m): m for m in shm.WcOpcode}
_FLAGS = {v: shm.WcFlags(v) for v in range(1 << len(shm.WcFlags))}
_status, _opcode, _flags = _STATUS.get, _OPCODE.get, _FLAGS.get


class WC:
    """A work completion (``ibv_wc``).

    ``status``, ``opcode`` and ``wc_flags`` are ``WcStatus``, ``WcOpcode``
    and ``WcFlags`` members: ints that compare equal to the ``IBV_WC_*``
    constants and print as numbers, with ``.name`` and a repr that name them.
    """

    __slots__ = ("wr_id", "status", "opcode", "vendor_err", "byte_len", "qp_num", "src_qp", "imm_data",
                 "wc_flags", "pkey_index", "slid", "sl", "dlid_path_bits")

    def __init__(self, wr_id: int = 0, status: int = 0, opcode: int = 0, vendor_err: int = 0, byte_len: int = 0,
                 qp_num: int = 0, src_qp: int = 0, imm_data: int = 0, wc_flags: int = 0) -> None:
        self.wr_id = wr_id
        self.status = _status(status, status)
        self.opcode = _opcode(opcode, opcode)
        self.vendor_err = vendor_err
        self.byte_len = byte_len
        self.qp_num = qp_num
        self.src_qp = src_qp
        self.imm_data = imm_data
        self.wc_flags = _flags(wc_flags, wc_flags)
        self.pkey_index = 0
        self.slid = 0
        self.sl = 0
        self.dlid_path_bits = 0

    @property
    def invalidated_rkey(self) -> int:
        """The rkey a Send with Invalidate invalidated (``IBV_WC_WITH_INV``); shares ``imm_data``, as in ``ibv_wc``."""
        return self.imm_data

    def __repr__(self) -> str:
        return (f"WC(wr_id={self.wr_id}, status={_name(self.status)}, opcode={_name(self.opcode)}, "
                f"byte_len={self.byte_len}, qp_num={self.qp_num}, src_qp={self.src_qp}, imm_data={self.imm_data}, "
                f"wc_flags={_name(self.wc_flags)})")


def _decode(ring: shm.Ring, n: int) -> list[WC]:
    """The Python path of ``poll``: WCs for the next ``n`` CQEs of ``ring``."""
    buf = ring.buf
    unpack = shm.CQE.unpack_from
    out = []
    for i in range(n):
        wr_id, status, opcode, vendor_err, byte_len, imm_data, qp_num, src_qp, wc_flags = unpack(
            buf, ring.slot_offset(i))
        out.append(WC(wr_id, status, opcode, vendor_err, byte_len, qp_num, src_qp, imm_data, wc_flags))
    return out


def _name(value: Any) -> str:
    """An enum member's name (flags joined by ``|``, none as ``0``); any other value as a number."""
    name = getattr(value, "name", None)
    return name if name else str(int(value))


#: the compiled WC builder, or None (the Python path alone)
_fast = _load_fastpath()
if _fast is not None:
    _fast.setup_wc(WC, WC.__slots__, _STATUS, _OPCODE, _FLAGS)


class CompChannel(Resource):
    """A completion event channel (``ibv_comp_channel``)."""

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        rep, fds = ctx.call(Op.CREATE_COMP_CHANNEL)
        if len(fds) != 1:
            _close_all(fds)
            raise VerbsError("channel without its eventfd", errno.EPROTO)
        self.ctx = ctx
        self.handle = rep.channel_handle
        self.fd = fds[0]
        self.cqs: list[CQ] = []
        ctx._adopt(self)

    def _fired(self, expected: "CQ | None") -> "CQ | None":
        for cq in ([expected] if expected is not None else self.cqs):
            hdr = cq._ring.hdr
            if hdr.event_pending:
                hdr.event_pending = 0
                return cq
        return None

    def get_cq_event(self, expected_cq: "CQ | None" = None, timeout: float | None = 10.0) -> "CQ":
        """Wait until a CQ of this channel (armed by ``req_notify``) gets a completion.

        Returns the CQ that fired.

        Raises:
            TimeoutError: nothing within ``timeout`` seconds.
        """
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            cq = self._fired(expected_cq)
            if cq is not None:
                return cq
            left = RECHECK_S * 10 if deadline is None else min(RECHECK_S * 10, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError("no completion event")
            r, _, _ = select.select([self.fd], [], [], left)
            if r:
                _drain_eventfd(self.fd)
            else:
                self.ctx._check_alive("get_cq_event")  # a quiet while: is the daemon still there?

    async def get_cq_event_async(self, expected_cq: "CQ | None" = None, timeout: float | None = None) -> "CQ":
        """trio flavour of ``get_cq_event`` (cancellable; ``timeout`` raises trio.TooSlowError)."""
        import trio

        self._check_open()
        with trio.fail_after(timeout if timeout is not None else float("inf")):
            while True:
                cq = self._fired(expected_cq)
                if cq is not None:
                    return cq
                with trio.move_on_after(RECHECK_S * 10) as quiet:
                    await trio.lowlevel.wait_readable(self.fd)
                    _drain_eventfd(self.fd)
                if quiet.cancelled_caught:
                    self.ctx._check_alive("get_cq_event_async")

    def _release(self) -> None:
        for cq in list(self.cqs):
            cq.close()
        try:
            if not self.ctx._closed:
                self.ctx.call(Op.DESTROY_COMP_CHANNEL, channel_handle=self.handle)
        finally:
            _close_all([self.fd])


class CQ(Resource):
    """A completion queue (``CQ(ctx, cqe, cq_context=None, channel=None, comp_vector=0)``)."""

    _empty_polls = 0  # empty polls since poll last looked whether the daemon is gone

    def __init__(self, ctx: Context, cqe: int, cq_context: Any = None, channel: CompChannel | None = None,
                 comp_vector: int = 0) -> None:
        super().__init__()
        rep, fds = ctx.call(Op.CREATE_CQ, cqe=cqe, channel_handle=channel.handle if channel else 0,
                            comp_vector=comp_vector)
        if len(fds) != 2:
            _close_all(fds)
            raise VerbsError("CQ without its memory and eventfd", errno.EPROTO)
        fd, self.fd = fds
        try:
            self._mm = mmap.mmap(fd, shm.page_round(shm.ring_bytes(rep.entries, shm.CQE_SIZE)))
        finally:
            os.close(fd)
        self._ring = shm.Ring(self._mm, 0, "struct uv_cqe", rep.entries)
        # The consumer index is private to this process and moved by
        # read-modify-write: polls from several threads take turns, so that
        # each completion goes to one of them.
        self._lock = threading.Lock()
        self.ctx = ctx
        self.handle = rep.cq_handle
        self.cqe = rep.cqe
        self.cq_context = cq_context
        self.channel = channel
        self.comp_vector = comp_vector
        self._qps: list[Any] = []
        if channel is not None:
            channel.cqs.append(self)
        ctx._adopt(self)

    # -- data path (no syscalls) --------------------------------------------------
    def poll(self, num_entries: int = 1) -> tuple[int, list[WC]]:
        """Take up to ``num_entries`` completions.  Returns ``(npolled, [WC])``.

        Raises:
            UserError: ``num_entries`` is negative (taking -1 would move the
                ring's consumer back and deliver old completions again).
            VerbsError: ENODEV: the CQ is empty and the daemon is gone, so
                nothing more will come (looked at once every
                ``EMPTY_POLLS`` empty polls).
        """
        if num_entries < 0:
            raise UserError(f"poll(num_entries={num_entries}): a count is not negative")
        ring = self._ring
        n = 0
        out: list[WC] = []
        # Empty (the producer index where this process's consumer index is):
        # nothing to take, and no lock to take either.
        if ring.hdr.producer != ring.cons:
            lock = self._lock
            lock.acquire()
            try:
                n = min(ring.available(), num_entries)
                if n:
                    out = _fast.poll(ring.slots_addr, ring.cons, ring.mask, n) if _fast else _decode(ring, n)
                    ring.pop(n)
            finally:
                lock.release()
        if not n and num_entries:
            # Nothing there: now and then (one system call per EMPTY_POLLS
            # empty polls) look whether the daemon is gone, so that a
            # busy-polling loop ends instead of spinning for ever.
            e = self._empty_polls = self._empty_polls + 1
            if e >= EMPTY_POLLS:
                self._empty_polls = 0
                self.ctx._check_alive("poll")
        return n, out

    def req_notify(self, solicited_only: bool = False) -> None:
        """Arm the CQ: the next completion signals the CQ's (or its channel's) eventfd."""
        hdr = self._ring.hdr
        hdr.solicited_only = 1 if solicited_only else 0
        hdr.armed = 1

    def ack_events(self, num_events: int) -> None:
        """Compatibility with ``ibv_ack_cq_events``; nothing to release here."""

    @property
    def overrun(self) -> bool:
        """True once the daemon found this CQ full (IBV_EVENT_CQ_ERR was raised)."""
        return bool(self._ring.hdr.overrun)

    # -- waiting -------------------------------------------------------------------
    def wait(self, timeout: float | None = 10.0, spin_s: float = SPIN_S) -> int:
        """Block until at least one completion is ready; return how many are.

        Spins ``spin_s`` first, then sleeps on the eventfd.

        Raises:
            TimeoutError: none within ``timeout`` seconds.
            VerbsError: ENODEV: none came and the daemon is gone (found
                within ``RECHECK_S`` of a quiet wait).
        """
        self._check_open()
        ring = self._ring
        n = ring.available()
        if n:
            return n
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        spin_end = now + spin_s
        while time.monotonic() < spin_end:
            n = ring.available()
            if n:
                return n
        while True:
            if self.channel is None:
                self.req_notify()
                shm.full_fence()  # armed must be visible before we look at the ring
            n = ring.available()
            if n:
                return n
            left = RECHECK_S if deadline is None else min(RECHECK_S, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"no completion on CQ {self.handle} within {timeout} s")
            if self.channel is None:
                r, _, _ = select.select([self.fd], [], [], left)
                if r:
                    _drain_eventfd(self.fd)
                    continue
            else:
                time.sleep(min(left, 0.001))
            self.ctx._check_alive("wait")  # a quiet while: nothing will come from a daemon that is gone

    async def wait_async(self, timeout: float | None = None) -> int:
        """trio flavour of ``wait``: returns the number of ready completions.

        Raises:
            trio.TooSlowError: none within ``timeout`` seconds.
        """
        import trio

        self._check_open()
        ring = self._ring
        with trio.fail_after(timeout if timeout is not None else float("inf")):
            while True:
                if self.channel is None:
                    self.req_notify()
                    shm.full_fence()
                n = ring.available()
                if n:
                    return n
                with trio.move_on_after(RECHECK_S) as quiet:
                    if self.channel is None:
                        await trio.lowlevel.wait_readable(self.fd)
                        _drain_eventfd(self.fd)
                    else:
                        await trio.sleep(0.001)
                if quiet.cancelled_caught or self.channel is not None:
                    self.ctx._check_alive("wait_async")

    def poll_blocking(self, num_entries: int = 1, timeout: float | None = 10.0, spin_s: float = SPIN_S) -> list[WC]:
        """Wait for and take exactly ``num_entries`` completions (a convenience for tests/tools).

        Raises:
            TimeoutError: fewer arrived within ``timeout`` seconds.
        """
        out: list[WC] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(out) < num_entries:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"{len(out)} of {num_entries} completions within {timeout} s")
            self.wait(left, spin_s)
            _, wcs = self.poll(num_entries - len(out))
            out += wcs
        return out

    async def poll_async(self, num_entries: int = 1, timeout: float | None = None) -> list[WC]:
        """trio flavour of ``poll_blocking``."""
        import trio

        out: list[WC] = []
        with trio.fail_after(timeout if timeout is not None else float("inf")):
            while len(out) < num_entries:
                await self.wait_async()
                _, wcs = self.poll(num_entries - len(out))
                out += wcs
        return out

    def _release(self) -> None:
        for qp in list(self._qps):
            qp.close()  # a QP completes into this CQ: it goes first
        try:
            if not self.ctx._closed:
                self.ctx.call(Op.DESTROY_CQ, cq_handle=self.handle)
        finally:
            if self.channel is not None and self in self.channel.cqs:
                self.channel.cqs.remove(self)
            self._ring.release()
            try:
                self._mm.close()
            except BufferError:
                pass
            _close_all([self.fd])
