"""Messages whose payload stays where it lies until it leaves (sans-IO).

Theory of operation
-------------------
A large segment of an RDMA Write is mostly payload that already sits in
registered memory.  Building it into a buffer before the socket copies it
again cost the sender a 64 KB copy (and a buffer) per datagram.  A
:class:`Gather` is such a message in three parts: the few bytes before the
payload, a view of the payload, and the few after it.  The link queues and
retransmits it as any message; its first transmission is a
:class:`Gathered` datagram (link header and lead, payload, tail and CRC),
which the owner hands to one ``sendmsg`` as iovecs, so the kernel's copy
into the socket buffer is the only one.  The CRC runs over the payload
where it lies (``wire.link.encode_fields_parts``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Gather", "Gathered", "native_crc"]


class Gather:
    """A message queued in three parts, ``lead + payload + tail``, whose
    payload is a view of memory the owner promises to leave unchanged until
    the message is acknowledged (registered memory under an RDMA Write: the
    application must not touch its buffer before the WR completes, and the
    WR completes on the link's ACK).  Its first transmission leaves as a
    :class:`Gathered` datagram, the payload read where it lies (zero copy).

    A retransmission joins the parts first (:meth:`join`): the payload is
    read from the memory again, as an RNIC re-reads host memory to resend,
    and the CRC is taken over that one copy, so the bytes checksummed are
    the bytes sent even if an application breaks the rule and writes into
    its buffer meanwhile (its first transmission may then fail the peer's
    CRC, and the copy that is resent cannot).
    """

    __slots__ = ("lead", "payload", "tail", "size")

    def __init__(self, lead: bytes, payload: memoryview, tail: bytes = b"") -> None:
        self.lead = lead
        self.payload = payload
        self.tail = tail
        self.size = len(lead) + len(payload) + len(tail)

    def __len__(self) -> int:
        return self.size

    def join(self) -> bytes:
        """The message as one ``bytes`` (the payload copied now)."""
        return b"".join((self.lead, self.payload, self.tail))


class Gathered:
    """One datagram in ``parts`` (header and lead; payload; tail and CRC) for
    one ``sendmsg``: the kernel gathers them, the only copy of the payload."""

    __slots__ = ("parts", "size")

    def __init__(self, parts: tuple[bytes, memoryview, bytes]) -> None:
        self.parts = parts
        self.size = len(parts[0]) + len(parts[1]) + len(parts[2])

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)


def native_crc(framer: Any) -> Any:
    """``crc(data, value)`` (the ``crc32c`` package's signature) by the framer's ``udpv_crc32c``."""
    ffi, fold = framer.ffi, framer.lib.udpv_crc32c

    def crc(data: memoryview, value: int) -> int:
        p = ffi.from_buffer("uint8_t[]", data)
        try:
            return fold(value, p, len(data))  # type: ignore[no-any-return]
        finally:
            ffi.release(p)  # no export may outlive the call: deregistration releases the view
    return crc
