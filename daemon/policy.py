"""When the data loop does what: sending as soon as it can, or in pass order.

A pass of the data loop receives, completes, pumps the QPs and flushes the
links, in that order.  Three things may happen earlier than that order
puts them, because a peer waits on them: a lone Read or atomic request the
compiled lane takes is answered while the pass is still receiving
(``eager_answers``); a ping-pong's message of several datagrams leaves as
soon as it is built (``eager_runs``; a message of one datagram always
does, ``PeerLink.send_alone``); and after such a datagram the daemon lets
the processes sharing its CPU run for a moment (``hand_over_s``) before its
own bookkeeping.  That is the default, :data:`EAGER`.

:data:`IN_PASS_ORDER` turns all three off: what a device sends is then a
function of what it received and of its clock alone, whichever lane
(compiled or Python) took the input, which is what a byte-for-byte
comparison of two devices, or a deterministic trace, needs.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

#: after a datagram sent alone, how long the daemon may let other processes
#: have its vCPU before its own bookkeeping: the peer's answer is a daemon
#: pass, an application turn and a pass away
HAND_OVER_S = 20e-6


@dataclass(frozen=True)
class LoopPolicy:
    """See the module docstring."""

    eager_answers: bool = True
    eager_runs: bool = True
    #: the longest hand-over (capped by the daemon's spin time; 0: none)
    hand_over_s: float = HAND_OVER_S
    #: what a hand-over times the other processes' turns with, and yields by
    turn_clock: Callable[[], float] = field(default=time.perf_counter)
    yield_cpu: Callable[[], None] = field(default=os.sched_yield)


EAGER = LoopPolicy()
IN_PASS_ORDER = LoopPolicy(eager_answers=False, eager_runs=False, hand_over_s=0.0)
