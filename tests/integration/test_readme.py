"""Every code block of the README and of docs/REFERENCE.md works as shown.

Theory of operation
-------------------
The Markdown is cut into fenced blocks: the language, the line of the
opening fence, the text, and the note in an HTML comment
``<!-- snippet: ... -->`` on the line just above the fence, if any (rendered
Markdown does not show it).  Python blocks run against two real daemons
started here as the README's "Start a daemon on each host" starts them:
uvA on 127.0.0.2 and uvB on 127.0.0.3, found by name in a private runtime
directory (``UDPVERBS_RUNTIME_DIR``), both on one free UDP port instead of
18515 so that they never meet daemons of yours; a ``18515`` in a program is
read as that port.  A Python block is one of:

* a complete program (no note): run on its own, it must exit 0;
* ``<!-- snippet: background until "TEXT" -->``: a server, started in the
  background; once it has printed TEXT the next Python block runs, and then
  both must exit 0;
* an excerpt, whose first line is ``# from examples/FILE``: its lines
  (comments and ``...`` aside) must be lines of FILE, in that order, and
  FILE must run;
* ``<!-- snippet: not run: REASON -->``: only compiled.

The number of blocks of each kind is fixed below (``PYTHON_BLOCKS``), so a
block the cutting misses, or one added without deciding how it runs, fails.

Shell blocks (``sh``, and the prompted lines of ``console``): every
``udpverbs`` and ``udpverbsd`` command line is parsed and checked by the
programs' own parsers, so a renamed flag or a bad value fails here.  The
README's ``udpverbs devices`` and ``udpverbs devinfo`` are run against the
daemons, and their sample output must show the columns and fields the
tools print.  TOML blocks must be valid daemon configuration.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import re
import select
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Iterator

import pytest

from udpverbs import cli
from udpverbs.bench import group_perf, table
from udpverbs.daemon import config as dconfig

from .daemons import DaemonProc, running

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ("README.md", "docs/REFERENCE.md")
#: How many Python blocks of each kind each document has.
PYTHON_BLOCKS = {
    "README.md": {"program": 3, "background": 1, "excerpt": 2, "not run": 2},
    "docs/REFERENCE.md": {"program": 1},
}
LANGUAGES = {"python", "sh", "console", "toml", ""}
#: The README's daemons' UDP port, which the test's daemons replace.
README_PORT = "18515"
#: The tools whose sample output the README shows and that end by themselves.
RUN_TOOLS = ("devices", "devinfo")
PROGRAM_TIMEOUT_S = 60.0

_FENCE = re.compile(r"^```(\S*)\s*$")
_NOTE = re.compile(r"^<!-- snippet: (.*) -->$")
_EXCERPT = re.compile(r"^# from (examples/\S+?\.py)\b")
_BACKGROUND = re.compile(r'^background until "([^"]+)"$')
_PROMPT = re.compile(r"^[\w .-]*\$ ")
_SEPARATORS = ("&&", "||", "|", ";", "&")


@dataclass(frozen=True)
class Block:
    """One fenced block of a document."""

    doc: str
    line: int  #: of the opening fence, counting from 1
    lang: str
    text: str
    note: str  #: the ``<!-- snippet: ... -->`` just above, "" without one

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def kind(self) -> str:
        """A Python block's kind (see the module's docstring)."""
        if self.note.startswith("not run: "):
            return "not run"
        if _BACKGROUND.match(self.note):
            return "background"
        assert not self.note, f"{self.where}: unknown snippet note {self.note!r}"
        return "excerpt" if _EXCERPT.match(self.text) else "program"


def read_blocks(doc: str) -> list[Block]:
    """The fenced blocks of ``doc``.  Fails on a fence left open or a note that belongs to no block."""
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        lines = f.read().splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{doc}:{i + 1}: the block is never closed"
        note = _NOTE.match(lines[i - 1].strip()) if i else None
        blocks.append(Block(doc, i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n", note.group(1) if note else ""))
        i = end + 1
    notes = sum(1 for line in lines if line.strip().startswith("<!-- snippet:"))
    assert notes == sum(1 for b in blocks if b.note), f"{doc}: a snippet note is not just above a block's fence"
    return blocks


BLOCKS = [b for doc in DOCS for b in read_blocks(doc)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]


def _cases() -> list[tuple[Block, ...]]:
    """The Python blocks to run, a background block together with the block after it."""
    cases: list[tuple[Block, ...]] = []
    it = iter(PYTHON)
    for block in it:
        if block.kind == "background":
            following = next(it, None)
            assert following is not None and following.kind == "program", \
                f"{block.where}: a background block is followed by the program that uses it"
            cases.append((block, following))
        elif block.kind != "not run":
            cases.append((block,))
    return cases


def _command_lines() -> list[tuple[str, list[str]]]:
    """Every ``udpverbs``/``udpverbsd`` command line of the shell blocks: (where, argv)."""
    found = []
    for block in BLOCKS:
        if block.lang not in ("sh", "console"):
            continue
        for n, line in enumerate(block.text.splitlines()):
            prompt = _PROMPT.match(line)
            if block.lang == "console" and prompt is None:
                continue  # output
            words = shlex.split(line[prompt.end():] if prompt else line, comments=True)
            segment: list[str] = []
            for word in [*words, ";"]:
                if word not in _SEPARATORS:
                    segment.append(word)
                    continue
                if segment[:1] in (["udpverbs"], ["udpverbsd"]):
                    found.append((f"{block.doc}:{block.line + 1 + n}", segment))
                segment = []
    return found


COMMANDS = _command_lines()


# -- the daemons ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def readme_daemons() -> Iterator[tuple[str, int]]:
    """uvA on 127.0.0.2 and uvB on 127.0.0.3, one UDP port for both; yields (runtime dir, port)."""
    with tempfile.TemporaryDirectory(prefix="udpverbs-readme-") as d:
        for attempt in range(5):
            with running(DaemonProc("uvA", "127.0.0.2", d, mtu=None)) as (a,):
                b = DaemonProc("uvB", "127.0.0.3", d, mtu=None, port=a.port)
                try:
                    b.start()
                except RuntimeError:  # the port is taken on 127.0.0.3: try another
                    if attempt == 4:
                        raise
                    continue
                try:
                    yield d, a.port
                finally:
                    assert b.stop() == 0, b.log_text()
                return


@pytest.fixture
def reader(readme_daemons: tuple[str, int], tmp_path) -> "Reader":  # type: ignore[no-untyped-def]
    return Reader(*readme_daemons, str(tmp_path))


class Reader:
    """Runs what a reader copies, in a directory of its own, against the test's daemons."""

    def __init__(self, runtime_dir: str, port: int, cwd: str) -> None:
        self.port = port
        self.cwd = cwd
        # the console scripts (udpverbsd) of this interpreter first
        path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
        self.env = dict(os.environ, UDPVERBS_RUNTIME_DIR=runtime_dir, PATH=path, PYTHONUNBUFFERED="1")

    def script(self, block: Block) -> str:
        """Write ``block`` as a program, the README's daemon port read as ours; returns its path."""
        path = os.path.join(self.cwd, f"{block.doc.replace('/', '_').replace('.', '_')}_{block.line}.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(block.text.replace(README_PORT, str(self.port)))
        return path

    def run(self, argv: list[str], what: str) -> str:
        """Run ``argv`` to its end; returns its output.  Fails unless it exits 0 in time."""
        r = subprocess.run(argv, cwd=self.cwd, env=self.env, capture_output=True, timeout=PROGRAM_TIMEOUT_S)
        assert r.returncode == 0, f"{what} exited {r.returncode}:\n{r.stdout.decode()}\n{r.stderr.decode()}"
        return r.stdout.decode()

    @contextlib.contextmanager
    def background(self, block: Block, ready_text: str) -> Iterator[None]:
        """Run ``block`` until it prints ``ready_text``; after the body, it must exit 0 by itself."""
        proc = subprocess.Popen([sys.executable, self.script(block)], cwd=self.cwd, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert proc.stdout is not None
            seen = b""
            deadline = time.monotonic() + PROGRAM_TIMEOUT_S
            while ready_text.encode() not in seen:
                left = deadline - time.monotonic()
                assert left > 0 and select.select([proc.stdout], [], [], left)[0], \
                    f"{block.where} did not print {ready_text!r}: {seen.decode()}"
                chunk = os.read(proc.stdout.fileno(), 4096)
                assert chunk, f"{block.where} exited before it printed {ready_text!r}: {seen.decode()}"
                seen += chunk
            yield
            out, err = proc.communicate(timeout=PROGRAM_TIMEOUT_S)
            assert proc.returncode == 0, \
                f"{block.where} exited {proc.returncode}:\n{(seen + out).decode()}\n{err.decode()}"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


# -- Python blocks --------------------------------------------------------------------------------------------------
def test_every_python_block_is_of_a_known_kind_and_counted() -> None:
    assert {b.lang for b in BLOCKS} <= LANGUAGES, \
        [(b.where, b.lang) for b in BLOCKS if b.lang not in LANGUAGES]
    kinds = {doc: dict(collections.Counter(b.kind for b in PYTHON if b.doc == doc)) for doc in DOCS}
    assert kinds == PYTHON_BLOCKS, "a Python block was added or removed: decide how it runs, then count it here"


@pytest.mark.parametrize("block", [b for b in PYTHON if b.kind == "not run"], ids=lambda b: b.where)
def test_a_block_not_run_compiles_and_says_why(block: Block) -> None:
    assert len(block.note) > len("not run: ") + 10, f"{block.where}: say why it does not run"
    compile(block.text, block.where, "exec")


def _code(text: str) -> list[str]:
    """The code of ``text`` line by line: stripped, without comments, ``...`` or blank lines."""
    lines = []
    for line in text.splitlines():
        code = re.sub(r"\s+#\s.*$", "", line).strip()
        if code and not code.startswith("#") and code != "...":
            lines.append(code)
    return lines


@pytest.mark.parametrize("case", _cases(), ids=lambda case: "+".join(f"{b.where}-{b.kind}" for b in case))
def test_python_block_runs(case: tuple[Block, ...], reader: Reader) -> None:
    block = case[0]
    if block.kind == "background":
        ready = _BACKGROUND.match(block.note)
        assert ready is not None
        with reader.background(block, ready.group(1)):
            reader.run([sys.executable, reader.script(case[1])], case[1].where)
    elif block.kind == "excerpt":
        m = _EXCERPT.match(block.text)
        assert m is not None
        with open(os.path.join(ROOT, m.group(1)), encoding="utf-8") as f:
            source = iter(_code(f.read()))
        missing = [line for line in _code(block.text) if line not in source]  # in order: `in` consumes
        assert not missing, f"{block.where}: not lines of {m.group(1)} (or out of order): {missing}"
        reader.run([sys.executable, os.path.join(ROOT, m.group(1))], m.group(1))
    else:
        reader.run([sys.executable, reader.script(block)], block.where)


# -- shell and TOML blocks ------------------------------------------------------------------------------------------
def _check_udpverbs(words: list[str]) -> None:
    """Parse and check ``udpverbs WORDS...`` as the command would before doing anything."""
    if words[:1] == ["perf"] and any(w in group_perf.TESTS for w in words[1:]):
        group_perf.params_from_args(group_perf.build_parser().parse_args(words[1:]))
        return
    if words[:1] == ["perf"] and "all" in words[1:]:
        opts = table.parse_options(words[1:])
        for row in opts.rows:
            cli.prepare_table_run(table.command_argv(row, opts.quick, opts.extra))
        return
    args = cli.parse_command(words)
    if args.command == "perf":
        cli.output_from(args, cli.params_from_args(args))
    if getattr(args, "daemon_args", None):
        cli.daemon_args_from(args)


def _check_udpverbsd(flags: list[str]) -> None:
    """Parse and check ``udpverbsd FLAGS...`` (a ``--config`` file is a TOML block, checked on its own)."""
    if dconfig.parse_flags(flags).config is None:
        dconfig.load(flags, exit_on_error=False)


def test_the_documents_show_udpverbs_command_lines() -> None:
    programs = collections.Counter(argv[0] for _, argv in COMMANDS)
    assert programs["udpverbs"] >= 20 and programs["udpverbsd"] >= 5, programs


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[f"{w} {' '.join(a[:3])}" for w, a in COMMANDS])
def test_command_line_parses(where: str, argv: list[str]) -> None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            (_check_udpverbs if argv[0] == "udpverbs" else _check_udpverbsd)(argv[1:])
    except SystemExit as e:
        pytest.fail(f"{where}: {shlex.join(argv)}: exit {e.code}: {err.getvalue()}")
    except (cli.UsageError, group_perf.GroupUsageError, table.TableUsageError, ValueError) as e:
        pytest.fail(f"{where}: {shlex.join(argv)}: {e}")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "toml"], ids=lambda b: b.where)
def test_toml_block_is_daemon_configuration(block: Block, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "udpverbsd.toml"
    path.write_text(block.text)
    dconfig.configure(["--config", str(path)])


def _samples() -> list[tuple[str, list[str], list[str]]]:
    """The README's sample runs of RUN_TOOLS: (where, argv, the output shown)."""
    samples = []
    for block in (b for b in BLOCKS if b.lang == "console" and b.doc == "README.md"):
        lines = block.text.splitlines()
        for n, line in enumerate(lines):
            prompt = _PROMPT.match(line)
            argv = shlex.split(line[prompt.end():], comments=True) if prompt else []
            if argv[:1] == ["udpverbs"] and argv[1:2] and argv[1] in RUN_TOOLS:
                shown = []
                for out in lines[n + 1:]:
                    if _PROMPT.match(out):
                        break
                    shown.append(out)
                samples.append((f"{block.doc}:{block.line + 1 + n}", argv, shown))
    return samples


def _fields(lines: list[str]) -> list[str]:
    """``devinfo``'s field names (``name:`` starting a line)."""
    return [m.group(1) for m in (re.match(r"^\s*([a-z_][a-z_ ]*):", line) for line in lines) if m]


SAMPLES = _samples()


@pytest.mark.parametrize("where,argv,shown", SAMPLES, ids=[f"{w} {' '.join(a[:2])}" for w, a, _ in SAMPLES])
def test_tool_sample_output_matches_the_tool(where: str, argv: list[str], shown: list[str], reader: Reader) -> None:
    out = reader.run([sys.executable, "-m", "udpverbs.cli", *argv[1:]], where).splitlines()
    if argv[1] == "devices":
        assert out[0].split() == shown[0].split(), f"{where}: the columns differ"
        assert sorted(line.split()[0] for line in out[1:]) == ["uvA", "uvB"]
    else:
        assert set(_fields(shown)) <= set(_fields(out)), f"{where}: fields the tool no longer prints"
        # "impaired" is there for a daemon started with --impair only
        assert set(_fields(out)) <= set(_fields(shown)) | {"impaired"}, f"{where}: fields the sample does not show"
