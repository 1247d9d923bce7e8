"""Suite-wide settings."""

import os

# Every daemon the tests start, in-process or as a subprocess, checks after
# each data-path pass that no QP it skipped had work (Device.check_pass).
os.environ.setdefault("UDPVERBS_CHECK_PASSES", "1")
