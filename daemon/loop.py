"""The data loop: passes while there is work, a short spin, then one epoll sleep.

Theory of operation
-------------------
trio owns the daemon's tasks (control server, sessions, the connection
manager), but the data path is one tight loop, because waking a trio task
per event costs hundreds of microseconds (``docs/DESIGN.md``, "Facts
measured").  :meth:`DataLoop.run` calls the device's ``poll_once`` while it
finds work, letting the control plane in every 16 busy passes.

When a pass finds nothing to do the loop spins for at most ``spin_s``
(with ``os.sched_yield``; longer while our data is in flight, since its ACK
is due within a round trip and sleeping would add a CPU wake-up to it),
then sets ``need_wakeup`` in every client's context page, looks once more,
and sleeps in one epoll fd that holds the UDP socket, every client's
doorbell eventfd, the control sockets and an internal wake eventfd (for
control-path changes), until the next link deadline.  Applications write
their doorbell only when they see ``need_wakeup``, so a busy daemon costs
them no system call (io_uring's SQ_NEED_WAKEUP).  A periodic rescan
(``max_sleep_s``) is only a backstop, since both sides fence between their
store and their load of the other's flag; each rescan costs a wake-up.

The loop adds up the wall time of the passes that found work
(``data_busy_us`` among the counters): next to the process's CPU time,
which the spin inflates, it tells a daemon that is working from one that
is waiting (``udpverbs perf --cpu_util``).

:func:`hand_over` is what a pass does right after a datagram left alone
(a ping-pong's): it lets the processes that share our CPU run before the
rest of the pass, since the peer's application is likely next in line and
waiting for exactly that datagram.
"""

from __future__ import annotations

import collections
import os
import select
from typing import Any, Callable, Protocol

import trio
import trio.testing

from ..wire import shm
from .policy import LoopPolicy

#: when the idle loop arms the receive lane: after a sched_yield that took
#: longer than an idle application's turn (a couple of microseconds,
#: switches included), or after this many idle passes
ARM_AFTER_YIELD_S = 2.5e-6
ARM_AFTER_IDLE_PASSES = 4
#: a turn of another process's that did work, not just look: longer than
#: twice the shortest turn of the same hand-over by more than this
WORK_TURN_MARGIN_S = 0.5e-6
#: busy passes between two trio checkpoints (the control plane's turn)
BUSY_PASSES = 16


class LoopHost(Protocol):
    """What the data loop drives: the device."""

    now: float
    busy_s: float
    sessions: set[Any]
    clock: Callable[[], float]

    def poll_once(self) -> bool:
        """One pass; True if it found work."""

    def awaiting_peer(self) -> bool:
        """Whether data of ours is in flight (an ACK is due soon)."""

    def next_deadline(self) -> float:
        """When the next pass must run at the latest."""

    def arm_for_answer(self) -> None:
        """Set the receive lane up for what the last link that received expects next."""


def hand_over(policy: LoopPolicy, limit_s: float, readable: Callable[[], bool],
              stats: collections.Counter[str]) -> None:
    """Let the processes that share our CPU run until one of them has done
    some work, or until ``limit_s`` has passed when a yield returns (the
    scheduler decides when that is), or until the socket is ``readable``.

    With the applications on the other side's daemons' CPUs (``udpverbs
    perf --local`` places them so) the process next to us is the peer's
    application, and what it waits for is the datagram we just sent, placed
    by its daemon a few microseconds from now.  Its answer is a turn of its
    own and a pass of its daemon's away, time enough for our bookkeeping.
    A turn in which the other process found nothing to do is short (a
    couple of microseconds); the turn in which it took our data and
    answered is longer, and ends the hand-over.  A yield that returns at
    once does not: the scheduler does not pick a process that has had more
    than its share, which a spinning application often has.
    """
    clock = policy.turn_clock
    yield_cpu = policy.yield_cpu
    start = clock()
    shortest, longest = 1.0, 0.0
    while True:
        t0 = clock()
        yield_cpu()
        t1 = clock()
        turn = t1 - t0
        if turn < shortest:
            shortest = turn
        if turn > longest:
            longest = turn
        if longest > 2 * shortest + WORK_TURN_MARGIN_S:
            stats["hand_over_answered"] += 1
            return
        if t1 - start > limit_s or readable():
            return


class DataLoop:
    """The loop, its epoll and its wake-ups (see the module docstring)."""

    def __init__(self, host: LoopHost, spin_s: float, max_sleep_s: float) -> None:
        self.host = host
        self.spin_s = spin_s
        #: the spin while our data is in flight (its ACK is due soon)
        self.inflight_spin_s = max(spin_s, 0.002) if spin_s > 0 else 0.0
        self.max_sleep_s = max_sleep_s
        self.epoll = select.epoll()
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.epoll.register(self.wake_fd, select.EPOLLIN)
        self.doorbells: set[int] = set()
        self._watched: set[int] = set()
        #: the control sockets alone, looked at while spinning: a request
        #: (a group's lock or barrier waits on it) must not wait out the spin
        self.control = select.epoll()
        #: control sockets this loop reads itself (a group's connection, see
        #: :meth:`serve_here`): fd -> what reads and answers it
        self.served: dict[int, Callable[[], None]] = {}
        self.sleeping = False

    def close(self) -> None:
        """Close the epoll fd and the wake eventfd."""
        self.epoll.close()
        self.control.close()
        os.close(self.wake_fd)

    # -- what wakes the loop --------------------------------------------------------
    def wake(self) -> None:
        """Make the loop look again (after a control-path change)."""
        if self.sleeping:
            try:
                os.eventfd_write(self.wake_fd, 1)
            except OSError:
                pass

    def add_socket(self, fd: int) -> None:
        """Wake on the UDP socket ``fd``."""
        self.epoll.register(fd, select.EPOLLIN)

    def add_doorbell(self, fd: int) -> None:
        """Wake on a client's doorbell eventfd."""
        self.epoll.register(fd, select.EPOLLIN)
        self.doorbells.add(fd)

    def remove_doorbell(self, fd: int) -> None:
        """Stop waking on a client's doorbell (before the fd is closed)."""
        if fd in self.doorbells:
            self.doorbells.discard(fd)
            try:
                self.epoll.unregister(fd)
            except OSError:
                pass

    def watch(self, fd: int) -> None:
        """Wake the loop when ``fd`` (a control socket trio owns) becomes readable."""
        self.epoll.register(fd, select.EPOLLIN | select.EPOLLRDHUP)
        self.control.register(fd, select.EPOLLIN | select.EPOLLRDHUP)
        self._watched.add(fd)

    def serve_here(self, fd: int, serve: Callable[[], None]) -> None:
        """Read the watched control socket ``fd`` here, with ``serve()``,
        whenever it is readable, instead of waking trio for it: a group's
        requests are answered within the pass that sees them."""
        self.served[fd] = serve

    def stop_serving(self, fd: int) -> None:
        """``fd`` is at its end: leave it to its trio task again (which unwatches it)."""
        if self.served.pop(fd, None) is not None:
            try:
                self.control.unregister(fd)
            except OSError:
                pass

    def _control_ready(self) -> bool:
        """Serve the ready sockets read here; True if one trio must read is ready."""
        for_trio = False
        for fd, _ in self.control.poll(0):
            serve = self.served.get(fd)
            if serve is None:
                for_trio = True
            else:
                serve()
        return for_trio

    def unwatch(self, fd: int) -> None:
        """Stop watching ``fd``; call before the fd is closed."""
        self.served.pop(fd, None)
        if fd in self._watched:
            self._watched.discard(fd)
            for ep in (self.epoll, self.control):
                try:
                    ep.unregister(fd)
                except OSError:
                    pass

    # -- the loop ---------------------------------------------------------------------
    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The data-path loop (see the module docstring).  Runs until cancelled."""
        host = self.host
        # trio's clock, read without trio.current_time()'s run-context lookup
        # (it is read several times a pass)
        host.clock = trio.lowlevel.current_clock().current_time
        task_status.started()
        busy = 0
        clock = host.clock
        poll_once = host.poll_once
        while True:
            t0 = clock()
            if poll_once():
                host.busy_s += clock() - t0
                busy += 1
                if busy >= BUSY_PASSES:
                    busy = 0
                    if self.served:
                        self._control_ready()
                    await trio.lowlevel.checkpoint()  # let the control plane in
                continue
            if self._spin():
                continue
            await self._sleep()

    def _spin(self) -> bool:
        """Spin a little after an idle pass (a doorbell or datagram usually
        follows soon); True if a pass found work."""
        host = self.host
        clock = host.clock
        spin_end = host.now + (self.inflight_spin_s if host.awaiting_peer() else self.spin_s)
        idle = 0
        control = self.control.poll
        while clock() < spin_end:
            if control(0):
                if self._control_ready():
                    return False  # to the sleep step, which lets trio serve the request first
                return True
            t0 = clock()
            os.sched_yield()
            t1 = clock()
            if host.poll_once():
                host.busy_s += clock() - t1
                return True
            idle += 1
            if t1 - t0 > ARM_AFTER_YIELD_S or idle == ARM_AFTER_IDLE_PASSES:
                # Arm while nobody waits on us.  With our applications on
                # other CPUs (``udpverbs perf --local`` pins each daemon
                # where the other side's application runs), the end of a
                # pass is not such a time: the application sharing our CPU
                # may be about to see what our peer placed.  A long yield
                # is: it ran a turn with work in it (in a ping-pong, its
                # next message posted), and waits a hop now.  On a CPU of
                # our own, a few idle passes are.
                host.arm_for_answer()
        return False

    async def _sleep(self) -> None:
        host = self.host
        for sess in host.sessions:
            sess.set_need_wakeup(1)
        self.sleeping = True
        shm.full_fence()  # need_wakeup must be visible before we look at the rings once more
        try:
            work = host.poll_once()
            if not self._control_ready() and work:
                return
            # Let every other trio task (control plane) run until all are blocked.
            # A bare checkpoint is not enough: a task woken in the same scheduler
            # batch as us is neither runnable-counted nor run yet, and it may hold
            # a request already read from its socket, which our epoll cannot see.
            await trio.testing.wait_all_tasks_blocked()
            if host.poll_once():
                return
            stats = trio.lowlevel.current_statistics()
            timeout = min(host.next_deadline() - trio.current_time(), stats.seconds_to_next_deadline)
            if timeout < 0.002:
                return  # epoll_wait counts whole milliseconds: keep spinning for a deadline this close
            # Block in our own epoll, not through trio: a trio wake-up per event
            # costs far more than a direct epoll_wait.  The epoll also watches
            # the control sockets (``watch``), so a client request wakes us and
            # the checkpoint above lets trio serve it; trio timers are honoured
            # through seconds_to_next_deadline.
            fired = self.epoll.poll(timeout - 0.001)  # rounded up to ms by epoll_wait: wake no later than due
            if any(fd in self.served for fd, _ in fired):
                self._control_ready()
            if any(fd in self._watched and fd not in self.served for fd, _ in fired):
                # A client's request (a group's lock or barrier is one, and
                # waits on this answer): serve it now, not after a spin.
                await trio.testing.wait_all_tasks_blocked()
        finally:
            self.sleeping = False
            for sess in host.sessions:
                sess.set_need_wakeup(0)
            # Consume the eventfd counts so the epoll fd stops being readable.
            for fd, _ in self.epoll.poll(0):
                if fd == self.wake_fd or fd in self.doorbells:
                    try:
                        os.eventfd_read(fd)
                    except OSError:
                        pass
