"""``udpverbs run``: every rank's environment, its daemon, its output, the job's exit status, the clean-up.

The launcher runs as a child process (``python -m udpverbs.cli run``), as a
user runs it.  Ranks tell the test they are ready by printing a line; the
test never sleeps to wait.  Jobs that need no daemon use a hosts file naming
one that does not exist (nothing contacts it unless a rank opens its device).
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from udpverbs import cli, launch
from udpverbs.bench import local
from udpverbs.verbs.group import parse_members

from ..integration.daemons import DaemonProc

PY = sys.executable
#: A rank that opens its device and prints, as JSON, its environment and what its daemon says it is.
REPORT = r"""
import json, os
from udpverbs import verbs
out = {k: v for k, v in os.environ.items() if k.startswith("UDPVERBS_") or k == "PYTHONUNBUFFERED"}
out["runtime_dir_exists"] = os.path.isdir(out["UDPVERBS_RUNTIME_DIR"])
with verbs.Context() as ctx:
    out["gid_ip"], out["udp_port"] = ctx.query_gid().ip, ctx.udp_port
print(json.dumps(out))
"""
#: A hosts file line naming a daemon nobody runs: for jobs whose ranks open no device.
NOWHERE = "127.0.0.9 9"


def run_cmd(*args: str, env: dict[str, str] | None = None, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(local.cli_argv("run", *args), capture_output=True, text=True, timeout=timeout_s,
                          stdin=subprocess.DEVNULL, env=env, check=False)


def reports(stdout: str) -> dict[int, dict[str, object]]:
    """The JSON line each rank printed, by the rank its prefix names."""
    found = {}
    for line in stdout.splitlines():
        m = re.fullmatch(r"\[(\d+)\] (\{.*\})", line)
        assert m, f"not a prefixed report: {line!r}"
        found[int(m.group(1))] = json.loads(m.group(2))
    return found


@pytest.fixture
def hosts_file(tmp_path: Path) -> Callable[[str], str]:
    def write(text: str) -> str:
        path = tmp_path / "hosts"
        path.write_text(text)
        return str(path)
    return write


class Output:
    """A child's pipe read line by line against a deadline (select, no sleeps)."""

    def __init__(self, stream: object) -> None:
        self.fd = stream.fileno()  # type: ignore[attr-defined]
        self.lines: list[str] = []
        self.buf = b""
        self.eof = False

    def until(self, done: Callable[[list[str]], bool], timeout_s: float = 30) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while not done(self.lines):
            left = deadline - time.monotonic()
            when = "the end" if self.eof else "the deadline"
            assert not self.eof and left > 0, f"not seen before {when}: {self.lines}"
            if select.select([self.fd], [], [], left)[0]:
                data = os.read(self.fd, 1 << 16)
                self.eof = not data
                *full, self.buf = (self.buf + data).split(b"\n")
                self.lines += [line.decode() for line in full]
        return self.lines

    def rest(self, timeout_s: float = 30) -> list[str]:
        return self.until(lambda _: self.eof, timeout_s)


@pytest.fixture
def launcher() -> Iterator[Callable[..., tuple[subprocess.Popen[bytes], Output, Output]]]:
    """Start ``udpverbs run ARGS`` with its output piped; stopped by pid at the end whatever the test did."""
    started: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> tuple[subprocess.Popen[bytes], Output, Output]:
        # In a process group of its own, as a shell's foreground job: the test can Ctrl-C the group.
        proc = subprocess.Popen(local.cli_argv("run", *args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, process_group=0)
        started.append(proc)
        return proc, Output(proc.stdout), Output(proc.stderr)

    yield start
    for proc in started:
        local.stop_process(proc)
        for pipe in (proc.stdout, proc.stderr):
            assert pipe is not None
            pipe.close()


def pids_reported(stderr_lines: list[str]) -> dict[str, int]:
    """``--verbose``'s ``daemon uv0 pid P`` and ``rank 1 pid P`` lines, as {"uv0": P, "rank 1": P}."""
    found = {}
    for line in stderr_lines:
        if m := re.match(r"udpverbs run: (daemon (\S+)|(rank \d+)) pid (\d+)", line):
            found[m.group(2) or m.group(3)] = int(m.group(4))
    return found


def alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


# -- local jobs: the daemons the launcher starts ------------------------------------------------------------------


def test_every_rank_learns_its_rank_and_the_members_its_daemon_answers_as() -> None:
    done = run_cmd("-n", "3", "--daemons", "2", "--", PY, "-c", REPORT)
    assert done.returncode == 0, done.stderr
    ranks = reports(done.stdout)
    assert sorted(ranks) == [0, 1, 2]
    first = ranks[0]
    members = parse_members(str(first["UDPVERBS_MEMBERS"]))
    assert len(members) == 3
    for r, env in ranks.items():
        assert env["UDPVERBS_RANK"] == str(r) and env["UDPVERBS_SIZE"] == "3"
        assert env["UDPVERBS_DEVICE"] == f"uv{r * 2 // 3}"  # block placement: 0, 0, 1
        assert members[r] == (env["gid_ip"], env["udp_port"])  # the daemon it opened is its member entry
        assert env["PYTHONUNBUFFERED"] == "1" and env["runtime_dir_exists"] is True
        for key in ("UDPVERBS_MEMBERS", "UDPVERBS_GROUP", "UDPVERBS_RUNTIME_DIR"):
            assert env[key] == first[key], key
    assert [ip for ip, _ in members] == ["127.0.0.2", "127.0.0.2", "127.0.0.3"]
    assert re.fullmatch(r"run-\d+-\d+", str(first["UDPVERBS_GROUP"]))
    runtime_dir = str(first["UDPVERBS_RUNTIME_DIR"])
    assert runtime_dir != os.environ.get("UDPVERBS_RUNTIME_DIR") and not os.path.exists(runtime_dir)


def test_ctrl_c_stops_ranks_and_daemons_and_exits_130(launcher) -> None:  # type: ignore[no-untyped-def]
    proc, out, err = launcher("-v", "-n", "2", "--", PY, "-c", "import time; print('up'); time.sleep(60)")
    out.until(lambda lines: sorted(lines) == ["[0] up", "[1] up"])
    err.until(lambda lines: any("runtime dir" in line for line in lines))
    pids = pids_reported(err.lines)
    assert set(pids) == {"uv0", "rank 0", "rank 1"} and all(map(alive, pids.values()))
    runtime_dir = next(line for line in err.lines if "runtime dir" in line).rsplit(" ", 1)[1]
    assert os.path.isdir(runtime_dir)
    start = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    assert proc.wait(30) == 130
    assert time.monotonic() - start < local.STOP_GRACE_S  # the ranks went at SIGTERM: no waiting for the grace
    assert [name for name, pid in pids.items() if alive(pid)] == []
    assert not os.path.exists(runtime_dir)
    said = err.rest()
    assert any("SIGINT: stopping every process started" in line for line in said)
    # Only the launcher got the SIGINT: the ranks were stopped by it, with no KeyboardInterrupt of their own.
    assert not any("KeyboardInterrupt" in line for line in said), said


def test_a_daemon_that_dies_fails_the_job(launcher) -> None:  # type: ignore[no-untyped-def]
    proc, out, err = launcher("-v", "-n", "2", "--", PY, "-c", "import time; print('up'); time.sleep(60)")
    out.until(lambda lines: len(lines) == 2)
    pids = pids_reported(err.until(lambda lines: len(pids_reported(lines)) == 3))
    os.kill(pids["uv0"], signal.SIGTERM)  # the launcher's child, by the pid it reported: it stops cleanly
    assert proc.wait(30) == 1
    assert any("daemon uv0" in line and "exited with status 0: stopping every rank" in line for line in err.rest())
    assert [name for name, pid in pids.items() if alive(pid)] == []


# -- what does not need a daemon ------------------------------------------------------------------------------------


def test_lines_keep_their_rank_prefix_and_stay_whole(hosts_file) -> None:  # type: ignore[no-untyped-def]
    # Each line is written in two pieces with a flush between, so the launcher often reads half lines.
    code = (
        "import os, sys\n"
        "r = os.environ['UDPVERBS_RANK']\n"
        "for i in range(200):\n"
        "    f = sys.stdout if i % 2 else sys.stderr\n"
        "    f.write(f'{r} {i} ' + 'x' * 300); f.flush(); f.write('y' * 300 + '\\n'); f.flush()\n"
        "sys.stdout.write(f'{r} no newline')\n"
    )
    done = run_cmd("--hosts", hosts_file(f"{NOWHERE} slots=3\n"), "--", PY, "-c", code)
    assert done.returncode == 0, done.stderr
    for text, odd in ((done.stdout, 1), (done.stderr, 0)):
        seen: dict[str, list[int]] = {"0": [], "1": [], "2": []}
        for line in text.splitlines():
            if line.endswith("no newline"):
                assert odd and re.fullmatch(r"\[(\d)\] \1 no newline", line), line
                continue
            m = re.fullmatch(r"\[(\d)\] (\d) (\d+) x{300}y{300}", line)
            assert m and m.group(1) == m.group(2), f"mixed or torn line: {line[:80]!r}"
            seen[m.group(1)].append(int(m.group(3)))
        assert all(lines == list(range(odd, 200, 2)) for lines in seen.values()), "lost or reordered lines"
    assert done.stdout.count("no newline") == 3


def test_first_failure_sets_the_status_and_the_others_are_stopped(  # type: ignore[no-untyped-def]
        hosts_file, launcher, tmp_path) -> None:
    # Rank 1 fails once ranks 0 and 2 are ready; rank 2 answers SIGTERM with status 5 (later: not the job's);
    # rank 0 ignores SIGTERM, so only the SIGKILL after --grace ends it.
    fifo = str(tmp_path / "go")
    os.mkfifo(fifo)
    code = (
        "import os, signal, sys, time\n"
        "r = int(os.environ['UDPVERBS_RANK'])\n"
        "def bye(signum, frame):\n"
        "    print('got SIGTERM', flush=True); os._exit(5)\n"
        "signal.signal(signal.SIGTERM, {0: signal.SIG_IGN, 1: signal.SIG_DFL, 2: bye}[r])\n"
        "fd = os.open(sys.argv[1], os.O_RDWR) if r == 1 else None\n"
        "print('ready', flush=True)\n"
        "if r == 1:\n"
        "    os.read(fd, 1); sys.exit(3)\n"
        "time.sleep(60)\n"
    )
    proc, out, err = launcher("-v", "--grace", "0.5", "--hosts", hosts_file(f"{NOWHERE} slots=3\n"), "--",
                              PY, "-c", code, fifo)
    out.until(lambda lines: sorted(lines) == ["[0] ready", "[1] ready", "[2] ready"])
    pids = pids_reported(err.until(lambda lines: len(pids_reported(lines)) == 3))
    start = time.monotonic()
    go = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # rank 1 holds it open: this cannot block
    os.write(go, b"x")
    os.close(go)
    assert proc.wait(30) == 3
    assert time.monotonic() - start < local.STOP_GRACE_S  # --grace 0.5, not the default, bounded rank 0
    assert "[2] got SIGTERM" in out.rest()
    said = [line for line in err.rest() if "exited with status" in line]  # the first failure, and only it
    assert len(said) == 1 and "rank 1 (pid" in said[0] and "exited with status 3: stopping the other ranks" in said[0]
    assert [name for name, pid in pids.items() if alive(pid)] == []


def test_a_rank_killed_by_a_signal_is_128_plus_the_signal(hosts_file) -> None:  # type: ignore[no-untyped-def]
    done = run_cmd("--hosts", hosts_file(NOWHERE), "--", PY, "-c",
                   "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert done.returncode == 128 + signal.SIGKILL
    assert "rank 0" in done.stderr and f"status {128 + signal.SIGKILL}" in done.stderr


def test_timeout_stops_the_job_with_124(hosts_file) -> None:  # type: ignore[no-untyped-def]
    done = run_cmd("--timeout", "0.5", "--hosts", hosts_file(f"{NOWHERE} slots=2"), "--", PY, "-c",
                   "import time; time.sleep(60)", timeout_s=30)
    assert done.returncode == launch.TIMEOUT_STATUS, done.stderr
    assert "--timeout 0.5 s reached" in done.stderr


def test_sigterm_to_the_launcher_exits_143(hosts_file, launcher) -> None:  # type: ignore[no-untyped-def]
    proc, out, err = launcher("-v", "--hosts", hosts_file(NOWHERE), "--", PY, "-c",
                              "import time; print('up'); time.sleep(60)")
    out.until(lambda lines: lines == ["[0] up"])
    pid = pids_reported(err.until(lambda lines: bool(pids_reported(lines))))["rank 0"]
    proc.terminate()
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert not alive(pid)


def test_a_command_that_cannot_start_exits_127(hosts_file, capsys) -> None:  # type: ignore[no-untyped-def]
    assert cli.main(["run", "--hosts", hosts_file(NOWHERE), "--", "/nonexistent/udpverbs-no-such-command"]) == 127
    assert "cannot start rank 0: /nonexistent/udpverbs-no-such-command: No such file" in capsys.readouterr().err


# -- --hosts: daemons someone else started ----------------------------------------------------------------------------


def test_hosts_file_names_running_daemons_and_ranks_here_take_their_slice(  # type: ignore[no-untyped-def]
        hosts_file) -> None:
    with tempfile.TemporaryDirectory(prefix="udpverbs-test-") as d, \
            DaemonProc("uvA", "127.0.0.2", d, seed=21) as a, DaemonProc("uvB", "127.0.0.3", d, seed=22) as b:
        hosts = hosts_file(f"# two daemons, three ranks\n127.0.0.2 {a.port} slots=2 device=uvA\n\n"
                           f"127.0.0.3   {b.port}   # no device=: --device names it\n")
        env = dict(os.environ, UDPVERBS_RUNTIME_DIR=d)
        done = run_cmd("--hosts", hosts, "--rank-base", "1", "-n", "2", "--device", "uvB", "--name", "job7",
                       "--", PY, "-c", REPORT, env=env)
        assert done.returncode == 0, done.stderr
        ranks = reports(done.stdout)
        assert sorted(ranks) == [1, 2]
        for r, device in ((1, "uvA"), (2, "uvB")):
            env_r = ranks[r]
            members = parse_members(str(env_r["UDPVERBS_MEMBERS"]))
            assert members == [("127.0.0.2", a.port), ("127.0.0.2", a.port), ("127.0.0.3", b.port)]
            assert members[r] == (env_r["gid_ip"], env_r["udp_port"])
            assert (env_r["UDPVERBS_DEVICE"], env_r["UDPVERBS_RANK"], env_r["UDPVERBS_SIZE"]) == (device, str(r), "3")
            assert (env_r["UDPVERBS_GROUP"], env_r["UDPVERBS_RUNTIME_DIR"]) == ("job7", d)
        # Not ours to stop: the daemons still serve.
        assert a.proc is not None and a.proc.poll() is None and b.proc is not None and b.proc.poll() is None


def test_parse_hosts_and_the_member_list() -> None:
    lines = launch.parse_hosts("10.0.0.1 18515 slots=2 device=uvX  # a comment\n\n::1 7000\n")
    assert lines == [launch.HostLine("10.0.0.1", 18515, 2, "uvX"), launch.HostLine("::1", 7000, 1, None)]
    plan = launch.hosts_plan(lines, 0, None, "uv0", "g", "/run")
    assert plan.members == (("10.0.0.1", 18515), ("10.0.0.1", 18515), ("::1", 7000))
    assert plan.here == ((0, "uvX"), (1, "uvX"), (2, "uv0"))
    assert plan.env(2, "uv0", {})["UDPVERBS_MEMBERS"] == "10.0.0.1:18515,10.0.0.1:18515,[::1]:7000"


def test_block_placement_is_mpiruns_map_by_slot() -> None:
    assert [launch.block_placement(r, 5, 2) for r in range(5)] == [0, 0, 0, 1, 1]
    assert [launch.block_placement(r, 4, 4) for r in range(4)] == [0, 1, 2, 3]
    assert [launch.block_placement(r, 6, 3) for r in range(6)] == [0, 0, 1, 1, 2, 2]


# -- usage errors: exit 2 with a message, nothing started -------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["-n", "2"], "no command: write it after '--'"),
        (["--", "true"], "-n N is required"),
        (["-n", "0", "--", "true"], "-n must be 1 or more"),
        (["-n", "2", "--daemons", "3", "--", "true"], "a daemon would serve no rank"),
        (["-n", "300", "--daemons", "254", "--", "true"], "--daemons must be from 1 to 253"),
        (["-n", "2", "--rank-base", "1", "--", "true"], "--rank-base goes with --hosts"),
        (["-n", "2", "--device", "uvX", "--", "true"], "--device goes with --hosts"),
        (["-n", "2", "--timeout", "0", "--", "true"], "--timeout must be more than 0"),
        (["-n", "2", "--grace", "-1", "--", "true"], "--grace must be from 0"),
        (["-n", "2", "--daemon-arg=--port=5", "--", "true"], "udpverbs run sets --port itself"),
        (["-n", "2", "--daemon-arg=--mtu=9000", "--", "true"], "udpverbs run sets --mtu itself"),
        (["-n", "2", "--daemon-arg=--cc=bogus", "--", "true"], "unknown congestion controller 'bogus'"),
        (["--hosts", "/nonexistent/hosts", "--", "true"], "--hosts /nonexistent/hosts: [Errno 2]"),
    ],
)
def test_usage_errors(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("udpverbs run: error: ") and fragment in err, err


@pytest.mark.parametrize(
    "text, argv, fragment",
    [
        ("127.0.0.2 5000 slots=2\n", ["--rank-base", "1", "-n", "2", "--name", "j"],
         "ranks 1..2 asked for (--rank-base 1 -n 2), but the hosts file makes a job of 2 ranks (0..1)"),
        ("127.0.0.2 5000\n", ["--rank-base", "1"], "--rank-base 1 is not in the job"),
        ("127.0.0.2 5000 slots=2\n", ["--rank-base", "1"], "--name is required when the ranks here are not the whole"),
        ("nohost 5000\n", [], "hosts:1: 'nohost' is not an IP address"),
        ("# first\n127.0.0.2\n", [], "hosts:2: expected 'ADDRESS PORT [slots=K] [device=NAME]'"),
        ("127.0.0.2 70000\n", [], "hosts:1: port must be a whole number from 1 to 65535, got '70000'"),
        ("127.0.0.2 5000 slots=0\n", [], "slots must be a whole number from 1"),
        ("127.0.0.2 5000 colour=red\n", [], "unknown field 'colour=red'"),
        ("127.0.0.2 5000 slots=1 slots=2\n", [], "slots= given twice"),
        ("127.0.0.2 5000 device=a/b\n", [], "device='a/b' is not a device name"),
        ("# nothing but a comment\n", [], "names no daemon"),
        ("127.0.0.2 5000\n", ["--daemons", "2"], "--daemons goes without --hosts"),
        ("127.0.0.2 5000\n", ["--daemon-arg=--cc=aimd"], "--daemon-arg goes without --hosts"),
        ("127.0.0.2 5000\n", ["--device", "a b"], "--device 'a b' is not a device name"),
    ],
)
def test_hosts_usage_errors(text: str, argv: list[str], fragment: str, hosts_file,  # type: ignore[no-untyped-def]
                            capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--hosts", hosts_file(text), *argv, "--", "true"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("udpverbs run: error: ") and fragment in err, err


def test_hosts_file_errors_are_typed() -> None:
    with pytest.raises(launch.HostsFileError, match=r"^jobhosts:1: 'x' is not an IP address"):
        launch.parse_hosts("x 1\n", "jobhosts")
    assert issubclass(launch.HostsFileError, launch.RunUsageError)
