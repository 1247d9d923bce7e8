"""The raw-UDP baseline: the same traffic pattern over bare UDP sockets.

Theory of operation
-------------------
Every figure udpverbs reports is printed next to what plain Python UDP
sockets achieve between the same two processes, measured in the same run:
on a shared, noisy machine that ratio is the honest yardstick, not the
absolute number.

Both tests move messages of the benchmark's size, cut into datagrams of the
path MTU (``mtu - 28`` bytes of UDP payload, a 16-byte header of ours in
front of each chunk), gathered from and scattered into a message buffer
(``sendmsg``/``recvmsg_into``) the way a NIC places data.  The sockets are
connected (so the kernel skips the route look-up) and blocking; the receive
timeout is the kernel's ``SO_RCVTIMEO``, so the hot path costs one system
call per datagram and no ``poll``.

* **Latency** (:func:`latency_client` / :func:`latency_server`): ping-pong.
  The client sends message ``i``; the server, once it has all of it, sends
  message ``i`` back; the client records half the round trip.  A message
  longer than one window goes in bursts of ``window`` datagrams, each
  acknowledged by the receiver before the next (the reply acknowledges the
  last burst), because a loopback receiver that is not paced drops 3-40% of
  a long burst.  Reads and atomics are the same exchange with a small
  request (whole round trips); send_lat's RNR path (``pause_s``) has the
  server leave its socket unread for that long after each reply, as the
  udpverbs server leaves its QP without a receive.
* **Bandwidth** (:func:`bandwidth_client` / :func:`bandwidth_server`): a
  windowed stream.  The sender keeps at most ``window`` datagrams
  unacknowledged; the receiver acknowledges cumulatively every
  ``window // 4`` datagrams and at the end.  A message is complete when the
  acknowledgement covering its last datagram arrives, the moment an RDMA
  Write completes in udpverbs.
  With ``answer=True`` (atomic_bw's pattern) every message is one datagram
  and the receiver acknowledges each one with an answer of the same size
  (a Fetch-and-Add's old value): a request completes when its answer
  arrives.

Losses are repaired go-back-N after a timeout (loopback neither reorders
nor, with the window, usually drops); a peer silent for ``GIVE_UP_S``
raises :class:`BaselineError` instead of hanging.  Every datagram carries a
run number, so leftovers of a previous size are ignored.
"""

from __future__ import annotations

import math
import socket
import struct
import time
from typing import Callable

from ..transport.sockbuf import datagrams_that_fit

#: kind u8, flags u8, run u16, seq u32, index u32, total u32
HDR = struct.Struct("!BBHIII")
KIND_DATA = 1
KIND_ACK = 2
FLAG_FIN = 0x01
#: IPv4 (20) + UDP (8) headers inside the MTU.
IP_UDP_OVERHEAD = 28
#: A peer silent this long has failed.
GIVE_UP_S = 10.0
#: How long a blocked receive waits before retransmitting (client) or
#: looking at the control connection (server).
CLIENT_RTO_S = 0.2
SERVER_POLL_S = 0.05
_SOCKET_BUFFER = 4 << 20


class BaselineError(Exception):
    """The raw-UDP baseline could not complete (peer silent, bad arguments)."""


def chunk_bytes(mtu: int) -> int:
    """Return the message bytes one datagram carries at this MTU.

    Raises: BaselineError if the MTU leaves no room for data.
    """
    chunk = mtu - IP_UDP_OVERHEAD - HDR.size
    if chunk < 1:
        raise BaselineError(f"MTU {mtu} leaves no room for data")
    return chunk


def open_socket(local_ip: str) -> socket.socket:
    """Open the UDP socket of one side, bound to ``local_ip`` on a free port.

    Returns: the socket, with 4 MB buffers asked for (the kernel may grant less).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER)
    sock.bind((local_ip, 0))
    return sock


def default_window(sock: socket.socket, mtu: int) -> int:
    """Return the datagram window the receive buffer can absorb without loss.

    Sized as the daemons size their flow-control window: by what one
    datagram of this MTU costs the buffer (a few KB for small ones, the
    whole datagram and more for large), kept in 4..256. A window counted at
    4 KB a datagram overflowed the buffer at 64 KB datagrams and held the
    stream to its retransmission timeout whenever the receiver fell behind.
    """
    granted = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    return datagrams_that_fit(granted, mtu - IP_UDP_OVERHEAD)


def _set_rcv_timeout(sock: socket.socket, seconds: float) -> None:
    # SO_RCVTIMEO keeps the socket blocking in Python's eyes: a timed-out
    # recv raises BlockingIOError, and no poll() precedes each recv.
    sec = int(seconds)
    usec = int((seconds - sec) * 1e6)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", sec, usec))


class _Endpoint:
    """One side's socket, buffers and message geometry for one run."""

    def __init__(self, sock: socket.socket, size: int, mtu: int, run: int, window: int) -> None:
        if size < 1:
            raise BaselineError("message size must be at least 1 byte")
        if window < 1:
            raise BaselineError("window must be at least 1 datagram")
        self.sock = sock
        self.size = size
        self.run = run & 0xFFFF
        self.window = window
        self.chunk = chunk_bytes(mtu)
        self.total = max(1, math.ceil(size / self.chunk))
        self.tx = memoryview(bytearray(size))
        self.rx = memoryview(bytearray(size))
        self.hdr = bytearray(HDR.size)
        self.rhdr = bytearray(HDR.size)
        self.ack = bytearray(HDR.size)
        self.started = time.monotonic()

    def piece(self, buf: memoryview, index: int) -> memoryview:
        off = index * self.chunk
        return buf[off : off + self.chunk]

    def send_data(self, seq: int, index: int, total: int, flags: int, payload: memoryview) -> None:
        HDR.pack_into(self.hdr, 0, KIND_DATA, flags, self.run, seq, index, total)
        self.sock.sendmsg([self.hdr, payload])

    def send_ack(self, seq: int, upto: int, payload: memoryview | None = None) -> None:
        HDR.pack_into(self.ack, 0, KIND_ACK, 0, self.run, seq, upto, 0)
        if payload is None:
            self.sock.send(self.ack)
        else:
            self.sock.sendmsg([self.ack, payload])

    def one_datagram(self) -> None:
        """Check that a message fits one datagram (answered streams)."""
        if self.total != 1:
            raise BaselineError(f"a {self.size} B message answered one by one must fit one datagram")

    def recv(self, into: memoryview) -> tuple[int, int, int, int, int] | None:
        """Receive one datagram of this run; None on timeout.

        Returns: (kind, flags, seq, index, total).
        """
        try:
            n, _, _, _ = self.sock.recvmsg_into([self.rhdr, into])
        except (BlockingIOError, TimeoutError):
            return None
        except ConnectionRefusedError:
            # ICMP port unreachable from a peer that is not up yet/any more:
            # the same as silence.
            return None
        if n < HDR.size:
            return None
        kind, flags, run, seq, index, total = HDR.unpack_from(self.rhdr)
        if run != self.run:
            return None
        return kind, flags, seq, index, total

    def check_alive(self, last_progress: float, what: str) -> None:
        if time.monotonic() - last_progress > GIVE_UP_S:
            raise BaselineError(f"raw-UDP peer silent for {GIVE_UP_S:g} s ({what})")


class _PingPong(_Endpoint):
    """Message exchange for the latency test, bursts of ``window`` datagrams.

    The two directions may differ in size (a Read's request is small, its
    response is the message).
    """

    def __init__(self, sock: socket.socket, tx_size: int, rx_size: int, mtu: int, run: int, window: int) -> None:
        super().__init__(sock, max(tx_size, rx_size), mtu, run, window)
        self.tx_total = max(1, math.ceil(tx_size / self.chunk))
        self.rx_total = max(1, math.ceil(rx_size / self.chunk))
        self.last_seq = -1
        self.last_burst = 0

    def send_burst(self, seq: int, start: int, end: int) -> None:
        total = self.tx_total
        for i in range(start, end):
            flags = FLAG_FIN if i == total - 1 else 0
            self.send_data(seq, i, total, flags, self.piece(self.tx, i))

    def resend_last(self) -> None:
        """Send the last burst of the last message again (the peer lost it)."""
        if self.last_seq >= 0:
            self.send_burst(self.last_seq, self.last_burst, self.tx_total)

    def send_msg(self, seq: int) -> None:
        """Send message ``seq``; every burst but the last waits for its ACK."""
        start = 0
        while True:
            end = min(start + self.window, self.tx_total)
            self.send_burst(seq, start, end)
            if end == self.tx_total:
                self.last_seq, self.last_burst = seq, start
                return
            progress = time.monotonic()
            while True:
                got = self.recv(self.rx[:0])
                if got is None:
                    self.check_alive(progress, f"waiting for the ACK of message {seq}")
                    self.send_burst(seq, start, end)
                    continue
                kind, _, s, index, _ = got
                if kind == KIND_ACK and s == seq and index >= end:
                    break
            start = end

    def recv_msg(self, seq: int, on_timeout: Callable[[], bool]) -> bool:
        """Receive all of message ``seq`` into the receive buffer.

        Takes: ``on_timeout``, called when nothing came for a while; it
        returns True to stop waiting.
        Returns: True when the message is complete, False when stopped.
        """
        expected = 0
        w = self.window
        while True:
            got = self.recv(self.piece(self.rx, expected))
            if got is None:
                if on_timeout():
                    return False
                continue
            kind, _, s, index, _ = got
            if kind != KIND_DATA:
                continue
            if s == seq:
                if index == expected:
                    expected += 1
                    if expected == self.rx_total:
                        return True
                    if expected % w == 0:
                        self.send_ack(seq, expected)
                elif index < expected and expected % w == 0:
                    self.send_ack(seq, expected)  # our ACK was lost: say it again
            elif s == self.last_seq:
                # The peer is still sending the message we already answered:
                # our answer was lost.
                self.resend_last()


def latency_client(
    sock: socket.socket,
    size: int,
    mtu: int,
    *,
    iters: int,
    duration_s: float | None = None,
    warmup: int = 0,
    run: int = 0,
    window: int | None = None,
    request_size: int | None = None,
    rtt_factor: int = 2,
) -> list[int]:
    """Run the client side of the ping-pong.

    Takes: a UDP socket connected to the server's; message size (of the
    reply, and of the request unless ``request_size`` says otherwise); MTU;
    ``iters`` measured round trips, or until ``duration_s`` has passed when
    given; ``warmup`` round trips not measured; the run number both sides
    agreed on; the burst window (default: from the receive buffer); what a
    round trip is divided by (2: half round trips as perftest's write and
    send latency; 1: whole ones as its read and atomic latency).
    Returns: one sample in nanoseconds per measured iteration.
    Raises: BaselineError if the server stays silent.
    """
    req = size if request_size is None else request_size
    ep = _PingPong(sock, req, size, mtu, run, window or default_window(sock, mtu))
    _set_rcv_timeout(sock, CLIENT_RTO_S)
    samples: list[int] = []
    state = {"progress": time.monotonic()}

    def on_timeout() -> bool:
        ep.check_alive(state["progress"], "waiting for the reply")
        ep.resend_last()
        return False

    clock = time.perf_counter_ns
    deadline = None if duration_s is None else clock() + int(duration_s * 1e9)
    seq = 0
    while True:
        measured = seq - warmup
        if measured >= 0:
            if deadline is None and measured >= iters:
                break
            if deadline is not None and clock() >= deadline:
                break
        t0 = clock()
        ep.send_msg(seq)
        ep.recv_msg(seq, on_timeout)
        t1 = clock()
        state["progress"] = time.monotonic()
        if seq >= warmup:
            samples.append((t1 - t0) // rtt_factor)
        seq += 1
    return samples


def latency_server(
    sock: socket.socket,
    size: int,
    mtu: int,
    *,
    stop: Callable[[], bool],
    run: int = 0,
    window: int | None = None,
    request_size: int | None = None,
    pause_s: float = 0.0,
) -> int:
    """Serve the ping-pong: answer every request with a message of ``size``.

    Takes: the UDP socket connected to the client's; size, MTU, run, window
    and request size as the client; ``stop``, polled when the client is
    quiet, True once the client says it is done; ``pause_s``, how long to
    leave the socket unread after each answer (send_lat's RNR delay).
    Returns: the number of messages answered.
    """
    req = size if request_size is None else request_size
    ep = _PingPong(sock, size, req, mtu, run, window or default_window(sock, mtu))
    _set_rcv_timeout(sock, SERVER_POLL_S)
    seq = 0
    while ep.recv_msg(seq, stop):
        ep.send_msg(seq)
        if pause_s > 0:
            time.sleep(pause_s)
        seq += 1
    return seq


def bandwidth_client(
    sock: socket.socket,
    size: int,
    mtu: int,
    *,
    iters: int,
    duration_s: float | None = None,
    run: int = 0,
    window: int | None = None,
    answer: bool = False,
) -> tuple[int, list[int]]:
    """Stream messages to the server with a window of unacknowledged datagrams.

    Takes: as :func:`latency_client`; ``iters`` messages, or as many as fit
    in ``duration_s``; ``answer``: the server answers every one-datagram
    message with as many bytes (atomic_bw), received here.
    Returns: (time of the first send, completion time of every message), ns.
    Raises: BaselineError if the server stays silent, or with ``answer`` a
    message needs more than one datagram.
    """
    ep = _Endpoint(sock, size, mtu, run, window or default_window(sock, mtu))
    if answer:
        ep.one_datagram()
    into = ep.rx if answer else ep.rx[:0]
    _set_rcv_timeout(sock, CLIENT_RTO_S)
    dpm = ep.total
    w = ep.window
    clock = time.perf_counter_ns
    fin = iters * dpm - 1 if duration_s is None else -1  # index of the last datagram
    if duration_s is None and iters < 1:
        raise BaselineError("iterations must be at least 1")
    completions: list[int] = []
    start = clock()
    deadline = None if duration_s is None else start + int(duration_s * 1e9)
    nxt = 0
    acked = 0
    progress = time.monotonic()
    while fin < 0 or acked <= fin:
        while nxt - acked < w and (fin < 0 or nxt <= fin):
            index = nxt % dpm
            flags = 0
            if index == dpm - 1:
                if fin < 0 and deadline is not None and clock() >= deadline:
                    fin = nxt
                if nxt == fin:
                    flags = FLAG_FIN
            ep.send_data(nxt & 0xFFFFFFFF, index, dpm, flags, ep.piece(ep.tx, index))
            nxt += 1
        got = ep.recv(into)
        if got is None:
            ep.check_alive(progress, "waiting for stream ACKs")
            nxt = acked  # go-back-N
            continue
        kind, _, _, upto, _ = got
        if kind != KIND_ACK or upto <= acked:
            continue
        now = clock()
        progress = time.monotonic()
        completions.extend([now] * (upto // dpm - acked // dpm))
        acked = upto
    return start, completions


def bandwidth_server(
    sock: socket.socket,
    size: int,
    mtu: int,
    *,
    stop: Callable[[], bool],
    run: int = 0,
    window: int | None = None,
    answer: bool = False,
) -> int:
    """Receive the stream, placing each datagram in the message buffer, and ACK.

    Takes: as :func:`latency_server`; ``answer``: as :func:`bandwidth_client`
    (each ACK then carries ``size`` bytes).
    Returns: the number of datagrams received in order.
    """
    ep = _Endpoint(sock, size, mtu, run, window or default_window(sock, mtu))
    payload = None
    if answer:
        ep.one_datagram()
        payload = ep.tx
    _set_rcv_timeout(sock, SERVER_POLL_S)
    dpm = ep.total
    every = 1 if answer else max(1, ep.window // 4)
    expected = 0
    while True:
        got = ep.recv(ep.piece(ep.rx, expected % dpm))
        if got is None:
            if stop():
                return expected
            continue
        kind, flags, seq, _, _ = got
        if kind != KIND_DATA:
            continue
        if seq == expected & 0xFFFFFFFF:
            expected += 1
            if expected % every == 0 or flags & FLAG_FIN:
                ep.send_ack(0, expected & 0xFFFFFFFF, payload)
        else:
            ep.send_ack(0, expected & 0xFFFFFFFF, payload)  # a gap or a duplicate: say where we are
