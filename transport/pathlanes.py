"""The compiled lanes on a multi-path link: runs framed per path, runs received per path (sans-IO).

Theory of operation
-------------------
A single-path link frames a run queued by ``Link.send_run`` in one
compiled call (``builder.py``'s ``_frame_run``) and lets its owner take a
run of in-order DATA itself (``run_receivable`` / ``data_run_received``).
Several paths change neither lane, only who decides.

Sending: the scheduler (``scheduler.py``) names, packet by packet, the
usable path of lowest RTT with room, so the packets that follow one
another on a path are a contiguous stretch of the stream: that path takes
packets until its window or its pacer says no, then the next path does.
:meth:`PathLanes._path_frame_run` gives the path the scheduler picked as
much of the queued run as it admits now (:func:`builder.admit`, with the
path's window, flight and pacer: the same float operations as the
scheduler's test packet by packet), records them in the path's flight as
the scheduler does, and frames them in place in one compiled call with
the path's id and its echo (the echo is per path, ``paths.py``).  They
leave as one :class:`builder.Burst` on that path.  The next packet goes
back to the scheduler, which picks the next path.  The bytes and the
state are those of the scheduler packet by packet (the clock read once
per stretch, as ``_frame_run`` reads it once per run).

Receiving: a run the owner takes on path ``p`` is what
``datagram_received(..., path=p)`` of each would have done, but the
path's bookkeeping runs once: its counters, the news that it is alive,
its echo (from the run's last timestamp), the ACK owed on it, and one RTT
sample from the run's ACK field.  Packet by packet, every packet arriving
on ``p`` is a sample of ``p``'s round trip; a run's packets were framed
in one call, so they echo one time, and one sample says what they all
would (a single-path link takes none from the packets that repeat an
ACK field).
"""

from __future__ import annotations

from typing import Any

from ..wire import link as wl
from .builder import Burst, admit, one_per_datagram
from .congestion.base import INF

_ACK_NOW = int(wl.LinkFlags.ACK_NOW)


class PathLanes:
    """The lanes' part of a multi-path link (a base of ``scheduler.Scheduler``;
    see the module docstring).  Reads the link's and the builder's state."""

    config: Any
    stats: Any
    recovery: Any
    framed_datagrams: int
    _runs: Any
    _next_n: int
    _want_ack_now: bool
    _where: dict[int, Any]
    _frame_packets: Any
    _last_heard: float
    _out: Any
    _mp_flat: Any
    _arrival: Any
    _arrived_on: Any

    def _path_frame_run(self, outs: dict[Any, list[Any]], p: Any, n: int, limit: int, now: float, clock: Any,
                        ack: int, rwnd: int) -> tuple[int, int]:
        """First transmission, on path ``p`` (the scheduler's pick for message
        ``n``), of messages ``n``, ``n + 1``, ... if they are in a queued
        run: as many as ``p`` admits now, framed in one compiled call into
        one Burst appended to ``outs[p]``.  Returns how many and their
        bytes; 0: the scheduler's own code sends message ``n``."""
        runs = self._runs
        while runs and runs[0][1] <= n:
            runs.popleft()  # wholly transmitted
        if not runs or runs[0][0] > n:
            return 0, 0
        n0, end, buf, stride, last_len, built = runs[0]
        if end > limit:
            end = limit
            last_len = stride  # the batch's last message may be shorter, not this part's
        m = end - n
        full = stride + wl.OVERHEAD
        pacer = p.pacer
        rate = pacer.rate_Bps
        k, nxt, total = admit(m, full, last_len + wl.OVERHEAD, p.cc.cwnd_bytes, p.bytes_in_flight, rate,
                              pacer.next_send_s, pacer.floor(now) if rate != INF else 0.0, now)
        if not k:
            return 0, 0
        pacer.next_send_s = nxt
        self._path_flight(p, n, k, full, total - (k - 1) * full, now)
        first = (n - n0) * full  # the packets' places in buf (run_slots)
        t = clock() if clock is not None else now
        # ACK_NOW on the last message queued (as the scheduler sets it)
        self._frame_packets(buf, first, n, k, stride, total - (k - 1) * full - wl.OVERHEAD, t, ack, rwnd,
                            self._next_n - 1 - n, _ACK_NOW if self._want_ack_now else 0, built, p)
        if n + k >= self._next_n:
            self._want_ack_now = False
        self.framed_datagrams += k
        outs.setdefault(p, []).append(Burst(memoryview(buf)[first:first + total].toreadonly(), full))
        self.stats.datagrams_sent += k - 1  # bursts_by_path counts the Burst as one
        p.datagrams_sent += k - 1
        return k, total

    def _path_flight(self, p: Any, n: int, k: int, full: int, last: int, now: float) -> None:
        """Messages ``n`` .. ``n + k - 1`` left on ``p`` in packets of ``full``
        bytes, the last ``last``: in its flight, as the scheduler records each."""
        tx = p.tx_next
        flight, where = p.flight, self._where
        for i in range(k - 1):
            flight[n + i] = (tx + i, full, False, now)
            where[n + i] = p
        flight[n + k - 1] = (tx + k - 1, last, False, now)
        where[n + k - 1] = p
        p.tx_next = tx + k
        nbytes = (k - 1) * full + last
        p.bytes_in_flight += nbytes
        self.recovery.bytes_in_flight += nbytes

    def _mp_datagrams(self, now: float, clock: Any = None) -> list[Any]:
        """``datagrams_to_send`` while multi-path: ``bursts_by_path``'s
        datagrams, whatever their path, a Burst cut into its datagrams."""
        return one_per_datagram(self._mp_flat(now, clock))

    def _mp_data_run_received(self, count: int, ack: int, ts_us: int, ts_echo_us: int, rwnd: int, flags: int,
                              last_ts_us: int, last_rwnd: int, flags_any: int, now: float,
                              arrived: float | None = None, path: int = 0, size: int = 0) -> None:
        """``data_run_received`` while multi-path: the link's, the run having
        arrived on ``path`` (``size``: its bytes), and the path's
        bookkeeping once (see the module docstring)."""
        p = self._arrival(path, size)
        p.datagrams_received += count - 1
        heard = self._last_heard
        self._last_heard = -1.0  # set again if the run's ACK field is the peer's
        nout = len(self._out)
        type(self).data_run_received(self, count, ack, ts_us, ts_echo_us, rwnd, flags,  # type: ignore[attr-defined]
                                     last_ts_us, last_rwnd, flags_any, now, arrived)
        self._arrived_on(p, heard, nout, True, now)
