"""The out-of-band control connection between the two sides of a benchmark.

Theory of operation
-------------------
perftest exchanges what each side needs (QP number, rkey, buffer address,
PSN) over a plain TCP socket before the test, and uses the same socket as a
barrier between phases.  We do the same: the server listens, the client
connects and sends the test parameters first, and from then on both sides
exchange small JSON objects, each framed by a 4-byte big-endian length.

Everything received is the peer's word and is checked where it is used;
a malformed frame raises :class:`ControlError`, as does a peer that goes
away or stays silent past the timeout.  Every receive takes a timeout, so a
dead peer can never hang a benchmark.
"""

from __future__ import annotations

import json
import select
import socket
import struct
import time
from typing import Any

_LEN = struct.Struct("!I")
#: Control frames carry parameters and QP attributes, never payload.
MAX_FRAME = 1 << 20
#: perftest's default port for the out-of-band exchange.
DEFAULT_PORT = 18515


class ControlError(Exception):
    """The control connection failed: peer gone, silent, or speaking nonsense."""


class ControlChannel:
    """One framed JSON connection to the peer (blocking, with timeouts).

    Takes: a connected TCP socket (ownership passes to the channel).
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = bytearray()

    # -- framing ------------------------------------------------------------
    def send(self, obj: dict[str, Any]) -> None:
        """Send one JSON object.

        Raises: ControlError if the peer is gone.
        """
        data = json.dumps(obj, separators=(",", ":")).encode()
        try:
            self.sock.sendall(_LEN.pack(len(data)) + data)
        except OSError as e:
            raise ControlError(f"control connection lost while sending: {e}") from e

    def _frame_ready(self) -> dict[str, Any] | None:
        if len(self._buf) < _LEN.size:
            return None
        (n,) = _LEN.unpack_from(self._buf)
        if n > MAX_FRAME:
            raise ControlError(f"control frame of {n} bytes exceeds {MAX_FRAME}")
        if len(self._buf) < _LEN.size + n:
            return None
        raw = bytes(self._buf[_LEN.size : _LEN.size + n])
        del self._buf[: _LEN.size + n]
        try:
            obj = json.loads(raw)
        except ValueError as e:
            raise ControlError(f"control frame is not JSON: {e}") from e
        if not isinstance(obj, dict):
            raise ControlError("control frame is not a JSON object")
        return obj

    def recv(self, timeout_s: float) -> dict[str, Any]:
        """Receive one JSON object.

        Takes: the longest wait in seconds.
        Returns: the object.
        Raises: ControlError on timeout, peer close, or a malformed frame.
        """
        obj = self.poll(timeout_s)
        if obj is None:
            raise ControlError(f"peer silent for {timeout_s:g} s on the control connection")
        return obj

    def poll(self, timeout_s: float = 0.0) -> dict[str, Any] | None:
        """Return the next object if one arrives within ``timeout_s``, else None.

        Raises: ControlError on peer close or a malformed frame.
        """
        obj = self._frame_ready()
        if obj is not None:
            return obj
        deadline = time.monotonic() + timeout_s
        while True:
            left = max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select([self.sock], [], [], left)
            if not readable:
                return None
            try:
                chunk = self.sock.recv(65536)
            except OSError as e:
                raise ControlError(f"control connection lost: {e}") from e
            if not chunk:
                raise ControlError("peer closed the control connection")
            self._buf += chunk
            obj = self._frame_ready()
            if obj is not None:
                return obj
            # A partial frame: wait for the rest within the same deadline.

    def expect(self, op: str, timeout_s: float) -> dict[str, Any]:
        """Receive one object and check it is the step ``op`` both sides agreed on.

        Raises: ControlError if the peer reports an error or is at another step.
        """
        return _step(self.recv(timeout_s), op)

    def poll_step(self, op: str) -> dict[str, Any] | None:
        """Return the peer's object for step ``op`` if it has arrived, else None (never waits).

        Raises: ControlError as :meth:`expect`.
        """
        obj = self.poll(0.0)
        return None if obj is None else _step(obj, op)

    def exchange(self, obj: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send ``obj`` and receive the peer's object for the same step.

        Both sides call this with the same ``op``: it is perftest's
        ``ctx_hand_shake`` and doubles as a barrier.
        Raises: ControlError as :meth:`expect`.
        """
        self.send(obj)
        return self.expect(obj["op"], timeout_s)

    def local_ip(self) -> str:
        """Return the local IP address of the connection (where the peer reaches us)."""
        return str(self.sock.getsockname()[0])

    def local_port(self) -> int:
        """Return the local TCP port of the connection (a server's: the one it listens on)."""
        return int(self.sock.getsockname()[1])

    def peer_ip(self) -> str:
        """Return the peer's IP address."""
        return str(self.sock.getpeername()[0])

    def close(self) -> None:
        """Close the connection (safe twice)."""
        self.sock.close()

    def __enter__(self) -> "ControlChannel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _step(obj: dict[str, Any], op: str) -> dict[str, Any]:
    if obj.get("op") == "error":
        if obj.get("interrupted") is True:
            raise ControlError("the peer was interrupted")
        raise ControlError(f"peer failed: {obj.get('message', '?')}")
    if obj.get("op") != op:
        raise ControlError(f"expected {op!r} from the peer, got {obj.get('op')!r}")
    return obj


def listen(host: str, port: int) -> socket.socket:
    """Open the server's listening socket.

    Takes: the address to bind (port 0 picks a free one).
    Returns: the listening socket; ``getsockname()[1]`` is the port.
    Raises: OSError if the address cannot be bound.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1)
    return sock


def accept(listener: socket.socket, timeout_s: float | None) -> ControlChannel:
    """Wait for the client.

    Takes: the listening socket, the longest wait (None = forever, as a
    perftest server waits).
    Returns: the channel to the client.
    Raises: ControlError on timeout.
    """
    listener.settimeout(timeout_s)
    try:
        conn, _ = listener.accept()
    except socket.timeout as e:
        raise ControlError(f"no client connected within {timeout_s:g} s") from e
    conn.settimeout(None)
    return ControlChannel(conn)


def connect(host: str, port: int, timeout_s: float, source_ip: str | None = None) -> ControlChannel:
    """Connect to a benchmark server.

    Takes: the server's address, the longest wait, and optionally the local
    IP to connect from (it is also where this side's data sockets bind).
    Raises: ControlError if it cannot be reached within ``timeout_s``.
    """
    source = (source_ip, 0) if source_ip else None
    try:
        conn = socket.create_connection((host, port), timeout=timeout_s, source_address=source)
    except OSError as e:
        raise ControlError(f"cannot reach the server at {host}:{port}: {e}") from e
    conn.settimeout(None)
    return ControlChannel(conn)
