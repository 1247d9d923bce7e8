"""The verbs library's compiled data path (``_fastpath.c``): posting and polling.

Theory of operation
-------------------
A work request posted from Python costs ~20 attribute reads and packs,
ring arithmetic and a fence, each a Python step; a completion polled costs
an unpack and a ``WC`` built in Python.  ``_fastpath.c`` does a whole post
list in one call (reading each WR's attributes with the C API, writing its
WQE into the send ring, publishing the producer index once and fencing), and
builds the ``WC`` objects of a poll in one call, so an application pays a
few Python steps per *call* instead of per work request.

``post_send`` stops at the first work request it is not sure of (a field of
another type or out of range, a full ring, an SGE list that is not a list),
and ``QP.post_send`` hands that one and the rest to the Python path, which
raises the exact error.  Both paths write the same bytes
(``tests/verbs/test_fastpath.py``).

It is a plain CPython extension (cffi cannot read a Python object's
attributes), built on first use like the daemon's lanes
(``wire/native.py``): in the same cache directory, named by a hash of its
source, the ring declarations and the Python ABI.  Without a compiler, or
with ``UDPVERBS_NATIVE=0``, :func:`load` returns None and the verbs use the
Python path alone.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import os
import pathlib
import sys
import sysconfig
import tempfile
from types import ModuleType

from ..wire import native, shm


_SOURCE = pathlib.Path(__file__).with_name("_fastpath.c")
_PREFIX = "_udpverbs_fastpath_"
_loaded: ModuleType | None = None
_tried = False


def _module_name(source: str) -> str:
    tag = sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag
    return _PREFIX + hashlib.sha256((source + str(tag)).encode()).hexdigest()[:16]


def build(target_dir: pathlib.Path) -> pathlib.Path:
    """Compile the extension into ``target_dir``; return its path.

    Raises:
        Exception: whatever the compiler or setuptools raised.
    """
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    # the layout, once: the C code sees the declarations cffi parses
    source = "#include <stdint.h>\n" + shm.CDEF + _SOURCE.read_text()
    name = _module_name(source)
    final = target_dir / (name + importlib.machinery.EXTENSION_SUFFIXES[0])
    if final.exists():
        return final
    target_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target_dir) as tmp:
        src = pathlib.Path(tmp) / (name + ".c")
        src.write_text(source)
        ext = Extension(name, [str(src)], extra_compile_args=["-O2"],
                        define_macros=[("FASTPATH_NAME", f'"{name}"'), ("FASTPATH_INIT", f"PyInit_{name}")])
        cmd = build_ext(Distribution({"ext_modules": [ext]}))
        cmd.build_temp = cmd.build_lib = tmp
        cmd.ensure_finalized()
        cmd.run()
        # rename is atomic: a concurrent build of the same source wins or loses whole
        os.replace(cmd.get_ext_fullpath(name), final)
    for stale in target_dir.glob(_PREFIX + "*"):
        if stale != final and stale.is_file():
            stale.unlink(missing_ok=True)
    return final


def load() -> ModuleType | None:
    """The compiled module, or None if disabled or not buildable (built once per process)."""
    global _loaded, _tried
    if not _tried:
        _tried = True
        _loaded = native.build_and_import(build, "compiled post and poll")
    return _loaded
