"""Keeps the host's GPUs initialised while a sweep runs its jobs in processes of their own, as nvidia-persistenced
does: a GPU stays initialised while some process has its device file open, and without persistence mode the
driver tears it down when the last one closes, so that every job's process (job_process=fork or fresh, each stage
of scripts/gpu_session.sh) pays the GPU's initialisation again, seconds a job on an H200. A small process holds the
device files open (no CUDA, no context, no device memory) until its parent closes its stdin or exits.

    python -m experiments.gpu_hold --while-pid $$ &     # a shell script's GPUs, while the script runs
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time
from pathlib import Path

DEVICE_FILES = "/dev/nvidia[0-9]*"

# The holder: opens what it may of the files it is given, says how many, then waits for its stdin to close.
HOLD = (
    "import os, sys\n"
    "fds = []\n"
    "for f in sys.argv[1:]:\n"
    "    try: fds.append(os.open(f, os.O_RDWR | os.O_CLOEXEC))\n"
    "    except OSError: pass\n"
    "print(len(fds), flush=True)\n"
    "sys.stdin.read()\n"
)

_holder: tuple[subprocess.Popen, int] | None = None  # (the holder, how many files it holds)


def device_files(pattern: str = DEVICE_FILES) -> list[str]:
    return sorted(glob.glob(pattern))


def hold_gpus(files: list[str] | None = None) -> int:
    """Starts this process's holder once (later calls return at once): the number of device files it holds open,
    0 where there are none (a CPU host) or none may be opened. It ends with this process, whose exit closes its
    stdin."""
    global _holder
    if _holder is not None:
        return _holder[1]
    files = device_files() if files is None else files
    if not files:
        return 0
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, *files], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    _holder = (proc, int(proc.stdout.readline() or 0))
    return _holder[1]


def release_gpus() -> None:
    """Ends the holder (tests; a process's exit does it too)."""
    global _holder
    if _holder is not None:
        _holder[0].stdin.close()
        _holder[0].wait(timeout=10)
        _holder = None


def alive(pid: int) -> bool:
    """Whether process pid runs (an exited one its parent has not reaped yet does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--while-pid", type=int, required=True, help="hold until this process has exited")
    ap.add_argument("--files", default=DEVICE_FILES, help="the device files (a glob)")
    args = ap.parse_args(argv)
    held = hold_gpus(device_files(args.files))
    print(f"[gpu_hold] {held} GPU device files held open while pid {args.while_pid} runs", file=sys.stderr)
    while held and alive(args.while_pid):
        time.sleep(1.0)
    release_gpus()


if __name__ == "__main__":
    main()
