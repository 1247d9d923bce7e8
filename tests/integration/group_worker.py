"""One rank of the process-group tests.

Run as ``python -m tests.integration.group_worker SOCKET GROUP RANK MEMBERS MODE [ARGS…]``
(MEMBERS as ``udpverbs run`` formats them).  Every line it prints starts with
a word the test reads; times are ``time.monotonic()`` (one clock for every
process on the host).  Modes:

* ``barriers ALGORITHM COUNT REGION``: COUNT barriers; before barrier g the
  rank writes g into its 8-byte slot of the file REGION, after it checks that
  every rank's slot is at least g (nobody left g before everyone entered).
* ``hold LOCK``: take the lock, say ``held``, then wait to be killed.
* ``wait_lock LOCK``: say ``ready``, read one line, wait for the lock (expecting a
  GroupError), then take it again and release it.
* ``barrier_on_go``: say ``ready``, read one line, then enter a barrier
  (expecting a GroupError), then read one more line before leaving.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import time

from udpverbs import verbs
from udpverbs.verbs.group import parse_members


def say(*words: object) -> None:
    print(*words, flush=True)


def main() -> int:
    sock, name, rank_s, members_s, mode, *args = sys.argv[1:]
    rank = int(rank_s)
    members = parse_members(members_s)
    with verbs.Context(socket_path=sock) as ctx:
        g = verbs.Group(ctx, name, rank, members)
        say("joined", rank)
        if mode == "barriers":
            alg, count, region = args[0], int(args[1]), args[2]
            with open(region, "r+b") as f:
                mm = mmap.mmap(f.fileno(), 8 * g.size)
            # One aligned 8-byte store or load per slot (struct.pack_into
            # zeroes its target before it writes: a reader could see 0).
            slots = (ctypes.c_int64 * g.size).from_buffer(mm)
            for gen in range(1, count + 1):
                slots[rank] = gen
                got = g.barrier(alg)
                if got != gen:
                    say("wrong_generation", got, gen)
                    return 1
                seen = list(slots)
                if min(seen) < gen:
                    say("early", gen, seen.index(min(seen)), min(seen))
                    return 1
            del slots
            say("done", count)
        elif mode == "hold":
            g.acquire(int(args[0]))
            say("held", time.monotonic())
            time.sleep(120)
        elif mode == "wait_lock":
            lock = int(args[0])
            say("ready")
            sys.stdin.readline()
            try:
                g.acquire(lock)
                say("granted_unexpectedly")
                return 1
            except verbs.GroupError as e:
                say("group_error", e.rank, time.monotonic())
            with g.lock(lock):
                say("reacquired", time.monotonic())
        elif mode == "barrier_on_go":
            say("ready")
            sys.stdin.readline()
            t0 = time.monotonic()
            try:
                g.barrier()
                say("released_unexpectedly")
                return 1
            except verbs.GroupError as e:
                say("group_error", e.rank, time.monotonic(), t0)
            sys.stdin.readline()  # stay a member until told: our leaving is news too
        else:
            say("unknown_mode", mode)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
