"""Misuse the daemon cannot see is refused by the library."""

from __future__ import annotations

import errno
import tempfile

import pytest

from udpverbs import verbs
from udpverbs.verbs.enums import IBV_QPT_RC

from ..integration.daemons import DaemonProc


def test_a_qp_with_a_cq_of_another_context_is_refused() -> None:
    # Handles are per daemon: CQ 1 of another device named CQ 1 of this one,
    # and the QP was created bound to it.
    with tempfile.TemporaryDirectory(prefix="udpverbs-m-") as d, \
            DaemonProc("uvM1", "127.0.0.11", d) as d1, DaemonProc("uvM2", "127.0.0.12", d) as d2:
        with verbs.Context(socket_path=d1.socket_path) as a, verbs.Context(socket_path=d2.socket_path) as b:
            pd, own, other = verbs.PD(a), verbs.CQ(a, 8), verbs.CQ(b, 8)
            for scq, rcq in ((other, own), (own, other)):
                with pytest.raises(verbs.VerbsError) as e:
                    verbs.QP(pd, verbs.QPInitAttr(qp_type=IBV_QPT_RC, scq=scq, rcq=rcq))
                assert e.value.error_code == errno.EINVAL and "another context" in str(e.value)
            with pytest.raises(verbs.UserError, match="out of range"):
                verbs.CQ(a, -5)  # was struct.error
            with pytest.raises(verbs.UserError, match="out of range"):
                verbs.QP(pd, verbs.QPInitAttr(qp_type=IBV_QPT_RC, scq=own, rcq=own, cap=verbs.QPCap(-1, 4, 1, 1)))
            verbs.QP(pd, verbs.QPInitAttr(qp_type=IBV_QPT_RC, scq=own, rcq=own))  # the right parents still work


def test_polling_a_negative_count_is_refused_and_the_ring_stays_as_it_was() -> None:
    with tempfile.TemporaryDirectory(prefix="udpverbs-m-") as d, DaemonProc("uvM3", "127.0.0.13", d) as dp:
        with verbs.Context(socket_path=dp.socket_path) as ctx:
            cq = verbs.CQ(ctx, 8)
            with pytest.raises(verbs.UserError, match="not negative"):
                cq.poll(-1)  # used to move the ring's consumer back: an old (here empty) slot came again
            assert cq.poll(8) == (0, [])
