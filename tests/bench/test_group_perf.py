"""udpverbs perf lock_lat / barrier_lat: flags, figures, rows, the Compare-and-Swap baseline, and tiny real runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from udpverbs import cli
from udpverbs.bench import group_perf as gp
from udpverbs.bench import local
from udpverbs.bench.stats import latency_stats

LAT = {"t_min_us", "t_max_us", "t_typical_us", "t_avg_us", "t_stdev_us", "t_p99_us", "t_p999_us"}


def _params(*argv: str) -> gp.GroupParams:
    return gp.params_from_args(gp.build_parser().parse_args(list(argv)))


# -- flags ----------------------------------------------------------------------------------------
def test_barrier_flags_are_read_together() -> None:
    p = _params("barrier_lat", "--local", "-P", "2,4,32", "--algorithm", "all", "--arity", "4", "-n", "50",
                "--daemons", "3")
    assert (p.procs, p.algorithms, p.arity, p.iters) == ((2, 4, 32), gp.ALGORITHMS, 4, 50)
    assert [p.daemons_for(n) for n in (2, 4, 32)] == [2, 3, 3]
    assert _params("barrier_lat", "--local").daemons_for(32) == gp.DEFAULT_DAEMONS
    assert _params("lock_lat", "--local", "--baseline", "cas-lock").baseline == "cas-lock"


@pytest.mark.parametrize("argv, message", [
    (["lock_lat"], "--local"),
    (["lock_lat", "--local", "-P", "4"], "-P"),
    (["lock_lat", "--local", "--baseline-only"], "--baseline cas-lock"),
    (["barrier_lat", "--local", "--baseline", "cas-lock"], "lock_lat"),
    (["barrier_lat", "--local", "-P", "1,2"], "between 2"),
    (["barrier_lat", "--local", "-P", "2,x"], "commas"),
    (["barrier_lat", "--local", "--arity", "1"], "--arity"),
    (["barrier_lat", "--local", "-n", "0"], "-n"),
    (["barrier_lat", "--local", "--daemon-arg=--port=5"], "--port"),
    (["barrier_lat", "--local", "--hold-us", "5"], "lock_lat"),
    (["lock_lat", "--local", "--hold-us", "-1"], "--hold-us"),
])
def test_bad_flags_are_usage_errors(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert cli.main(["perf", *argv]) == 2
    assert message in capsys.readouterr().err


def test_perf_lists_the_group_tests(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["perf", "--help"])
    out = capsys.readouterr().out
    assert "lock_lat" in out and "barrier_lat" in out


# -- placement and lock managers ----------------------------------------------------------------------
def test_lock_managers() -> None:
    a, b, c = ("127.0.0.2", 1000), ("127.0.0.3", 1001), ("127.0.0.4", 1002)
    members = [a, a, b, b, c]
    assert [gp.manager_of(k, members) for k in range(6)] == [a, a, b, b, c, a]
    assert gp.lock_managed_by(a, members) == 1 and gp.lock_managed_by(b, members) == 2
    assert gp.lock_managed_by(c, members, start=5) == 9
    with pytest.raises(ValueError):
        gp.lock_managed_by(("127.0.0.9", 1), members)


def test_spread_placement_crosses_ranks_and_daemons() -> None:
    F = frozenset
    daemons, ranks = gp.spread_placement(3, [0, 0, 1, 2], [4, 6])
    assert daemons == [F([4]), F([6]), F([4])]
    assert ranks == [F([6]), F([6]), F([4]), F([6])]
    assert gp.spread_placement(2, [0, 1], [0]) == ([None, None], [None, None])


# -- figures ----------------------------------------------------------------------------------------
def test_handoff_samples_count_only_changes_of_holder() -> None:
    # rank 0 holds [0, 10] and [40, 50]; rank 1 holds [15, 30]
    samples, acquisitions = gp.handoff_samples([[0, 40], [15]], [[10, 50], [30]])
    assert (samples, acquisitions) == ([5, 10], 3)
    samples, _ = gp.handoff_samples([[0, 20]], [[10, 30]])  # one rank alone: no hand-off
    assert samples == []


def test_handoff_samples_catch_a_lock_held_twice() -> None:
    with pytest.raises(gp.GroupRunError, match="held twice"):
        gp.handoff_samples([[0], [5]], [[10], [20]])


def test_barrier_samples_run_from_last_exit_to_last_exit() -> None:
    exits = [[0, 100, 250], [10, 120, 240]]
    assert gp.barrier_samples(exits) == [110, 130]


def test_barrier_samples_catch_a_rank_leaving_early() -> None:
    with pytest.raises(gp.GroupRunError, match="before every rank"):
        gp.barrier_samples([[0, 100], [200, 300]])
    with pytest.raises(gp.GroupRunError, match="barriers"):
        gp.barrier_samples([[0, 1], [0]])


# -- rows -------------------------------------------------------------------------------------------
def _barrier_rows() -> list[gp.GroupRow]:
    return [gp.GroupRow("barrier_lat", p, min(4, p), latency_stats([1000 * p, 2000 * p]), algorithm=a,
                        arity=2 if a == "tree" else None)
            for a in gp.ALGORITHMS for p in (2, 4, 8)]


def test_rows_in_json_and_in_the_table() -> None:
    row = _barrier_rows()[1]
    obj = gp.row_json(row)
    assert {"test", "procs", "algorithm", "arity", "daemons", "iterations"} | LAT <= obj.keys()
    assert (obj["procs"], obj["algorithm"], obj["arity"], obj["daemons"]) == (4, "tree", 2, 4)
    assert obj["t_typical_us"] == 6.0 and obj["t_p99_us"] == 8.0
    assert " tree " in gp.format_row(row) and len(gp.format_row(row).split()) == 12
    lock = gp.GroupRow("lock_lat", 2, 2, latency_stats([3000, 5000]), "group", "handoff", acquisitions=4,
                       ratio_to_atomic=0.5)
    obj = gp.row_json(lock)
    assert (obj["lock"], obj["case"], obj["acquisitions"], obj["ratio_to_atomic"]) == ("group", "handoff", 4, 0.5)
    assert "hand-off between 2 ranks (2/4)" in gp.format_row(lock) and "0.50x" in gp.format_row(lock)


def test_plot_of_barrier_rows(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = gp.plot_barriers(_barrier_rows(), str(tmp_path / "b.png"))
    assert Path(out).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError):
        gp.plot_barriers([], str(tmp_path / "none.png"))


# -- real runs ----------------------------------------------------------------------------------------
def _json_rows(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict]:
    rc = cli.main(["perf", *argv, "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return [json.loads(line) for line in out.splitlines()]


def test_lock_lat_reports_group_and_baseline_rows(capsys: pytest.CaptureFixture[str]) -> None:
    rows = _json_rows(capsys, "lock_lat", "--local", "-n", "20", "--baseline", "cas-lock", "--hold-us", "3000")
    assert [(r["lock"], r["case"]) for r in rows] == [
        ("atomic", "round-trip-own"), ("atomic", "round-trip-remote"),
        ("cas-lock", "uncontended-own"), ("cas-lock", "uncontended-remote"), ("cas-lock", "handoff"),
        ("group", "uncontended-own"), ("group", "uncontended-remote"), ("group", "handoff")]
    for r in rows:
        assert LAT <= r.keys() and 0 < r["t_min_us"] <= r["t_typical_us"] <= r["t_max_us"]
        assert (r["procs"], r["daemons"]) == (2, 2)
        assert (r["lock"] == "atomic") == ("ratio_to_atomic" not in r)
        if r["case"].startswith("uncontended"):
            assert r["iterations"] == 20 and 0 < r["t_acquire_typical_us"] and 0 < r["t_release_typical_us"]
        if r["case"] == "handoff":
            assert r["acquisitions"] == 2 * 20 and r["hold_us"] == 3000
    # the rows run in 5 rounds of 4 iterations; in each, the Compare-and-Swap
    # hand-off alternates by construction: every acquisition after the first is one
    rounds = gp.LOCK_ROUNDS
    assert rows[4]["iterations"] == 2 * 20 - rounds
    # the queue lock grants in request order: the other rank, waiting through the
    # hold, gets it (unless a loaded host kept its request out of the queue that long)
    assert rows[7]["iterations"] >= 20


def test_both_locks_exclude() -> None:
    # three ranks, two of them on one daemon, each incrementing rank 0's
    # counter 25 times by an RDMA Read and an RDMA Write under the lock, first
    # the Compare-and-Swap lock's, then the group's (a lock managed by the
    # other daemon): an update lost to two holders at once would show
    with local.LocalDaemons(count=2) as ds, gp.Ranks(ds, [0, 0, 1]) as ranks:
        ranks.ask({"op": "open"}, 60)
        ranks.ask({"op": "group"}, 60)
        table = ranks.ask({"op": "cas-open"}, 60)
        ranks.ask({"op": "cas-connect", "table": table}, 60)
        lock = gp.lock_managed_by(ranks.members[-1], ranks.members)
        counts = []
        for kind in ("cas", "group"):
            ranks.ask({"op": "run", "phase": f"{kind}-counter", "iters": 25, "lock": lock}, 120)
            counts.append(ranks.ask({"op": "run", "phase": "counter", "ranks": [0]}, 60)[0]["value"])
    assert counts == [75, 150]


def test_barrier_lat_small_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plot = ["--plot", str(tmp_path / "b.png")] if _has_matplotlib() else []
    rows = _json_rows(capsys, "barrier_lat", "--local", "-P", "2,4", "--algorithm", "all", "-n", "10", *plot)
    assert [(r["procs"], r["algorithm"]) for r in rows] == [(p, a) for p in (2, 4) for a in gp.ALGORITHMS]
    for r in rows:
        assert r["iterations"] == 10 and r["t_typical_us"] > 0 and r["t_p99_us"] >= r["t_typical_us"]
        assert r["daemons"] == min(4, r["procs"]) and r["arity"] == (2 if r["algorithm"] == "tree" else None)
        assert r["cpu_us_per_barrier"]["ranks"] >= 0 and r["cpu_us_per_barrier"]["daemons"] >= 0
    if plot:
        assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
