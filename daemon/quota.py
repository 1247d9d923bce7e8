"""Per-client quotas: one greedy application cannot deny service to another.

Theory of operation
-------------------
A client is a process (the pid SO_PEERCRED names): all the control
connections of one process share one budget, since the connection manager
and process groups open more than one.  What it may hold at once: QPs, CQs,
MRs, bytes of registered memory, and file descriptors of the daemon's — the
resource that used to run out first (issue 41: the daemon died at the 48th
context under ``--nofile=256``).  Every fd-holding object costs what the
daemon keeps open for it (``FD_COST``), and a client may hold at most
``fd_share`` of the daemon's fd limit, so others keep the rest.  A request
beyond a quota is refused with ENOMEM, as a real RNIC refuses what its
tables cannot hold; usage is counted from the sessions' own sets, so it
cannot drift from what is really held.
"""

from __future__ import annotations

import errno
import resource
from dataclasses import dataclass, fields
from typing import Any, Iterable

from .tables import TableError

#: the errnos of running out of a system resource: an error to the client
#: that asked, never an exit of the daemon
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS, errno.ENOSPC})

#: file descriptors the daemon holds per object (a mapping holds a dup of
#: its memfd: CPython's mmap keeps one): a context has its socket, its page's
#: memfd and mapping, doorbell and async eventfds; a CQ its ring and eventfd
FD_COST = {"context": 5, "mr": 1, "cq": 3, "qp": 2, "srq": 2, "channel": 1}


@dataclass
class Quota:
    """What one client may hold at once (``--quota KEY=VALUE``, TOML ``[quota]``)."""

    qp: int = 1024
    cq: int = 1024
    mr: int = 4096
    mr_bytes: int = 1 << 38  # 256 GiB of mappings
    fd_share: float = 0.25  # of the daemon's soft RLIMIT_NOFILE

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> "Quota":
        """Build from ``{key: value}`` (strings from flags, numbers from TOML).

        Raises: ValueError for an unknown key or a value out of range.
        """
        q = cls()
        known = {f.name: f.type for f in fields(cls)}
        for key, value in settings.items():
            if key not in known:
                raise ValueError(f"unknown quota {key!r}; have {', '.join(known)}")
            try:
                v: float = float(value) if key == "fd_share" else int(value)
            except (TypeError, ValueError):
                raise ValueError(f"quota {key}: not a number: {value!r}") from None
            if v <= 0 or (key == "fd_share" and v > 1):
                raise ValueError(f"quota {key} must be above 0{' and at most 1' if key == 'fd_share' else ''}")
            setattr(q, key, v)
        return q

    def fd_limit(self) -> int:
        """The fds one client may make the daemon hold."""
        return int(resource.getrlimit(resource.RLIMIT_NOFILE)[0] * self.fd_share)


def client_fds(sessions: Iterable[Any]) -> int:
    """The daemon's fds that these sessions (one client's) hold."""
    return sum(FD_COST["context"] + FD_COST["mr"] * len(s.mrs) + FD_COST["cq"] * len(s.cqs)
               + FD_COST["qp"] * len(s.qps) + FD_COST["srq"] * len(s.srqs) + FD_COST["channel"] * len(s.channels)
               for s in sessions)


def check(quota: Quota, sessions: list[Any], kind: str, nbytes: int = 0) -> None:
    """Refuse one more ``kind`` (context, qp, cq, mr, srq, channel) for the
    client owning ``sessions`` if a quota would be exceeded.

    Raises: TableError(ENOMEM) naming the quota.
    """
    counts = {"qp": lambda s: len(s.qps), "cq": lambda s: len(s.cqs), "mr": lambda s: len(s.mrs)}
    if kind in counts:
        held = sum(counts[kind](s) for s in sessions)
        if held + 1 > getattr(quota, kind):
            raise TableError(errno.ENOMEM, f"per-client quota: {getattr(quota, kind)} {kind.upper()}s")
    if nbytes:
        held_bytes = sum(s.mr_bytes for s in sessions)
        if held_bytes + nbytes > quota.mr_bytes:
            raise TableError(errno.ENOMEM, f"per-client quota: {quota.mr_bytes} bytes of registered memory")
    limit = quota.fd_limit()
    if client_fds(sessions) + FD_COST[kind] > limit:
        raise TableError(errno.ENOMEM, f"per-client quota: {limit} of the daemon's file descriptors")


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard one; returns (soft, hard) now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft, hard
