"""Shared receive queues (``ibv_create_srq``), pyverbs shapes.

An SRQ is one ring of receive WQEs in shared memory that every QP created
with ``QPInitAttr(srq=...)`` takes its receives from, in posting order:
many QPs, one receive pool.  A Send that finds the SRQ empty is NACKed and
re-sent like any receiver-not-ready Send (Modified ACK/NACK); posting to the
SRQ sends the waiting senders a RESUME.  ``srq_limit`` arms
IBV_EVENT_SRQ_LIMIT_REACHED (``ctx.get_async_event``), raised once when
fewer WQEs than the limit remain.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from typing import Any

from ..wire import shm
from ..wire.ctl import Op
from ..wire.shm import SrqAttrMask
from .device import Resource, _close_all
from .errors import VerbsError
from .pd import PD
from .qp import RecvWR, post_recv_ring


class SrqAttr:
    """``ibv_srq_attr``."""

    def __init__(self, max_wr: int = 100, max_sge: int = 1, srq_limit: int = 0) -> None:
        self.max_wr = max_wr
        self.max_sge = max_sge
        self.srq_limit = srq_limit


class SrqInitAttr:
    """``ibv_srq_init_attr``."""

    def __init__(self, attr: SrqAttr | None = None) -> None:
        self.attr = attr or SrqAttr()


class SRQ(Resource):
    """A shared receive queue (``SRQ(pd, SrqInitAttr(SrqAttr(max_wr, max_sge)))``)."""

    def __init__(self, pd: PD, init_attr: SrqInitAttr) -> None:
        super().__init__()
        a = init_attr.attr
        rep, fds = pd.ctx.call(Op.CREATE_SRQ, pd_handle=pd.handle, max_wr=a.max_wr, max_sge=a.max_sge,
                               srq_limit=a.srq_limit)
        if len(fds) != 1:
            _close_all(fds)
            raise VerbsError("SRQ without its ring", errno.EPROTO)
        try:
            self._mm = mmap.mmap(fds[0], shm.page_round(shm.ring_bytes(rep.max_wr, shm.RECV_WQE_SIZE)))
        finally:
            os.close(fds[0])
        self._ring = shm.Ring(self._mm, 0, "struct uv_recv_wqe", rep.max_wr)
        self._lock = threading.Lock()  # posts from several threads take turns (see QP)
        self.ctx = pd.ctx
        self.pd = pd
        self.handle = rep.srq_handle
        self.max_wr = rep.max_wr
        self.max_sge = rep.max_sge
        pd._adopt(self)

    def post_recv(self, wr: RecvWR, bad_wr: Any = None) -> None:
        """Post a chain of receive WRs to the pool.  Never blocks.

        Raises:
            VerbsError: EINVAL (too many SGEs), ENOMEM (the SRQ is full).
        """
        self._check_open()
        post_recv_ring(self.ctx, self._ring, self._lock, wr, self.max_sge)

    def modify(self, attr: SrqAttr, attr_mask: int) -> None:
        """``ibv_modify_srq``: (re-)arm the limit event.  Resizing (IBV_SRQ_MAX_WR) raises EINVAL."""
        self._check_open()
        self.ctx.call(Op.MODIFY_SRQ, srq_handle=self.handle, attr_mask=int(attr_mask), max_wr=attr.max_wr,
                      srq_limit=attr.srq_limit)

    def query(self) -> SrqAttr:
        """``ibv_query_srq``."""
        self._check_open()
        r, _ = self.ctx.call(Op.QUERY_SRQ, srq_handle=self.handle)
        return SrqAttr(r.max_wr, r.max_sge, r.srq_limit)

    def _release(self) -> None:
        try:
            if not self.ctx._closed:
                self.ctx.call(Op.DESTROY_SRQ, srq_handle=self.handle)
        finally:
            self._ring.release()
            try:
                self._mm.close()
            except BufferError:
                pass


__all__ = ["SRQ", "SrqAttr", "SrqInitAttr", "SrqAttrMask"]
