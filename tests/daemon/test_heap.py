"""The daemon's allocator setting: freed buffers stay mapped for the next ones."""

from __future__ import annotations

import subprocess
import sys

import pytest

from udpverbs.daemon import config, heap

# A stream's buffers in miniature: 16 MiB of 64 KiB buffers allocated and
# freed twice, in a fresh process; prints whether the setting took and the
# page faults of the second round.
_CHURN = """
import resource, sys
from udpverbs.daemon import heap
took = heap.keep_freed_heap(int(sys.argv[1]))
def churn():
    bufs = [bytearray(65536) for _ in range(256)]
    del bufs
churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn()
print(took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _churn(keep_mb: int) -> tuple[str, int]:
    r = subprocess.run([sys.executable, "-c", _CHURN, str(keep_mb)], capture_output=True, text=True, timeout=60,
                       check=True)
    took, faults = r.stdout.split()
    return took, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_heap_serves_the_next_buffers_without_page_faults() -> None:
    took, faults = _churn(heap.DEFAULT_KEEP_MB)
    assert took == "True" and faults < 100
    # the C library's default gives the 16 MiB back, and the next round faults every page in again
    took, faults = _churn(0)
    assert took == "False" and faults > 16 * 256 // 2


@pytest.mark.parametrize("bad", [-1, 1025, True, "64", 1.5])
def test_keep_is_a_whole_number_of_mib(bad: object) -> None:
    with pytest.raises(ValueError, match="heap_keep_mb must be a whole number from 0 to 1024"):
        heap.check_keep_mb(bad)


def test_the_daemon_takes_the_setting_from_flags_and_toml(tmp_path) -> None:
    assert config.load([])["heap_keep_mb"] == heap.DEFAULT_KEEP_MB
    assert config.load(["--heap-keep-mb", "0"])["heap_keep_mb"] == 0
    toml = tmp_path / "d.toml"
    toml.write_text("heap-keep-mb = 8\n")
    assert config.load(["--config", str(toml)])["heap_keep_mb"] == 8
    toml.write_text("heap-keep-mb = -3\n")
    with pytest.raises(ValueError, match="heap_keep_mb"):
        config.load(["--config", str(toml)])
