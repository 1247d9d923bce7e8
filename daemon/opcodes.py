"""The engine's opcode tables: RDMAP opcodes, verbs WR opcodes and access bits as plain ints.

The per-segment and per-WQE paths compare opcodes and test access bits many
times a message; ``IntEnum``/``IntFlag`` operators cost microseconds there,
so every module of the engine takes its constants from here as plain ints.
Names follow the RFCs (``OP_*``: RDMAP opcodes, RFC 5040 §4.3 and RFC 7306
§3) and libibverbs (``WR_*``, ``WC_*``).
"""

from __future__ import annotations

import sys

from ..wire import envelope, rdmap
from ..wire.rdmap import AtomicOp, Opcode
from ..wire.shm import AccessFlags as A, QPState as S, SendFlags, WcOpcode, WcStatus as W, WrOpcode
from . import tables

U32 = 0xFFFFFFFF
U64 = 0xFFFFFFFFFFFFFFFF
#: atomics operate on host-order words, as verbs applications expect
HOST_ORDER = sys.byteorder

# --- QP states a segment may be received in -----------------------------------
RECEIVING = (S.IBV_QPS_RTR, S.IBV_QPS_RTS, S.IBV_QPS_SQD)
RTS = int(S.IBV_QPS_RTS)
ERR = S.IBV_QPS_ERR

# --- RDMAP opcodes (RFC 5040 §4.3, RFC 7306 §3) ----------------------------------
OP_WRITE = int(Opcode.RDMA_WRITE)
OP_READ_REQUEST = int(Opcode.RDMA_READ_REQUEST)
OP_READ_RESPONSE = int(Opcode.RDMA_READ_RESPONSE)
OP_SEND_SE = int(Opcode.SEND_SE)
OP_ATOMIC_REQUEST = int(Opcode.ATOMIC_REQUEST)
OP_ATOMIC_RESPONSE = int(Opcode.ATOMIC_RESPONSE)
#: (invalidate, solicited) -> RDMAP opcode of a Send (RFC 5040 §5.3)
SEND_OPCODE = {(False, False): Opcode.SEND, (False, True): Opcode.SEND_SE,
               (True, False): Opcode.SEND_INVALIDATE, (True, True): Opcode.SEND_SE_INVALIDATE}
#: the messages of untagged queue 0, which need a posted receive
Q0_OPCODES = frozenset({Opcode.SEND, Opcode.SEND_SE, Opcode.SEND_INVALIDATE, Opcode.SEND_SE_INVALIDATE,
                        Opcode.IMMEDIATE_DATA, Opcode.IMMEDIATE_DATA_SE})
#: requests the responder's daemon answers by itself, with no application involved
ANSWERED_BY_DAEMON = frozenset({OP_READ_REQUEST, OP_ATOMIC_REQUEST})

# --- envelope flags -------------------------------------------------------------
IMM_FOLLOWS = int(envelope.Flags.IMM_FOLLOWS)
FLOW_ACK = int(envelope.Flags.FLOW_ACK)

# --- access rights (verbs) --------------------------------------------------------
REMOTE_WRITE = int(A.IBV_ACCESS_REMOTE_WRITE)
REMOTE_READ = int(A.IBV_ACCESS_REMOTE_READ)
REMOTE_ATOMIC = int(A.IBV_ACCESS_REMOTE_ATOMIC)
LOCAL_WRITE = int(A.IBV_ACCESS_LOCAL_WRITE)

# --- work requests (verbs) ----------------------------------------------------------
SEND_FENCE = int(SendFlags.IBV_SEND_FENCE)
SEND_SIGNALED = int(SendFlags.IBV_SEND_SIGNALED)
SEND_INLINE = int(SendFlags.IBV_SEND_INLINE)
SEND_SOLICITED = int(SendFlags.IBV_SEND_SOLICITED)
WR_READ = int(WrOpcode.IBV_WR_RDMA_READ)
WR_WRITE = int(WrOpcode.IBV_WR_RDMA_WRITE)
WR_WRITE_WITH_IMM = int(WrOpcode.IBV_WR_RDMA_WRITE_WITH_IMM)
WR_SEND_WITH_INV = int(WrOpcode.IBV_WR_SEND_WITH_INV)
WR_SEND_WITH_IMM = int(WrOpcode.IBV_WR_SEND_WITH_IMM)
SEND_WR = (WrOpcode.IBV_WR_SEND, WrOpcode.IBV_WR_SEND_WITH_IMM, WrOpcode.IBV_WR_SEND_WITH_INV)
ATOMIC_WR = {WrOpcode.IBV_WR_ATOMIC_FETCH_AND_ADD: AtomicOp.FETCH_ADD,
             WrOpcode.IBV_WR_ATOMIC_CMP_AND_SWP: AtomicOp.CMP_SWAP}
SUPPORTED_WR = (WrOpcode.IBV_WR_RDMA_WRITE, WrOpcode.IBV_WR_RDMA_WRITE_WITH_IMM, WrOpcode.IBV_WR_RDMA_READ,
                *SEND_WR, *ATOMIC_WR)
#: Sends that are one queue-0 message (with Immediate Data, two)
ONE_MESSAGE_SEND = (int(WrOpcode.IBV_WR_SEND), WR_SEND_WITH_INV)

# --- completions (verbs) ------------------------------------------------------------
WC_SUCCESS = int(W.IBV_WC_SUCCESS)
WC_RECV = int(WcOpcode.IBV_WC_RECV)
WC_SEND = int(WcOpcode.IBV_WC_SEND)
WC_RDMA_WRITE = int(WcOpcode.IBV_WC_RDMA_WRITE)
WC_RDMA_READ = int(WcOpcode.IBV_WC_RDMA_READ)
_WC_OF_WR = {
    WrOpcode.IBV_WR_RDMA_WRITE: WcOpcode.IBV_WC_RDMA_WRITE,
    WrOpcode.IBV_WR_RDMA_WRITE_WITH_IMM: WcOpcode.IBV_WC_RDMA_WRITE,
    WrOpcode.IBV_WR_SEND: WcOpcode.IBV_WC_SEND,
    WrOpcode.IBV_WR_SEND_WITH_IMM: WcOpcode.IBV_WC_SEND,
    WrOpcode.IBV_WR_RDMA_READ: WcOpcode.IBV_WC_RDMA_READ,
    WrOpcode.IBV_WR_ATOMIC_CMP_AND_SWP: WcOpcode.IBV_WC_COMP_SWAP,
    WrOpcode.IBV_WR_ATOMIC_FETCH_AND_ADD: WcOpcode.IBV_WC_FETCH_ADD,
}
_WC_OF_WR_INT = {int(k): int(v) for k, v in _WC_OF_WR.items()}


def wc_opcode(wr_opcode: int) -> int:
    """The completion opcode of a WR opcode (an unknown one completes as a Send)."""
    return _WC_OF_WR_INT.get(wr_opcode, WC_SEND)


def send_rdmap(opcode: int, flags: int, imm: int) -> tuple[int, int]:
    """The RDMAP opcode of a one-message Send WR (IBV_WR_SEND, or
    IBV_WR_SEND_WITH_INV with the STag in ``imm``) and the STag it
    invalidates (0: none)."""
    inv = opcode == WR_SEND_WITH_INV
    return SEND_OPCODE[inv, bool(flags & SEND_SOLICITED)], imm if inv else 0


#: tables check codes -> Terminate error code (RFC 5040 §7.2)
TERM_CODE = {
    tables.INVALID_STAG: rdmap.RdmapErrorCode.INVALID_STAG,
    tables.BOUNDS: rdmap.RdmapErrorCode.BASE_OR_BOUNDS_VIOLATION,
    tables.ACCESS: rdmap.RdmapErrorCode.ACCESS_RIGHTS_VIOLATION,
    tables.WRONG_PD: rdmap.RdmapErrorCode.STAG_NOT_ASSOCIATED_WITH_STREAM,
}
