"""Sentences that several results READMEs' generated blocks (plots.readmes) share: where a record ran (its
environment, the folder's nvidia-smi dump) and a range of numbers. Each is read from the records, so that a README
names the machine and commit its numbers came from, not the one its author remembered."""

from __future__ import annotations

import re
from pathlib import Path

from plots.records import commit_of

TALLY = re.compile(r"^=*\s*\d+ (?:passed|failed)")


def commit(rec: dict) -> str:
    """'commit <id>', with ' (dirty tree)' where the record says the tree had uncommitted changes."""
    c = commit_of(rec) or "unknown"
    return "commit " + c.replace(" (dirty)", " (dirty tree)")


def env_txt(path: Path) -> dict[str, str]:
    """The nvidia-smi line and the torch / triton / flashinfer versions of an env*.txt that scripts/gpu_session.sh
    writes beside a run's records ({} where the file is missing)."""
    if not path.is_file():
        return {}
    lines = path.read_text().splitlines()
    gpu = dict(zip([h.strip() for h in lines[0].split(",")], [v.strip() for v in lines[1].split(",")]))
    words = lines[2].split() if len(lines) > 2 else []
    # two layouts: bare versions in a fixed order, or "name version" pairs (older sessions)
    named = bool(words) and words[0] == "torch"
    versions = dict(zip(words[0::2], words[1::2])) if named else dict(zip(("torch", "triton", "flashinfer"), words))
    return {"driver": gpu.get("driver_version", "?"), **versions}


def machine(rec: dict, env_file: Path | None = None) -> str:
    """'NVIDIA H200 (driver ..., 139.8 GB), 16 CPU cores, CUDA 13.0, torch ..., triton ..., flashinfer ..., Python
    ...' from a record's environment, the driver and triton from env_file where given."""
    env = rec.get("environment") or {}
    extra = env_txt(env_file) if env_file else {}
    gpu = env.get("gpu") or ("CPU only" if env.get("device") == "cpu" else env.get("device", "?"))
    inside = [f"driver {extra['driver']}"] if "driver" in extra else []
    if env.get("gpu_mem_total_gb"):
        inside.append(f"{env['gpu_mem_total_gb']} GB")
    parts = [gpu + (f" ({', '.join(inside)})" if inside else "")]
    if env.get("cpu_count"):
        parts.append(f"{env['cpu_count']} CPU cores")
    if env.get("cuda"):
        parts.append(f"CUDA {env['cuda']}")
    for lib in ("torch", "triton", "flashinfer", "transformers"):
        v = env.get(lib) or extra.get(lib)
        if v and (lib != "transformers" or not env.get("gpu")):  # transformers only where a CPU run loaded a model
            parts.append(f"{lib} {v}")
    if env.get("python"):
        parts.append(f"Python {env['python']}")
    return ", ".join(parts)


def pytest_summary(path: Path) -> str:
    """A pytest log's last tally ('15 passed, 42 deselected'), its duration left out: a count, not a timing. Some
    logs end with the machine's description, so the tally is searched for, not taken from the last line."""
    tallies = [x.strip("= ") for x in path.read_text().splitlines() if TALLY.search(x)]
    return re.sub(r" in [\d.]+s.*$", "", tallies[-1]) if tallies else "no tally in the log"
