"""perftest-style table and JSON rows."""

from __future__ import annotations

import json

import pytest

from udpverbs.bench.report import (BW_COLUMNS, BW_COLUMNS_GBITS, LAT_COLUMNS, DaemonLoad, Row, columns, figure_text,
                                   format_row, row_from_json, row_json)
from udpverbs.bench.stats import bandwidth_stats, latency_stats

LAT_KEYS = {"t_min_us", "t_max_us", "t_typical_us", "t_avg_us", "t_stdev_us", "p99_us", "p999_us"}
BW_KEYS = {"bw_peak_MBps", "bw_avg_MBps", "msg_rate_Mpps"}


def _lat_row(with_baseline: bool) -> Row:
    ours = latency_stats([40_000, 50_000, 60_000])
    base = latency_stats([10_000, 20_000]) if with_baseline else None
    return Row("write_lat", 2, ours, base)


def test_latency_json_shape_and_ratio() -> None:
    obj = json.loads(json.dumps(row_json(_lat_row(True))))
    assert {"test", "bytes", "iterations", "transport", "baseline", "ratio"} | LAT_KEYS == set(obj)
    assert (obj["test"], obj["bytes"], obj["iterations"], obj["transport"]) == ("write_lat", 2, 3, "udpverbs")
    assert set(obj["baseline"]) == LAT_KEYS | {"name", "iterations"}
    assert set(obj["ratio"]) == LAT_KEYS
    assert obj["ratio"]["t_typical_us"] == 50.0 / 15.0
    assert obj["t_typical_us"] == 50.0


def test_bandwidth_json_without_baseline_has_no_ratio() -> None:
    row = Row("write_bw", 65536, bandwidth_stats(65536, 0, [10**6, 2 * 10**6], 1))
    obj = row_json(row)
    assert {"test", "bytes", "iterations", "transport"} | BW_KEYS == set(obj)


def test_baseline_only_row_names_the_baseline() -> None:
    row = Row("write_bw", 4096, None, bandwidth_stats(4096, 0, [1000, 2000], 1))
    obj = row_json(row)
    assert obj["transport"] == "raw-udp" and "ratio" not in obj
    assert format_row(row)[0].endswith("(raw-udp)")


def test_rows_survive_the_trip_to_the_server() -> None:
    for row in (_lat_row(True), _lat_row(False), Row("read_bw", 8, None, bandwidth_stats(8, 0, [5, 9], 1))):
        assert row_from_json(json.loads(json.dumps(row_json(row)))) == row


def test_table_lines_follow_perftest_columns() -> None:
    assert columns(True, False) == LAT_COLUMNS
    assert columns(False, True) == BW_COLUMNS + "   ratio"
    lines = format_row(_lat_row(True))
    assert len(lines) == 2
    ours = lines[0].split()
    # bytes, iterations, 7 figures, ratio
    assert ours[:2] == ["2", "3"] and len(ours) == 10 and ours[-1] == "3.33x"
    assert lines[1].split()[-1] == "(raw-udp)"


def test_rnr_row_says_its_delay_and_survives_the_trip() -> None:
    row = Row("send_lat", 2, latency_stats([3_000_000, 3_100_000]), latency_stats([2_900_000]), rnr_delay_us=5000)
    obj = json.loads(json.dumps(row_json(row)))
    assert obj["rnr_delay_us"] == 5000 and obj["test"] == "send_lat"
    assert {"test", "bytes", "iterations", "transport", "baseline", "ratio", "rnr_delay_us"} | LAT_KEYS == set(obj)
    assert row_from_json(obj) == row
    baseline_only = Row("send_lat", 2, None, latency_stats([2_900_000]), rnr_delay_us=7)
    assert row_from_json(row_json(baseline_only)) == baseline_only
    assert "rnr_delay_us" not in row_json(_lat_row(True))


def test_bidirectional_row_says_so_and_survives_the_trip() -> None:
    stats = bandwidth_stats(65536, 0, [10**6, 2 * 10**6], 1)
    row = Row("write_bw", 65536, stats, stats, bidirectional=True)
    obj = json.loads(json.dumps(row_json(row)))
    assert obj["bidirectional"] is True and row_from_json(obj) == row
    assert "bidirectional" not in row_json(Row("write_bw", 65536, stats))
    baseline_only = Row("write_bw", 65536, None, stats, bidirectional=True)
    assert row_from_json(row_json(baseline_only)) == baseline_only


def test_atomic_rows_name_their_operation_and_it_survives_the_trip() -> None:
    stats = latency_stats([200_000, 210_000])
    row = Row("atomic_lat", 8, stats, stats, atomic_type="CMP_AND_SWAP")
    obj = json.loads(json.dumps(row_json(row)))
    assert obj["atomic_type"] == "CMP_AND_SWAP" and row_from_json(obj) == row
    assert "atomic_type" not in row_json(_lat_row(True))
    with pytest.raises(TypeError):
        row_from_json({**obj, "atomic_type": 7})


def test_output_units_print_one_figure_of_the_row() -> None:
    # perftest's --output: the average (latency) or the median (latency_typical), in µs
    lat = Row("write_lat", 2, latency_stats([1_000_000, 3_000_000, 2_000_000]))
    assert figure_text(lat, "latency") == "2000.000000" and figure_text(lat, "latency_typical") == "2000.000000"
    skewed = Row("write_lat", 2, latency_stats([1_000_000, 1_000_000, 4_000_000]))
    assert figure_text(skewed, "latency") == "2000.000000" and figure_text(skewed, "latency_typical") == "1000.000000"
    # 65536 B every ms: 65.536 MB/s, 0.524288 Gb/s, 0.001 Mpps; a baseline-only row prints the baseline's
    bw = bandwidth_stats(65536, 0, [10**6 * k for k in range(1, 5)], 1)
    for row in (Row("write_bw", 65536, bw, bandwidth_stats(65536, 0, [10**9], 1)), Row("write_bw", 65536, None, bw)):
        assert figure_text(row, "bandwidth") == "65.536000"
        assert figure_text(row, "bandwidth", gbits=True) == "0.524288"
        assert figure_text(row, "message_rate") == "0.001000"


def test_report_gbits_prints_gigabits_and_keeps_the_ratio() -> None:
    # 65536 B every ms: 65.536 MB/s, 0.524288 Gb/s
    ours = bandwidth_stats(65536, 0, [10**6 * k for k in range(1, 5)], 1)
    base = bandwidth_stats(65536, 0, [2 * 10**6 * k for k in range(1, 5)], 1)
    assert columns(False, True, gbits=True) == BW_COLUMNS_GBITS + "   ratio"
    assert columns(True, False, gbits=True) == LAT_COLUMNS  # latency has no bandwidth column
    mb = format_row(Row("write_bw", 65536, ours, base))[0].split()
    gb = format_row(Row("write_bw", 65536, ours, base), gbits=True)[0].split()
    assert mb[3] == "65.54" and gb[3] == "0.52"
    assert mb[4] == gb[4] and mb[-1] == gb[-1] == "2.00x"  # message rate and ratio do not change


def test_daemon_load_rides_in_the_row_and_gets_a_line_of_its_own() -> None:
    load = DaemonLoad(cpu_pct=(99.5, 80.25), busy_pct=(97.0, 50.5))
    row = Row("write_bw", 65536, bandwidth_stats(65536, 0, [10**6, 2 * 10**6], 1),
              bandwidth_stats(65536, 0, [2 * 10**6, 4 * 10**6], 1), daemons=load)  # fmt: skip
    obj = json.loads(json.dumps(row_json(row)))
    assert obj["daemon_cpu_pct"] == {"client": 99.5, "server": 80.25}
    assert obj["daemon_busy_pct"] == {"client": 97.0, "server": 50.5}
    assert row_from_json(obj) == row
    lines = format_row(row)
    assert len(lines) == 3 and lines[1] == " daemon CPU[%]: client 99.5 (busy 97.0), server 80.2 (busy 50.5)"
    assert "daemon_cpu_pct" not in row_json(Row("write_bw", 65536, row.ours))
