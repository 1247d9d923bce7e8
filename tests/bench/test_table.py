"""``udpverbs perf all``: the README's tables, their format, their order, and a failing row."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from udpverbs import cli
from udpverbs.bench import table
from udpverbs.bench.report import Row
from udpverbs.bench.stats import BandwidthStats, LatencyStats

README = Path(__file__).resolve().parents[2] / "README.md"
ROW = {r.key: r for r in table.ROWS}


def _lat(typical: float, p99: float) -> LatencyStats:
    return LatencyStats(1000, typical * 0.9, p99 * 2, typical, typical * 1.1, 3.0, p99, p99 * 1.5)


def _bw(mbps: float, mpps: float) -> BandwidthStats:
    return BandwidthStats(8000, mbps * 1.2, mbps, mpps)


def _lat_rows(test: str, ours: list[tuple[float, float]], base: list[float]) -> list[Row]:
    return [Row(test, 2, _lat(t, p), _lat(b, b * 2)) for (t, p), b in zip(ours, base)]


def _bw_rows(test: str, ours: list[float], base: list[float], *, rate: bool = False) -> list[Row]:
    # rate: the figures are message rates in Mpps, and the MB/s beside them
    # deliberately disagree, so that a cell taken from the wrong one shows
    if rate:
        return [Row(test, 8, _bw(7.0, o), _bw(1.0, b)) for o, b in zip(ours, base)]
    return [Row(test, 65536, _bw(o, 0.01), _bw(b, 0.02)) for o, b in zip(ours, base)]


FIXED = [
    (ROW["write_lat"], _lat_rows("write_lat", [(27.14, 52.0), (26.61, 49.4), (27.93, 60.2)], [39.6, 36.8, 40.5])),
    # ratios 1.0612, 1.0621, 2.8366: the median ratio is not the medians' ratio (596.4 / 562.0 = 1.0612)
    (ROW["send_lat-rnr"], _lat_rows("send_lat", [(596.4, 1623.4), (595.2, 1700.0), (1597.0, 1650.2)],
                                    [562.0, 560.4, 563.0])),
    (ROW["write_bw"], _bw_rows("write_bw", [1396.2, 1368.0, 1408.9], [639.0, 602.4, 680.0])),
    (ROW["atomic_bw"], _bw_rows("atomic_bw", [0.0588, 0.05734, 0.060516], [0.247499, 0.237596, 0.254917], rate=True)),
    (ROW["read_bw-b"], _bw_rows("read_bw", [1296.4, 1240.0, 1788.0], [651.0, 628.2, 661.0])),
]


def test_tables_of_fixed_results_are_the_readmes_markdown() -> None:
    summaries = [(row, table.summarize(row, results)) for row, results in FIXED]
    assert table.format_tables(summaries) == [
        "",
        "**Latency** in µs.",
        "",
        "| test | udpverbs typical | udpverbs p99 | raw UDP typical | ratio |",
        "|---|---:|---:|---:|---:|",
        "| `write_lat`, 2 B (inline) | 27.1 (26.6–27.9) | 52 | 39.6 (36.8–40.5) | 0.69 (0.69–0.72) |",
        "| `send_lat --rnr-delay-us 1000`: no receive posted when the Send arrives | 596 (595–1,597) | 1,650 "
        "| 562 (560–563) | 1.06 (1.06–2.84) |",
        "",
        "**Bandwidth** in MB/s (10^6 bytes); `atomic_bw` in operations per second.",
        "",
        "| test | udpverbs | raw UDP | ratio |",
        "|---|---:|---:|---:|",
        "| `write_bw`, 1472-byte datagrams | 1,396 (1,368–1,409) | 639 (602–680) | 2.18 (2.07–2.27) |",
        "| `atomic_bw`, 8 B Fetch-and-Add, operations/s | 58,800 (57,340–60,516) | 247,499 (237,596–254,917) "
        "| 0.24 (0.24–0.24) |",
        "",
        "**Both directions at once** (`-b`): each figure is the sum of the two directions.",
        "",
        "| test | udpverbs, both directions | raw UDP, both directions | ratio |",
        "|---|---:|---:|---:|",
        "| `read_bw -b` | 1,296 (1,240–1,788) | 651 (628–661) | 1.99 (1.97–2.70) |",
    ]


def test_one_round_has_no_range_and_an_empty_table_is_left_out() -> None:
    row, results = FIXED[0]
    assert table.format_tables([(row, table.summarize(row, results[1:2]))]) == [
        "", "**Latency** in µs.", "",
        "| test | udpverbs typical | udpverbs p99 | raw UDP typical | ratio |", "|---|---:|---:|---:|---:|",
        "| `write_lat`, 2 B (inline) | 26.6 | 49 | 36.8 | 0.72 |",
    ]


def test_json_has_every_run_and_the_cells() -> None:
    rows = [row for row, _ in FIXED]
    results = {row.key: [(r, 1.5) for r in res] for row, res in FIXED}
    doc = table.report_json({"date": "2026-11-28 06:00 UTC"}, rows, 3, False, ("--no-pin",), results)
    assert doc["rounds"] == 3 and doc["machine"]["date"].startswith("2026")
    first = doc["rows"][0]
    assert first["row"] == "write_lat" and first["table"] == "latency"
    assert first["command"] == "udpverbs perf write_lat -n 5000 --local --baseline raw-udp --no-pin"
    assert [r["round"] for r in first["runs"]] == [1, 2, 3]
    assert [r["result"]["t_typical_us"] for r in first["runs"]] == [27.14, 26.61, 27.93]
    assert first["runs"][0]["result"]["baseline"]["t_typical_us"] == 39.6
    assert first["cells"]["udpverbs"] == {"median": 27.14, "min": 26.61, "max": 27.93}
    assert first["cells"]["udpverbs_p99"]["median"] == 52.0
    assert first["cells"]["ratio"]["median"] == pytest.approx(27.93 / 40.5)
    atomic = doc["rows"][3]
    assert atomic["cells"]["udpverbs"] == pytest.approx({"median": 58800, "min": 57340, "max": 60516})


def test_rounds_are_made_round_robin_over_the_rows() -> None:
    a, b, c = table.ROWS[:3]
    assert table.schedule([a, b, c], 2) == [(1, a), (1, b), (1, c), (2, a), (2, b), (2, c)]
    assert table.schedule([a], 3) == [(1, a), (2, a), (3, a)]


# -- the README ---------------------------------------------------------------------------------


def _readme_tables() -> dict[str, list[list[str]]]:
    """The cells of the README's results tables, by the table whose column titles they follow."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("\n## Results"):]
    section = section[:section.index("\n## ", 1)]
    tables: dict[str, list[list[str]]] = {}
    for name, (_, columns) in table.TABLES.items():
        start = section.index(columns) + len(columns)
        lines = section[start:].lstrip("\n").split("\n")
        tables[name] = [line.strip("|").split(" | ") for line in lines[:lines.index("")]]
        tables[name] = [[cell.strip() for cell in cells] for cells in tables[name]]
    return tables


def _figures(cell: str) -> list[str]:
    m = re.fullmatch(r"([\d,.]+) \(([\d,.]+)–([\d,.]+)\)", cell)
    return list(m.groups()) if m else [cell]


def test_the_rows_are_the_readmes_rows_and_print_its_figures_as_it_does() -> None:
    tables = _readme_tables()
    for name, lines in tables.items():
        rows = [r for r in table.ROWS if r.table == name]
        assert [cells[0] for cells in lines] == [r.label for r in rows]
        for row, cells in zip(rows, lines):
            figures = row.decimals if name == "latency" else 0
            kinds = [figures, 0, figures, 2] if name == "latency" else [0, 0, 2]
            for cell, decimals in zip(cells[1:], kinds):
                for text in _figures(cell):
                    assert table.number(float(text.replace(",", "")), decimals) == text, (row.key, cell)


def test_every_row_is_a_valid_perf_command() -> None:
    for quick in (False, True):
        for row in table.ROWS:
            cli.prepare_table_run(table.command_argv(row, quick))


# -- the command ----------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, fragment", [
    (["--quick"], "give --local"),
    (["--local", "--rows", "write_lat,nope"], "unknown row nope"),
    (["--local", "--rounds", "0"], "--rounds must be at least 1"),
    (["--local", "--rows", ","], "--rows: no row named; the rows are write_lat,send_lat,"),
    (["--local", "--daemon-arg=--cc=bogus"], "unknown congestion controller 'bogus'"),
])
def test_usage_errors_exit_2_before_any_run(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["perf", "all", *argv]) == 2
    out, err = capsys.readouterr()
    assert fragment in err and out == "" and "perf all:" not in err  # no run started


def test_all_as_a_flags_value_is_not_the_table_run(capsys: pytest.CaptureFixture[str]) -> None:
    # the test is the first word after perf: here write_lat, whose parser refuses --rows
    with pytest.raises(SystemExit) as e:
        cli.main(["perf", "write_lat", "-d", "all", "--rows", "x"])
    assert e.value.code == 2 and "unrecognized arguments: --rows x" in capsys.readouterr().err


def test_quick_run_of_two_rows(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["perf", "all", "--local", "--quick", "--rows", "write_bw,write_lat", "--rounds", "2"]) == 0
    out, err = capsys.readouterr()
    done = re.findall(r"round (\d)/2 (\S+): udpverbs", err)
    assert done == [("1", "write_lat"), ("1", "write_bw"), ("2", "write_lat"), ("2", "write_bw")], err
    lines = out.splitlines()
    assert lines[0].startswith("Measured on **") and "2 runs of each row" in lines[0] and "--quick" in lines[0]
    spread = r"[\d,]+{} \([\d,]+{}–[\d,]+{}\)"
    lat, bw = spread.format(*[r"\.\d"] * 3), spread.format("", "", "")
    ratio = spread.format(*[r"\.\d\d"] * 3)
    assert re.fullmatch(rf"\| `write_lat`, 2 B \(inline\) \| {lat} \| [\d,]+ \| {lat} \| {ratio} \|", lines[6])
    assert re.fullmatch(rf"\| `write_bw`, 1472-byte datagrams \| {bw} \| {bw} \| {ratio} \|", lines[12])
    assert "Both directions" not in out


def test_a_failing_row_fails_the_command_naming_it(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # A daemon that lets a client hold 2 QPs refuses the row's fourth: a real
    # failure, after a row that succeeded.
    over_quota = table.TableRow("write_bw-overquota", "bandwidth", "`write_bw -q 4`", "write_bw", 50, 50,
                                ("-q", "4", "--daemon-arg=--quota=qp=2"), 0)
    monkeypatch.setattr(table, "ROWS", (table.ROWS[0], over_quota))
    assert cli.main(["perf", "all", "--local", "--quick"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert "round 1/1 write_lat: udpverbs" in err
    assert "udpverbs perf: failed: row write_bw-overquota (`write_bw -q 4`), round 1 of 1:" in err
    assert "quota" in err.splitlines()[-1]
