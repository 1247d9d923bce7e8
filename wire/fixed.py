"""Shared decoding step of the small fixed-size control messages.

Theory of operation
-------------------
``flow``, ``lock`` and ``barrier`` messages are each one ``struct`` layout
whose first byte is a message type.  Their decoders all start the same way:
the length must be exact and the type known.  That step lives here once;
each module then checks its own reserved fields.
"""

from __future__ import annotations

import struct
from collections.abc import Container

from .errors import WireError


def unpack_typed_untrusted(
    body: bytes | bytearray | memoryview, layout: struct.Struct, types: Container[int], what: str
) -> tuple[int, ...]:
    """Unpack ``body`` with ``layout`` after checking length and type byte.

    Returns the unpacked fields (the type first).

    Raises:
        WireError: ``bad_length`` or ``bad_type``; nothing else.
    """
    if len(body) != layout.size:
        raise WireError("bad_length", f"{what} of {len(body)} bytes, want {layout.size}")
    fields: tuple[int, ...] = layout.unpack_from(body)
    if fields[0] not in types:
        raise WireError("bad_type", f"{what} type {fields[0]}")
    return fields


def pack_checked(layout: struct.Struct, *fields: int) -> bytes:
    """``layout.pack(*fields)``, raising ValueError (a caller bug) on a bad field."""
    try:
        return layout.pack(*fields)
    except struct.error as e:
        raise ValueError(str(e)) from None
