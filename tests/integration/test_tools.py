"""The operator's tools against real daemons: ``udpverbs devices``, ``devinfo``,
``stat`` (and ``--watch``), ``--version``, the Prometheus endpoint and the log.

Each test starts its daemons in a runtime directory of its own (the tools
find daemons there), so what a listing holds is exactly what the test made.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any, Iterator

import pytest

from udpverbs import cli, tools, verbs
from udpverbs.daemon import status
from udpverbs.daemon.clusterkey import write_new_key
from udpverbs.wire.ctl import Op, StatusSection
from udpverbs.verbs.enums import IBV_SEND_SIGNALED, IBV_WC_SUCCESS, IBV_WR_RDMA_WRITE, IBV_WR_SEND

from .conftest import Side, connect_manual
from .daemons import DaemonProc, running

#: the keys the documentation promises (daemon/status.py, docs/REFERENCE.md)
DEVICE_KEYS = {"name", "version", "ctl_version", "pid", "state", "addr", "udp_port", "gid", "node_guid", "mtu", "cc",
               "gso", "native", "started", "uptime_s", "clients", "qps", "links", "cqs", "mrs", "pds", "metrics",
               "addrs", "cluster_key", "impair", "limits", "counters"}
LIMIT_KEYS = {"max_qp", "max_cq", "max_mr", "max_pd", "max_qp_wr", "max_cqe", "max_sge", "max_inline_data",
              "max_mr_size", "max_msg_sz", "max_qp_rd_atom", "max_qp_init_rd_atom", "atomic_cap"}
LINK_KEYS = {"peer", "addr", "port", "state", "qps", "datagrams_sent", "datagrams_received", "bytes_sent",
             "bytes_received", "retransmits", "duplicates", "bad_crc", "srtt_us", "min_rtt_us", "rto_ms",
             "cwnd_bytes", "pacing_Bps", "bytes_in_flight", "plpmtu", "pmtud", "counters"}
QP_KEYS = {"qpn", "pid", "state", "peer", "dest_qp_num", "sq_posted", "sq_completed", "rq_posted", "rq_completed",
           "srq", "outstanding", "rnr_nacks_received", "rnr_nacks_sent"}
DEVICES_KEYS = {"name", "socket", "state", "pid", "addr", "udp_port", "gid", "mtu", "cc", "uptime_s", "version",
                "clients", "qps", "links", "metrics"}
WRITE = 65536


@pytest.fixture
def rundir(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="udpverbs-tools-") as d:
        monkeypatch.setenv("UDPVERBS_RUNTIME_DIR", d)
        yield d


@pytest.fixture
def daemons(rundir: str) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    """uvA (with the metrics endpoint on 127.0.0.2, a free port) and uvB, fresh
    for each test, in its own runtime directory (``conftest.pair`` uses them)."""
    with running(DaemonProc("uvA", "127.0.0.2", rundir, seed=21, extra=("--metrics", "127.0.0.2:0")),
                 DaemonProc("uvB", "127.0.0.3", rundir, seed=22)) as (a, b):
        yield a, b


def run(*argv: str) -> tuple[int, str]:
    """``udpverbs ARGV`` in this process: (exit status, stdout)."""
    out = io.StringIO()
    args = cli.build_parser().parse_args(list(argv))
    return tools.main(args, out), out.getvalue()


def write(a: Side, b: Side, count: int) -> None:
    """``count`` signaled 64 KiB RDMA Writes from a into b, each waited for."""
    for i in range(count):
        wr = verbs.SendWR(wr_id=i, opcode=IBV_WR_RDMA_WRITE, sg=[verbs.SGE(a.mr.buf, WRITE, a.mr.lkey)],
                          send_flags=IBV_SEND_SIGNALED)
        wr.set_wr_rdma(b.mr.rkey, b.mr.buf)
        a.qp.post_send(wr)
        (wc,) = a.cq.poll_blocking(1, timeout=10)
        assert wc.status == IBV_WC_SUCCESS, wc


def stat_of(*argv: str) -> dict[str, Any]:
    """``udpverbs stat --json ARGV``'s one sample, devices by name."""
    rc, text = run("stat", "--json", *argv)
    assert rc == 0, text
    sample = json.loads(text)
    return {d["name"]: d for d in sample["devices"]}


# -- devices --------------------------------------------------------------------------------
def test_devices_lists_each_daemon_with_its_address_port_and_a_stale_socket(
        daemons: tuple[DaemonProc, DaemonProc], rundir: str) -> None:
    a, b = daemons
    stale = os.path.join(rundir, "gone.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(stale)  # a socket file nobody listens on: what a killed daemon leaves
    s.close()
    rc, text = run("devices", "--json")
    assert rc == 0
    rows = {r["name"]: r for r in json.loads(text)}
    assert set(rows) == {"uvA", "uvB", "gone"}
    for d in (a, b):
        row = rows[d.name]
        assert set(row) == DEVICES_KEYS
        assert (row["state"], row["addr"], row["udp_port"], row["mtu"], row["cc"]) == \
            ("serving", d.addr, d.port, 1472, "efe-host")
        assert d.proc is not None and row["pid"] == d.proc.pid
        assert row["socket"] == d.socket_path and row["uptime_s"] >= 0
    assert rows["uvA"]["metrics"].startswith("http://127.0.0.2:") and rows["uvB"]["metrics"] is None
    assert rows["gone"]["state"] == "stale" and "nobody serves it" in rows["gone"]["error"]
    rc, text = run("devices")
    lines = text.splitlines()
    assert lines[0].split() == ["device", "state", "address", "udp", "port", "mtu", "cc", "uptime", "pid", "socket"]
    assert any(line.split()[:4] == ["uvA", "serving", "127.0.0.2", str(a.port)] for line in lines)
    assert any(line.split()[:4] == ["uvB", "serving", "127.0.0.3", str(b.port)] for line in lines)
    assert any(line.startswith("gone: ") and "nobody serves it" in line for line in lines)


def test_devices_says_so_when_no_daemon_runs(rundir: str) -> None:
    rc, text = run("devices")
    assert rc == 0 and text.startswith(f"no udpverbs daemon: no control socket in {rundir}")
    assert run("devices", "--json") == (0, "[]\n")
    rc, text = run("stat")
    assert rc == 1 and "no udpverbs daemon" in text


def test_a_daemon_that_does_not_answer_is_shown_as_such_within_the_timeout(
        daemons: tuple[DaemonProc, DaemonProc]) -> None:
    a, _ = daemons
    assert a.proc is not None
    os.kill(a.proc.pid, signal.SIGSTOP)  # our own child: alive, its socket accepts, nobody answers
    try:
        t0 = time.monotonic()
        rc, text = run("devices", "--json", "--timeout", "0.5")
        took = time.monotonic() - t0
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    rows = {r["name"]: r for r in json.loads(text)}
    assert rows["uvA"]["state"] == "not answering" and rows["uvB"]["state"] == "serving"
    assert took < 5


# -- devinfo --------------------------------------------------------------------------------
def test_devinfo_shows_identity_and_with_v_the_limits(daemons: tuple[DaemonProc, DaemonProc]) -> None:
    a, _ = daemons
    rc, text = run("devinfo", "-d", "uvA")
    assert rc == 0
    assert text.startswith("hca_id: uvA\n")
    fields = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in text.splitlines()[1:]}
    assert fields["address"] == "127.0.0.2" and fields["udp port"].startswith(f"{a.port} ")
    assert fields["congestion control"] == "efe-host" and fields["mtu"].startswith("1472 ")
    assert fields["gid"] == "0000:0000:0000:0000:0000:ffff:7f00:0002"
    assert "max_qp" not in fields
    rc, text = run("devinfo", "-d", a.socket_path, "-v")  # a socket path works as -d too
    for name in ("max_qp", "max_cq", "max_mr", "max_sge", "max_inline_data", "max_msg_sz", "max_qp_rd_atom",
                 "max_qp_init_rd_atom", "atomic_cap"):
        assert f"\t{name}:" in text, name
    rc, text = run("devinfo", "--json")
    docs = {d["name"]: d for d in json.loads(text)}
    assert set(docs) == {"uvA", "uvB"}
    assert set(docs["uvA"]) == DEVICE_KEYS | {"socket"}
    assert set(docs["uvA"]["limits"]) == LIMIT_KEYS
    assert docs["uvA"]["limits"]["atomic_cap"] == "IBV_ATOMIC_HCA" and docs["uvA"]["limits"]["max_sge"] == 16
    # the limits are the ones the verbs library reads (HELLO)
    with verbs.Context(socket_path=a.socket_path) as ctx:
        attr = ctx.query_device()
        for key in ("max_qp", "max_cq", "max_mr", "max_pd", "max_qp_wr", "max_cqe", "max_sge", "max_inline_data",
                    "max_mr_size", "max_qp_rd_atom", "max_qp_init_rd_atom"):
            assert docs["uvA"]["limits"][key] == getattr(attr, key), key


def test_devinfo_of_a_missing_device_fails_clearly(daemons: tuple[DaemonProc, DaemonProc]) -> None:
    rc, text = run("devinfo", "-d", "nosuch", "--json")
    assert rc == 1
    (doc,) = json.loads(text)
    assert doc["state"] == "absent" and "no daemon serves it" in doc["error"]


def test_devinfo_says_whether_a_cluster_key_is_set_and_what_impairs_the_daemon(rundir: str) -> None:
    key = os.path.join(rundir, "cluster.key")
    write_new_key(key)
    with running(DaemonProc("uvK", "127.0.0.2", rundir, seed=23,
                            extra=(f"--key-file={key}", "--impair=loss=0.01"))) as (d,):
        rc, text = run("devinfo", "-d", d.socket_path, "--json")
        assert rc == 0
        (doc,) = json.loads(text)
        assert doc["cluster_key"] is True and doc["impair"] == "loss=0.01"
        rc, text = run("devinfo", "-d", d.socket_path)
        assert "cluster key:" in text and "set: every datagram authenticated" in text
        assert "impaired:" in text and "loss=0.01" in text


# -- stat -----------------------------------------------------------------------------------
def test_stat_counts_each_links_traffic_both_ways_and_each_qps_work_requests(pair: tuple[Side, Side]) -> None:
    a, b = pair
    write(a, b, 10)
    devs = stat_of()
    sa, sb = devs["uvA"], devs["uvB"]
    assert set(sa) == {"name", "socket", "state", "device", "links", "qps"}
    assert set(sa["device"]) == DEVICE_KEYS
    assert sa["device"]["clients"] == 1  # the application; the asking tool is left out
    (la,), (lb,) = sa["links"], sb["links"]
    assert set(la) == LINK_KEYS and la["state"] == "ESTABLISHED" and la["qps"] == 1
    assert la["peer"] == f"127.0.0.3:{b.ctx.query_port().lid}"
    # 10 Writes of 64 KiB went from A to B: at least their payload, in 45 datagrams each or more
    assert la["bytes_sent"] > 10 * WRITE and la["datagrams_sent"] >= 10 * 45
    assert lb["bytes_received"] > 10 * WRITE and lb["datagrams_received"] >= 10 * 45
    assert 0 < la["bytes_received"] < la["bytes_sent"] // 10  # the ACKs coming back
    assert la["srtt_us"] > 0 and 0 < la["min_rtt_us"] <= la["srtt_us"] * 4 and la["cwnd_bytes"] > 0
    assert la["plpmtu"] == sa["device"]["mtu"] and la["pmtud"] == "SEARCH_COMPLETE"  # --mtu, all a path allows
    (qa,), (qb,) = sa["qps"], sb["qps"]
    assert set(qa) == QP_KEYS
    assert (qa["qpn"], qa["state"], qa["pid"], qa["dest_qp_num"]) == (a.qp.qp_num, "IBV_QPS_RTS", os.getpid(),
                                                                      b.qp.qp_num)
    assert (qa["sq_posted"], qa["sq_completed"], qa["outstanding"]) == (10, 10, 0)
    assert (qb["sq_posted"], qb["rq_posted"], qb["rq_completed"]) == (0, 0, 0)
    text = run("stat", "-d", "uvA")[1]
    assert "uvA: serving, 127.0.0.2:" in text and "  links: 1" in text and "  qps: 1" in text
    assert f"127.0.0.3:{b.ctx.query_port().lid}  ESTABLISHED" in text


def test_stat_counts_rnr_nacks_per_qp(pair: tuple[Side, Side]) -> None:
    a, b = pair
    a.mr.write(b"hello")
    a.qp.post_send(verbs.SendWR(wr_id=1, opcode=IBV_WR_SEND, sg=[verbs.SGE(a.mr.buf, 5, a.mr.lkey)],
                                send_flags=IBV_SEND_SIGNALED))
    deadline = time.monotonic() + 10
    while stat_of("-d", "uvB")["uvB"]["qps"][0]["rnr_nacks_sent"] == 0:  # no receive posted: NACKed
        assert time.monotonic() < deadline
        time.sleep(0.01)
    b.qp.post_recv(verbs.RecvWR(wr_id=2, sg=[verbs.SGE(b.mr.buf, 64, b.mr.lkey)]))
    (wc,) = a.cq.poll_blocking(1, timeout=10)
    assert wc.status == IBV_WC_SUCCESS
    devs = stat_of()
    (qa,), (qb,) = devs["uvA"]["qps"], devs["uvB"]["qps"]
    assert qa["rnr_nacks_received"] >= 1 and qb["rnr_nacks_sent"] >= 1
    assert (qb["rq_posted"], qb["rq_completed"]) == (1, 1)


def test_stat_watch_gives_rates_per_second(pair: tuple[Side, Side]) -> None:
    a, b = pair
    write(a, b, 1)  # the link's first RTT sample
    done = threading.Event()
    moved = []

    def traffic() -> None:
        end = time.monotonic() + 30
        while not done.is_set() and len(moved) < 200_000 and time.monotonic() < end:  # until the samples are taken
            write(a, b, 1)
            moved.append(1)

    t = threading.Thread(target=traffic)
    t.start()
    try:
        rc, text = run("stat", "--json", "--watch", "0.3", "-c", "3", "-d", "uvA")
    finally:
        done.set()
        t.join(30)
    assert rc == 0
    samples = [json.loads(line) for line in text.splitlines()]
    assert len(samples) == 3
    assert samples[0]["interval_s"] is None and 0.2 < samples[1]["interval_s"] < 3
    first, last = samples[0]["devices"][0], samples[2]["devices"][0]
    assert "rates" not in first["links"][0]
    rates = last["links"][0]["rates"]
    assert rates["bytes_sent_per_s"] > WRITE and rates["datagrams_sent_per_s"] > 0
    assert last["qps"][0]["rates"]["sq_completed_per_s"] > 0
    # text, not on a terminal: one frame after the other, with the rate columns
    rc, text = run("stat", "--watch", "0.1", "-c", "2", "-d", "uvA")
    assert rc == 0 and text.count("udpverbs stat, every 0.1 s") == 2 and "\x1b[" not in text
    assert "out/s" in text and "sq done/s" in text


def test_qps_come_in_pages(daemons: tuple[DaemonProc, DaemonProc]) -> None:
    side = Side(daemons[0])
    try:
        qps = [side.qp] + [side.new_qp() for _ in range(status.QPS_PER_PAGE + 9)]  # two pages
        with verbs.Context(socket_path=daemons[0].socket_path) as ctx:
            rep, _ = ctx.call(Op.QUERY_STATUS, section=int(StatusSection.QPS), start=0)
            first = json.loads(rep.data)["qps"]
            assert len(first) == status.QPS_PER_PAGE and rep.next == first[-1]["qpn"] + 1
        devs = stat_of("-d", "uvA")
        assert sorted(q["qpn"] for q in devs["uvA"]["qps"]) == sorted(q.qp_num for q in qps)
    finally:
        side.close()


# -- the Prometheus endpoint --------------------------------------------------------------------
def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_endpoint_serves_the_same_counters_on_the_address_given_only(
        pair: tuple[Side, Side], daemons: tuple[DaemonProc, DaemonProc]) -> None:
    a, b = pair
    write(a, b, 5)
    url = stat_of("-d", "uvA")["uvA"]["device"]["metrics"]
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    metrics = _scrape(url)
    link = stat_of("-d", "uvA")["uvA"]["links"][0]
    labels = (("device", "uvA"), ("peer", link["peer"]))
    assert metrics[("udpverbs_link_bytes_sent_total", labels)] == link["bytes_sent"] > 5 * WRITE
    assert metrics[("udpverbs_link_datagrams_sent_total", labels)] == link["datagrams_sent"]
    assert metrics[("udpverbs_link_up", labels)] == 1
    assert metrics[("udpverbs_qps", (("device", "uvA"),))] == 1
    assert metrics[("udpverbs_data_busy_us_total", (("device", "uvA"),))] > 0
    info = [k for k in metrics if k[0] == "udpverbs_info"]
    assert dict(info[0][1])["udp_port"] == str(daemons[0].port)
    # bound to 127.0.0.2 alone: the same port on another loopback address refuses
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.3", port), timeout=5).close()


def test_metrics_flag_is_checked_before_anything_starts(rundir: str) -> None:
    d = DaemonProc("uvM", "127.0.0.4", rundir, extra=("--metrics", "localhost:9464"))
    with pytest.raises(RuntimeError, match="expected ADDR:PORT with an IP address"):
        d.start()


# -- the log --------------------------------------------------------------------------------
def _wait_for(d: DaemonProc, text: str) -> None:
    deadline = time.monotonic() + 10
    while text not in d.log_text():
        assert time.monotonic() < deadline, d.log_text()
        time.sleep(0.01)


#: a client that makes a QP, CQ and MR and exits without closing them (a crash)
CRASHING_CLIENT = """
import os, sys
from udpverbs import verbs
ctx = verbs.Context(socket_path=sys.argv[1])
pd = verbs.PD(ctx)
mr = verbs.MR(pd, 4096, 1)
cq = verbs.CQ(ctx, 4)
qp = verbs.QP(pd, verbs.QPInitAttr(qp_type=2, scq=cq, rcq=cq, cap=verbs.QPCap(4, 4, 1, 1)))
os._exit(0)
"""


def test_log_has_client_connect_disconnect_link_up_down_and_qp_errors(rundir: str) -> None:
    a = DaemonProc("uvA", "127.0.0.2", rundir, seed=31).start()
    try:
        b = DaemonProc("uvB", "127.0.0.3", rundir, seed=32).start()
        try:
            sa, sb = Side(a), Side(b)
            connect_manual(sa, sa.qp, sb, sb.qp)
            write(sa, sb, 1)
            assert b.stop() == 0  # with its application still on it
            _wait_for(a, "-> ERR")
            sa.close()
            with contextlib.suppress(verbs.VerbsError):
                sb.close()  # its daemon is gone
            pid = os.getpid()
            _wait_for(a, f"client pid {pid} disconnected")
            crash = subprocess.run([sys.executable, "-c", CRASHING_CLIENT, a.socket_path], timeout=60)
            assert crash.returncode == 0
            _wait_for(a, "destroying what it left")
        finally:
            b.stop()
    finally:
        assert a.stop() == 0
    log_a, log_b = a.log_text(), b.log_text()
    assert f"client pid {pid} (" in log_a and ") connected" in log_a
    assert f"client pid {pid} disconnected\n" in log_a
    assert "disconnected; destroying what it left: 1 QPs, 1 CQs, 1 MRs" in log_a
    assert f"link to 127.0.0.3:{b.port} up" in log_a
    assert f"link to 127.0.0.3:{b.port} ended: abort_received" in log_a
    assert f"qp {sa.qp.qp_num} of pid {pid} -> ERR (peer 127.0.0.3:{b.port} qp {sb.qp.qp_num}): " in log_a
    assert f"link to 127.0.0.2:{a.port} up" in log_b
    # no line per datagram at INFO: the daemon's lines are few
    assert len(log_a.splitlines()) < 20, log_a


def test_a_failed_start_logs_why_and_no_stats(rundir: str) -> None:
    taken = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    taken.bind(("127.0.0.4", 0))
    try:
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "udpverbs.daemon", "--name", "uvF", "--addr", "127.0.0.4",
                               "--port", str(port), "--socket", os.path.join(rundir, "uvF.sock")],
                              capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert proc.returncode == 1
    assert f"cannot bind UDP 127.0.0.4:{port}" in proc.stderr
    assert "stats:" not in proc.stderr and "link " not in proc.stderr, proc.stderr


# -- --version ------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [["-m", "udpverbs.cli"], ["-m", "udpverbs.daemon"]])
def test_version(command: list[str]) -> None:
    proc = subprocess.run([sys.executable, *command, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    import udpverbs
    name = "udpverbs" if command[1] == "udpverbs.cli" else "udpverbsd"
    assert proc.stdout.strip() == f"{name} {udpverbs.__version__} (control protocol 3)"


# -- contrib/: the systemd unit and the sample configuration ------------------------------------
CONTRIB = os.path.join(os.path.dirname(__file__), "..", "..", "contrib")


def test_sample_configuration_is_what_the_daemon_accepts() -> None:
    from udpverbs.daemon import config

    cfg = config.configure(["--config", os.path.join(CONTRIB, "uv0.toml"), "--name", "uv0"])
    assert (cfg["name"], cfg["addr"], cfg["port"], cfg["mtu"], cfg["cc"]) == ("uv0", "192.0.2.1", 18515, 1472,
                                                                              "efe-host")
    assert cfg["link"] == {"dead_peer_s": 5.0} and cfg["quota"].qp == 1024


def test_systemd_unit_runs_one_daemon_per_name_from_its_toml(tmp_path: Any) -> None:
    with open(os.path.join(CONTRIB, "udpverbsd@.service")) as f:
        unit = f.read()
    (exec_start,) = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    assert exec_start.endswith("udpverbsd --config /etc/udpverbs/%i.toml --name %i")
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("no systemd-analyze to check the unit's syntax with")
    # the unit as installed, with ExecStart pointing at a program that exists here
    unit_path = tmp_path / "udpverbsd@.service"
    unit_path.write_text(unit.replace(exec_start.split()[0][len("ExecStart="):], sys.executable))
    proc = subprocess.run([analyze, "verify", "--man=no", f"{unit_path}"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr  # unknown keys are only warned of


def test_docs_name_the_tools_and_every_field_they_print() -> None:
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    with open(os.path.join(root, "README.md")) as f:
        readme = f.read()
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    for tool in ("udpverbs devices", "udpverbs devinfo", "udpverbs stat --watch"):
        assert tool in quick_start, tool
    with open(os.path.join(root, "docs", "REFERENCE.md")) as f:
        reference = f.read()
    for key in sorted(DEVICE_KEYS | LIMIT_KEYS | LINK_KEYS | QP_KEYS | DEVICES_KEYS):
        assert key in reference, key
