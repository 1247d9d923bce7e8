"""The udpverbs side of the benchmarks: perftest's tests over udpverbs.verbs.

Theory of operation
-------------------
Each side opens one set of resources (Context on its daemon, PD, a
registered buffer, CQ, RC QP), the two exchange QPN, rkey, buffer address
and daemon address over the control connection (perftest's out-of-band
exchange), and move their QPs to RTS.  Then, per message size:

* ``write_lat``: ping-pong of RDMA Writes.  Each side writes into the peer's
  buffer and spins on the last byte of its own buffer until the peer's write
  lands there; the client times the round trip.
* ``read_lat``: the client issues one RDMA Read of the server's buffer and
  waits for its completion; the server is passive.
* ``*_bw``: the client keeps ``tx_depth`` WRs outstanding and counts
  completions; the server is passive until the client says done.

Send and atomics need issue 4 in the library: until it has them, those
tests stop with :class:`VerbsUnavailable` and a clear message, never with a
made-up number.
"""

from __future__ import annotations

from typing import Any

#: What the benchmarks need from udpverbs.verbs.
REQUIRED = ("Context", "PD", "MR", "CQ", "QP", "QPInitAttr", "QPCap", "QPAttr", "SendWR", "SGE")


class VerbsUnavailable(Exception):
    """The verbs library (or the daemon) cannot run this test yet."""


def load_verbs() -> Any:
    """Import udpverbs.verbs and check it has what the benchmarks use.

    Returns: the module.
    Raises: VerbsUnavailable naming what is missing.
    """
    from udpverbs import verbs

    missing = [name for name in REQUIRED if not hasattr(verbs, name)]
    if missing:
        raise VerbsUnavailable(
            "the udpverbs verbs library does not provide "
            + ", ".join(missing)
            + " yet; to measure only the raw-UDP baseline, add --baseline raw-udp --baseline-only"
        )
    return verbs


def open_side(params: Any, ctrl: Any, *, is_client: bool, device: str | None) -> Any:
    """Open this side's udpverbs resources and connect them to the peer's.

    Raises: VerbsUnavailable if the library cannot run ``params.test``.
    """
    load_verbs()
    raise VerbsUnavailable(f"{params.test} over udpverbs is not wired up in the benchmark yet")


def daemon_command(ip: str) -> tuple[list[str], str]:
    """Return the command line starting a daemon on ``ip`` and the device name to use with it.

    Raises: VerbsUnavailable while the daemon has no command line.
    """
    raise VerbsUnavailable("the udpverbs daemon (python -m udpverbs.daemon) is not available yet")
