"""The device-session helpers in scripts/: the shell script parses, and the host-memory warm-up refuses a size the
machine does not have before touching anything, and touches what it is asked to."""

import subprocess
import sys

from kvoffload.paths import ROOT


def test_gpu_session_script_parses():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts/gpu_session.sh")]).returncode == 0


def test_touch_host_memory_refuses_more_than_available_and_touches_what_fits():
    script = str(ROOT / "scripts/touch_host_memory.py")
    p = subprocess.run([sys.executable, script, "--gb", "1e9"], capture_output=True, text=True)
    assert p.returncode == 1 and "must lie in (0," in p.stderr and p.stdout == ""
    p = subprocess.run([sys.executable, script, "--gb", "1"], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.startswith("touched 1 GiB"), p.stderr
