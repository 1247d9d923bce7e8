"""``udpverbs soak``: many bytes between two real daemons, clean and impaired, every one checked (bench/soak.py)."""

from __future__ import annotations

import json
import time

import pytest

from udpverbs import cli
from udpverbs.bench import soak


def _soak(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[dict], str]:
    rc = cli.main(["soak", *argv])
    out, err = capsys.readouterr()
    return rc, [json.loads(line) for line in out.splitlines() if line.startswith("{")], err


def test_64_mib_arrive_intact_clean_and_on_a_bad_network(capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.monotonic()
    rc, rows, err = _soak(capsys, "--bytes", "64M", "--json")
    took = time.monotonic() - t0
    assert rc == 0, err
    clean, impaired, ratio = rows
    assert (clean["run"], impaired["run"]) == ("clean", "impaired")
    for run in (clean, impaired):
        assert run["bytes"] == 64 << 20 and run["goodput_MBps"] > 0
        assert set(run["ops"]) == {"write", "read", "send"}
        assert all(op["ok"] and op["wrs"] > 50 for op in run["ops"].values())
    # one seed, one workload: what arrived is the same, byte for byte, whatever the network did
    assert {k: v["digest"] for k, v in clean["ops"].items()} == {k: v["digest"] for k, v in impaired["ops"].items()}
    assert clean["stats"]["impair_offered"] == 0 and clean["stats"]["link_bad_crc"] == 0
    s = impaired["stats"]
    assert s["impair_lost"] > 0.03 * s["impair_offered"] and s["impair_duplicated"] > 0.01 * s["impair_offered"]
    assert s["impair_reordered"] > 0.03 * s["impair_offered"] and s["impair_corrupted"] > 0
    # every corrupted datagram was caught by the link's CRC, and losses were made good
    assert s["link_bad_crc"] == s["impair_corrupted"] and s["link_retransmits"] >= s["impair_lost"] // 2
    assert ratio["ratio"] == pytest.approx(impaired["goodput_MBps"] / clean["goodput_MBps"], abs=1e-3)
    print(f"64 MiB soak: {took:.1f} s, clean {clean['goodput_MBps']} MB/s, impaired {impaired['goodput_MBps']} MB/s")


def test_data_that_lands_in_the_wrong_place_fails_the_soak(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    # A requester that puts its Writes and Sends one byte off: every one
    # completes, and only the digests can tell.
    monkeypatch.setattr(soak._Run, "_target", lambda self, q, slot: self.b.mr.buf + self.b.slot(q, slot) - 1)
    rc, rows, err = _soak(capsys, "--bytes", "2M", "--ops", "write,send")
    assert rc == 1 and rows == []
    assert "failed: clean: what arrived is not what was sent (write: " in err and "; send: " in err, err


def test_a_soak_that_stops_moving_fails() -> None:
    # 300 ms each way: no completion comes within the 20 ms allowed
    rc = cli.main(["soak", "--bytes", "64K", "--impair", "delay=300ms", "--stall", "0.02", "--ops", "write"])
    assert rc == 1


@pytest.mark.parametrize("argv, fragment", [
    (["--ops", "write,frob"], "--ops takes some of write,read,send"),
    (["--impair", "loss=2"], "a probability is from 0 to 1"),
    (["--bytes", "0"], "--bytes must be at least 1"),
    (["--min-size", "2M"], "--min-size <= --max-size"),
    (["--daemon-arg=--impair=loss=0.1"], "give the impairment with soak's own --impair"),
    (["--daemon-arg=--port=5"], "--local sets --port itself"),
])
def test_usage_errors(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["soak", *argv]) == 2
    err = capsys.readouterr().err
    assert "udpverbs soak: error:" in err and fragment in err, err
