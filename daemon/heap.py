"""Keep freed heap memory for reuse: the daemon's allocator settings.

Theory of operation
-------------------
A stream's sending daemon allocates a buffer for every run of datagrams it
frames (up to 64 KiB) and frees it when the run is acknowledged; the
receiving daemon allocates one per receive.  glibc gives memory at the top
of the heap back to the kernel as soon as more than 128 KiB of it is free
(``M_TRIM_THRESHOLD``), so a stream's buffers come back as fresh pages
again and again, each touched page a minor fault (tens of thousands a
second in a 64 KiB ``write_bw``).  Raising the
threshold keeps up to ``keep_mb`` of freed memory in the heap, where the
next buffers find it already mapped; ``M_TOP_PAD`` grows the heap in
larger steps for the same reason.  The cost is memory: a daemon's resident
size stays at its high-water mark plus at most ``keep_mb``.

Only the daemon's own process is changed (``udpverbsd`` calls
:func:`keep_freed_heap` at start), never an application's.  On a C
library without ``mallopt`` (musl, macOS) nothing is changed.
"""

from __future__ import annotations

import logging

import cffi

log = logging.getLogger("udpverbs.daemon")

#: mallopt(3)'s parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
#: the default: a few 64 KiB-message windows' worth of buffers
DEFAULT_KEEP_MB = 64
MAX_KEEP_MB = 1024
#: M_TOP_PAD's share of the kept memory: each heap growth reserves this much more
_TOP_PAD_FRACTION = 4

_ffi = cffi.FFI()
_ffi.cdef("int mallopt(int param, int value);")


def check_keep_mb(keep_mb: object) -> int:
    """Return ``keep_mb`` if it is a whole number of MiB from 0 to MAX_KEEP_MB.

    Raises: ValueError otherwise.
    """
    if isinstance(keep_mb, bool) or not isinstance(keep_mb, int) or not 0 <= keep_mb <= MAX_KEEP_MB:
        raise ValueError(f"heap_keep_mb must be a whole number from 0 to {MAX_KEEP_MB}, not {keep_mb!r}")
    return keep_mb


def keep_freed_heap(keep_mb: int) -> bool:
    """Keep up to ``keep_mb`` MiB of freed heap in this process (0: the C library's defaults).

    Returns: True if the allocator took the settings.
    Raises: ValueError as :func:`check_keep_mb`.
    """
    if check_keep_mb(keep_mb) == 0:
        return False
    try:
        mallopt = _ffi.dlopen(None).mallopt
    except (OSError, AttributeError):
        log.debug("no mallopt in this C library: freed heap goes back to the kernel as it likes")
        return False
    keep = keep_mb << 20
    return bool(mallopt(M_TRIM_THRESHOLD, keep)) and bool(mallopt(M_TOP_PAD, keep // _TOP_PAD_FRACTION))
