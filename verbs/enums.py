"""libibverbs constants under their C names and values (as ``pyverbs.libibverbs_enums``).

The values are defined once, in ``wire/shm.py``, because the same numbers
travel in the shared-memory WQEs and CQEs; this module flattens them into
module-level names so code reads like pyverbs:
``from udpverbs.verbs.enums import IBV_WR_RDMA_WRITE``.
"""

from __future__ import annotations

from ..wire.shm import (
    AccessFlags,
    AtomicCap,
    EventType,
    QPAttrMask,
    QPState,
    QPType,
    SendFlags,
    SrqAttrMask,
    WcFlags,
    WcOpcode,
    WcStatus,
    WrOpcode,
)

_ENUMS = (AccessFlags, AtomicCap, EventType, QPAttrMask, QPState, QPType, SendFlags, SrqAttrMask, WcFlags, WcOpcode, WcStatus, WrOpcode)

for _e in _ENUMS:
    for _m in _e:
        globals()[_m.name] = int(_m)

# Port and MTU constants of ibv_port_attr (verbs.h).
IBV_PORT_NOP = 0
IBV_PORT_DOWN = 1
IBV_PORT_INIT = 2
IBV_PORT_ARMED = 3
IBV_PORT_ACTIVE = 4
IBV_MTU_256 = 1
IBV_MTU_512 = 2
IBV_MTU_1024 = 3
IBV_MTU_2048 = 4
IBV_MTU_4096 = 5
IBV_LINK_LAYER_ETHERNET = 2
IBV_TRANSPORT_IWARP = 1
IBV_NODE_RNIC = 4

__all__ = [m.name for e in _ENUMS for m in e] + [
    "IBV_PORT_NOP", "IBV_PORT_DOWN", "IBV_PORT_INIT", "IBV_PORT_ARMED", "IBV_PORT_ACTIVE",
    "IBV_MTU_256", "IBV_MTU_512", "IBV_MTU_1024", "IBV_MTU_2048", "IBV_MTU_4096",
    "IBV_LINK_LAYER_ETHERNET", "IBV_TRANSPORT_IWARP", "IBV_NODE_RNIC",
    "AccessFlags", "EventType", "QPAttrMask", "QPState", "QPType", "SendFlags", "WcFlags", "WcOpcode",
    "WcStatus", "WrOpcode",
]
