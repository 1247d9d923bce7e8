"""Keep the dependency direction true: wire <- transport <- daemon; wire <- verbs <- bench.

Walks every module's imports with ``ast`` (nothing is executed), so a layer
reaching up, or I/O creeping into the sans-IO layers, fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# layer -> the udpverbs layers it may import
ALLOWED = {
    "wire": {"wire"},
    "transport": {"wire", "transport"},
    "daemon": {"wire", "transport", "daemon"},
    "verbs": {"wire", "verbs"},
    "bench": {"wire", "transport", "verbs", "bench", "daemon"},
}
# Sans-IO: no event loop, sockets or clocks below the daemon.
FORBIDDEN_STDLIB = {
    "wire": {"trio", "socket", "asyncio", "time", "select", "selectors"},
    "transport": {"trio", "socket", "asyncio", "time", "select", "selectors"},
}


def _imports(path: Path, layer: str) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg_parts = ["udpverbs", layer, *path.relative_to(ROOT / layer).parts[:-1]]
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg_parts[: len(pkg_parts) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if node.module is None:  # from . import x, y: the modules are the names
                found += [(f"{name}.{a.name}", node.lineno) for a in node.names]
            else:
                found.append((name, node.lineno))
    return found


def _modules():
    for layer in ALLOWED:
        for path in sorted((ROOT / layer).rglob("*.py")):
            yield pytest.param(layer, path, id=str(path.relative_to(ROOT)))


@pytest.mark.parametrize("layer,path", list(_modules()))
def test_layer_imports_only_downward(layer: str, path: Path) -> None:
    for name, line in _imports(path, layer):
        parts = name.split(".")
        if parts[0] == "udpverbs" and len(parts) > 1:
            assert parts[1] in ALLOWED[layer], f"{path}:{line} imports {name}"
        assert parts[0] not in FORBIDDEN_STDLIB.get(layer, ()), f"{path}:{line} imports {name} (sans-IO layer)"


# --- the daemon's modules, in one direction --------------------------------
# Each daemon module may import only modules before it in this list (the QP
# engine never imports the device: it reaches it through ``ports``).  A new
# module takes its place here, or this test fails.
DAEMON_ORDER = [
    "heap", "tables", "quota", "clusterkey", "paths", "config", "opcodes", "records", "cq", "ports", "policy", "udp", "impaired",
    "peer",
    "atombatch", "readbatch", "completer", "responder", "requester", "txbatch", "qp",
    "scheduler", "rxsends", "rxlane", "receive", "loop", "device", "status", "metrics",
    "qlock", "gbarrier", "groups",
    "control", "server", "cm", "__main__",
]


def _daemon_modules() -> list[str]:
    return sorted(p.stem for p in (ROOT / "daemon").glob("*.py") if p.stem != "__init__")


def test_every_daemon_module_has_its_place_in_the_order() -> None:
    assert sorted(DAEMON_ORDER) == _daemon_modules()


@pytest.mark.parametrize("module", DAEMON_ORDER)
def test_daemon_modules_import_only_modules_before_them(module: str) -> None:
    earlier = set(DAEMON_ORDER[:DAEMON_ORDER.index(module)])
    for name, line in _imports(ROOT / "daemon" / f"{module}.py", "daemon"):
        parts = name.split(".")
        if parts[:2] == ["udpverbs", "daemon"] and len(parts) > 2:
            assert parts[2] in earlier, f"daemon/{module}.py:{line} imports {name}, which comes later"


# --- transport/: a one-way import order within the layer --------------------
#: transport's modules, lowest first: a module may import only those before it
#: (``congestion`` is a package and one entry; the layer's ``__init__`` is its
#: facade and may import any of them).  A new module takes its place here.
TRANSPORT_ORDER = ["sockbuf", "replay", "cookie", "ackhold", "pacer", "recovery", "congestion", "records", "receiver",
                   "gather", "builder", "handshake", "pmtud", "timers", "pathlanes", "scheduler", "paths", "link", "netsim",
                   "impair"]


def _transport_module(path: Path) -> str:
    rel = path.relative_to(ROOT / "transport")
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _transport_files():
    for path in sorted((ROOT / "transport").rglob("*.py")):
        if path != ROOT / "transport" / "__init__.py":
            yield pytest.param(path, id=str(path.relative_to(ROOT)))


def test_transport_order_names_every_module() -> None:
    found = {_transport_module(p.values[0]) for p in _transport_files()}
    assert found == set(TRANSPORT_ORDER)


@pytest.mark.parametrize("path", list(_transport_files()))
def test_transport_imports_only_earlier_modules(path: Path) -> None:
    me = _transport_module(path)
    for name, line in _imports(path, "transport"):
        parts = name.split(".")
        if parts[:2] != ["udpverbs", "transport"] or len(parts) < 3 or parts[2] == me:
            continue
        assert parts[2] in TRANSPORT_ORDER, f"{path}:{line} imports {name}, not in TRANSPORT_ORDER"
        assert TRANSPORT_ORDER.index(parts[2]) < TRANSPORT_ORDER.index(me), \
            f"{path}:{line}: {me} imports {parts[2]}, which comes after it in TRANSPORT_ORDER"


def test_every_c_source_is_package_data() -> None:
    # the compiled lanes are built from these on the user's machine: a wheel without one has no fast path
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    listed = {f"{pkg.removeprefix('udpverbs.')}/{name}" for pkg, names in data.items() for name in names}
    sources = {str(p.relative_to(ROOT)) for layer in ("wire", "transport", "daemon", "verbs") for p in (ROOT / layer).glob("*.c")}
    assert sources and sources <= listed, sorted(sources - listed)
