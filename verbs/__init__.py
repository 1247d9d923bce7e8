"""The udpverbs client library: pyverbs-shaped verbs over the local udpverbs daemon.

Code written for pyverbs reads the same::

    from udpverbs import verbs
    from udpverbs.verbs.enums import *
    with verbs.Context(name="uv0") as ctx:
        pd = verbs.PD(ctx)
        mr = verbs.MR(pd, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)
        cq = verbs.CQ(ctx, 64)
        qp = verbs.QP(pd, verbs.QPInitAttr(qp_type=IBV_QPT_RC, scq=cq, rcq=cq, cap=verbs.QPCap(16, 16)))
"""

from . import cm, enums
from .cm import CMListener, ConnParam, ConnRequest, connect, connect_async, disconnect
from .cq import CQ, WC, CompChannel
from .device import GID, AsyncEvent, Context, DeviceAttr, PortAttr, get_device_list
from .group import Group, GroupError
from .errors import ConnectionRejected, PyverbsRDMAError, PyverbsUserError, UserError, VerbsError
from .pd import MR, PD
from .qp import QP, SGE, AHAttr, GlobalRoute, QPAttr, QPCap, QPInitAttr, RecvWR, SendWR
from .srq import SRQ, SrqAttr, SrqInitAttr

__all__ = [
    "AHAttr", "AsyncEvent", "CMListener", "CQ", "CompChannel", "ConnParam", "ConnRequest", "ConnectionRejected", "Context",
    "DeviceAttr", "GID", "GlobalRoute", "Group", "GroupError", "MR", "PD", "PortAttr", "PyverbsRDMAError", "PyverbsUserError", "QP",
    "QPAttr", "QPCap", "QPInitAttr", "RecvWR", "SGE", "SRQ", "SendWR", "SrqAttr", "SrqInitAttr", "UserError", "VerbsError", "WC", "cm",
    "connect", "connect_async", "disconnect", "enums", "get_device_list",
]
