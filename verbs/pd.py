"""Protection domains and memory regions (``ibv_alloc_pd``, ``ibv_reg_mr``).

Theory of operation
-------------------
An MR's memory is a memfd the library creates, maps, and hands to the daemon
(SCM_RIGHTS), which maps the same pages: what the application writes through
``mr.mv`` the daemon sends, and what the daemon places arrives in ``mr.mv``
with no copy across processes.  ``mr.buf`` is the mapping's virtual address
in this process: it is what SGEs and a peer's ``remote_addr`` name, exactly
as with a hardware RNIC (tagged offsets are virtual addresses unless the MR
is registered ZERO_BASED).  ``lkey`` and ``rkey`` are the same STag.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

from ..wire import shm
from ..wire.ctl import Op
from .device import Context, Resource
from .errors import UserError


class PD(Resource):
    """A protection domain (``PD(ctx)``)."""

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        rep, _ = ctx.call(Op.ALLOC_PD)
        self.ctx = ctx
        self.handle = rep.pd_handle
        ctx._adopt(self)

    def _release(self) -> None:
        if not self.ctx._closed:
            self.ctx.call(Op.DEALLOC_PD, pd_handle=self.handle)


class MR(Resource):
    """A registered memory region (``MR(pd, length, access)``).

    Attributes: ``buf`` (address for SGEs and remote_addr), ``lkey``,
    ``rkey``, ``length``, ``mv`` (a writable memoryview of the region: any
    buffer-protocol consumer sees the region's memory itself, e.g.
    ``numpy.frombuffer(mr.mv, dtype)``; ``ndarray`` does that for you).
    """

    def __init__(self, pd: PD, length: int, access: int, address: Any = None, implicit: bool = False) -> None:
        super().__init__()
        if address is not None or implicit:
            raise UserError("udpverbs MRs own their memory: address/implicit registration is not supported")
        if length < 0:
            raise UserError("length must be >= 0")
        size = shm.page_round(length)
        fd = os.memfd_create("uv-mr", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
            cbuf = shm.ffi.from_buffer(self._mm)
            self.buf = int(shm.ffi.cast("uintptr_t", cbuf))
            shm.ffi.release(cbuf)
            try:
                rep, _ = pd.ctx.call(Op.REG_MR, fds=[fd], pd_handle=pd.handle, access=int(access),
                                     length=length, addr=self.buf)
            except BaseException:
                self._mm.close()
                raise
        finally:
            os.close(fd)
        self.pd = pd
        self.length = length
        self.access = int(access)
        self.handle = rep.mr_handle
        self.lkey = rep.lkey
        self.rkey = rep.rkey
        self.mv = memoryview(self._mm)[:length]
        pd._adopt(self)

    def read(self, length: int, offset: int) -> bytes:
        """``length`` bytes of the region from ``offset``."""
        self._check_open()
        if offset < 0 or length < 0 or offset + length > self.length:
            raise UserError("read outside the region")
        return bytes(self.mv[offset:offset + length])

    def write(self, data: bytes | bytearray | memoryview | str, length: int | None = None, offset: int = 0) -> None:
        """Copy ``data`` (its first ``length`` bytes) into the region at ``offset``."""
        self._check_open()
        if isinstance(data, str):
            data = data.encode()
        n = len(data) if length is None else length
        if offset < 0 or n < 0 or n > len(data) or offset + n > self.length:
            raise UserError("write outside the region")
        self.mv[offset:offset + n] = memoryview(data)[:n]

    def ndarray(self, dtype: Any = "uint8", shape: int | tuple[int, ...] | None = None, offset: int = 0) -> Any:
        """The region's memory as a numpy array, without a copy.

        Takes a numpy ``dtype``, a ``shape`` (default: as many items as fit
        from ``offset`` to the end of the region) and a byte ``offset``.
        Returns a writable array whose items are the region's bytes: what
        the application writes in it a peer reads, what a peer writes shows
        in it.  The array stays valid after the MR is closed (the memory
        stays mapped while the array lives), but is then no longer
        registered.

        Raises:
            UserError: numpy is not installed (``pip install numpy``; it is
                no dependency of udpverbs), or ``shape`` and ``dtype`` from
                ``offset`` do not fit in the region.
        """
        self._check_open()
        try:
            import numpy as np
        except ImportError:
            raise UserError("MR.ndarray needs numpy, which udpverbs does not install: pip install numpy "
                            "(mr.mv is the region as a memoryview without it)") from None
        dt = np.dtype(dtype)
        if shape is None:
            shape = (max(0, self.length - offset) // dt.itemsize,) if dt.itemsize else (0,)
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
        if offset < 0 or min(dims, default=0) < 0 or offset + nbytes > self.length:
            raise UserError(f"an array of shape {dims} of {dt} at offset {offset} does not fit in the "
                            f"region's {self.length} bytes")
        return np.frombuffer(self.mv[offset:offset + nbytes], dtype=dt).reshape(dims)

    def _release(self) -> None:
        try:
            if not self.pd.ctx._closed:
                self.pd.ctx.call(Op.DEREG_MR, mr_handle=self.handle)
        finally:
            self.mv.release()
            try:
                self._mm.close()
            except BufferError:
                pass  # the caller still holds a view (e.g. numpy); unmapped when it goes
