"""Load the records (JSON files a run or a benchmark wrote) under a folder, refusing what a figure must not draw
silently: a folder without records, records of several git commits, a system the plots do not know.

Every refusal is a RecordError with a one-line message that names the files; `cli` prints it as `error: ...` and
exits with status 2. NoRecords (a RecordError) is the folder with nothing to draw."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The systems a figure knows how to name (conf/system/*.yaml; tests/test_plots.py keeps the two in step).
SYSTEMS = {
    "fullattn": "FullAttn",
    "clo": "CLO",
    "retroinfer": "RetroInfer-style",
    "infinigen": "InfiniGen-style",
    "pqcache": "PQCache-style",
    "shadowkv": "ShadowKV-style",
}
MAX_NAMED = 4  # files named in one message before "and N more"
# The timer's phase keys (kvoffload.kv.timer.PHASES) as a figure's legend says them: a reader has not seen the code.
PHASE_LABELS = {
    "retrieval": "retrieval (top-k search)",
    "cache_mgmt": "cache management",
    "transfer_exposed": "exposed transfer",
    "attention": "attention",
    "launch_sync": "launch + sync",
    "other": "other",
}
# A commit id as test_docs finds one: 7-40 hex characters standing alone, digits and letters mixed.
COMMIT_ID = re.compile(r"(?<![0-9A-Za-z])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![0-9A-Za-z])")
# Font sizes for a figure printed at a paper's width (about 7 in across two columns): none under 7 pt there.
PAPER_STYLE = {
    "font.size": 8,
    "axes.titlesize": 8,
    "axes.labelsize": 8,
    "xtick.labelsize": 7,
    "ytick.labelsize": 7,
    "legend.fontsize": 7,
    "figure.titlesize": 9,
}


class RecordError(Exception):
    """Records a figure cannot be drawn from."""


class NoRecords(RecordError):
    """A folder with no records to draw (missing, empty, or holding none of the kind asked for)."""


def names(paths: list[str]) -> str:
    shown = ", ".join(paths[:MAX_NAMED])
    return shown + (f" and {len(paths) - MAX_NAMED} more" if len(paths) > MAX_NAMED else "")


def commit_of(rec: dict) -> str | None:
    """The git commit a record's environment names (7 characters; ' (dirty)' when the tree was), or None."""
    env = rec.get("environment")
    git = env.get("git") if isinstance(env, dict) else None
    commit = git.get("commit") if isinstance(git, dict) else None
    if not commit:
        return None
    return str(commit)[:7] + (" (dirty)" if git.get("dirty") is True else "")


@dataclass
class Records:
    """The records of one figure: rows of {"path", "file" (relative to root), "label", "record"}, all of one
    commit unless allow_mixed; `left_out` lists the records of failed runs under root (not drawn)."""

    root: Path
    rows: list[dict[str, Any]]
    left_out: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def files(self) -> list[str]:
        return [r["file"] for r in self.rows]

    @property
    def commits(self) -> list[str]:
        return sorted({commit_of(r["record"]) for r in self.rows})

    @property
    def commit(self) -> str:
        return ", ".join(self.commits)

    @property
    def commits_label(self) -> str:
        """'commit <id>' or 'commits <id>, <id>', for a figure's caption."""
        return f"commit{'s' if len(self.commits) > 1 else ''} {self.commit}"


def override_values(overrides: list[str]) -> dict[str, str]:
    """key -> value of a run's `key=value` overrides, less the `+experiment=...` kind that adds a config."""
    return dict(x.split("=", 1) for x in overrides if "=" in x and not x.startswith("+"))


def fit_refusal(rec: Any) -> bool:
    """Whether a run record is the preflight's refusal of a point that does not fit (the device budget or the
    host's RAM), recorded with its estimate: a result to draw, where a crash or other bad input is not."""
    return isinstance(rec, dict) and rec.get("error_kind") == "config" and "needs about" in str(rec.get("error"))


def result_record(rec: Any) -> bool:
    """Whether a run record is a result: its run ended ok, or it is a fit refusal (fit_refusal)."""
    return isinstance(rec, dict) and (rec.get("status") == "ok" or fit_refusal(rec))


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RecordError(f"{path}: not a readable JSON record ({type(e).__name__}: {e})") from None


def load_files(
    root: Path, pattern: str, accept: Callable[[Any], bool], what: str = "records", allow_mixed: bool = False
) -> Records:
    """The JSON files under root matching pattern whose content `accept`s, checked for one commit."""
    recs = find(root, pattern, accept, what)
    check_commits(recs, allow_mixed)
    return recs


def find(root: Path, pattern: str, accept: Callable[[Any], bool], what: str) -> Records:
    """The JSON files under root matching pattern whose content `accept`s (NoRecords if none), unchecked."""
    root = Path(root)
    if not root.is_dir():
        raise NoRecords(f"no {what} under {root}: no such folder")
    rows = []
    for path in sorted(root.rglob(pattern)):
        rec = read_json(path)
        if isinstance(rec, dict) and accept(rec):
            rows.append({"path": str(path), "file": str(path.relative_to(root)), "record": rec})
    if not rows:
        raise NoRecords(f"no {what} under {root}")
    return Records(root, rows)


def commit_per_cell(rows, root: Path, what: str, name: Callable[[Any], str] = str) -> dict:
    """{cell: commit} of (cell, file, commit) rows. Records filled in over sessions may come from several commits,
    but the records of one cell, which are compared with each other, must share one (an error names the cell by
    name(cell))."""
    by_cell: dict = {}
    for cell, file, commit in rows:
        by_cell.setdefault(cell, {})[file] = commit
    for cell, by_file in by_cell.items():
        if len(set(by_file.values())) > 1:
            raise RecordError(
                f"the {what} of {name(cell)} ran at different commits under {root}: "
                + ", ".join(f"{f} ({c})" for f, c in sorted(by_file.items()))
            )
    return {cell: next(iter(by_file.values())) for cell, by_file in by_cell.items()}


def check_commits(recs: Records, allow_mixed: bool = False) -> None:
    """Refuses records whose environment names no commit, and (unless allow_mixed) records of several."""
    unknown = [r["file"] for r in recs if commit_of(r["record"]) is None]
    if unknown:
        raise RecordError(f"no git commit in the environment of {names(unknown)} under {recs.root}")
    if len(recs.commits) > 1 and not allow_mixed:
        by = {c: [r["file"] for r in recs if commit_of(r["record"]) == c] for c in recs.commits}
        parts = "; ".join(f"{c}: {names(files)}" for c, files in by.items())
        raise RecordError(f"records of {len(by)} commits under {recs.root} ({parts}): one figure, one commit")


def check_systems(pairs: list[tuple[str, str]], root: Path) -> None:
    """pairs of (system, file): refuses a system SYSTEMS does not name."""
    bad = sorted({s for s, _ in pairs if s not in SYSTEMS})
    if bad:
        files = sorted({f for s, f in pairs if s in bad})
        raise RecordError(
            f"unknown system {', '.join(map(repr, bad))} in {names(files)} under {root}; known: {', '.join(SYSTEMS)}"
        )


def load_records(root: Path, status: str = "ok", allow_mixed: bool = False) -> Records:
    """The run records (record.json / record_*.json, as experiments.run writes them) under root with `status`;
    the others are listed in `left_out`. Refuses none, several commits (unless allow_mixed), unknown systems."""
    runs = find(root, "record*.json", lambda r: "system" in r and "status" in r, "run records")
    recs = Records(runs.root, [r for r in runs if r["record"]["status"] == status])
    recs.left_out = [r["file"] for r in runs if r["record"]["status"] != status]
    if not recs.rows:
        raise RecordError(f"no {status!r} run records under {root}, only others: {names(recs.left_out)}")
    check_commits(recs, allow_mixed)
    check_systems([(r["record"]["system"], r["file"]) for r in recs], recs.root)
    for r in recs:
        rec = r["record"]
        r["label"] = f"{rec['system']}\n{rec['model']} {rec['config']['seqlen']} b{rec['batch']} " + rec.get(
            "decode_mode", "eager"
        )
    return recs


ONE_EACH = "move each set of runs into a folder of its own and plot the folder"


def one_value(recs: Records, key: Callable[[dict], Any], what: str) -> Any:
    """The value key(record) shared by every record, or a RecordError naming the files of each value."""
    by: dict[str, list[str]] = {}
    for r in recs:
        by.setdefault(json.dumps(key(r["record"]), sort_keys=True, default=str), []).append(r["file"])
    if len(by) > 1:
        parts = "; ".join(f"{v}: {names(files)}" for v, files in by.items())
        raise RecordError(f"records of several {what} under {recs.root} ({parts}): a figure draws one; {ONE_EACH}")
    return key(recs.rows[0]["record"])


def phases_of(recs: Records) -> list[str]:
    """The phase names of the records' phase_ms_per_step (the runner's PhaseTimer order), the same in all."""
    return [p for p in one_value(recs, lambda r: list(r["metrics"]["phase_ms_per_step"]), "phase sets") if p != "total"]


def stacked_phases(ax, x: list, values: dict[str, list[float]], **bar) -> list[float]:
    """One stacked bar per x, one segment per phase (in the timer's order), each labelled in words and coloured
    by its place in that order (the same colours on every axis of a broken one); returns the bar totals."""
    bottom = [0.0] * len(x)
    for i, (phase, vals) in enumerate(values.items()):
        ax.bar(x, vals, bottom=bottom, label=PHASE_LABELS.get(phase, phase), color=f"C{i}", **bar)
        bottom = [b + v for b, v in zip(bottom, vals)]
    return bottom


@contextmanager
def paper_style():
    """PAPER_STYLE's font sizes for the figures drawn inside it."""
    import matplotlib

    with matplotlib.rc_context(PAPER_STYLE):
        yield


def titles(fig) -> list[str]:
    """The figure's title and its axes' titles and tick labels: the text a reader takes for what the figure is."""
    texts = [fig.get_suptitle()]
    for ax in fig.axes:
        texts += [ax.get_title(loc) for loc in ("left", "center", "right")]
        texts += [t.get_text() for t in (*ax.get_xticklabels(), *ax.get_yticklabels())]
    return [t for t in texts if t]


def check_no_commit(fig) -> None:
    """Refuses a figure whose titles or tick labels carry a commit id: the caption beside it names the commits
    (plots.all), where a reader of a paper does not have to read past them."""
    found = [t for t in titles(fig) if COMMIT_ID.search(t)]
    if found:
        raise ValueError(f"a figure's titles name commits {found}: put them in its caption (plots.all writes it)")


# what matplotlib would stamp into a file beside the drawing (a date, its version): None leaves it out
NO_STAMPS = {".pdf": {"CreationDate": None, "Creator": None, "Producer": None}, ".png": {"Software": None}}


def save(fig, out: Path) -> list[Path]:
    """Writes the figure to out; a path without a suffix gets both out.png and out.pdf. Returns the paths."""
    import matplotlib.pyplot as plt

    out = Path(out)
    paths = [out.with_suffix(".png"), out.with_suffix(".pdf")] if not out.suffix else [out]
    check_no_commit(fig)
    if fig.get_layout_engine() is None:  # a constrained figure lays itself out (legends outside its axes)
        fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    for p in paths:  # no dates or library versions in the files: the same records give the same bytes
        fig.savefig(p, dpi=120, metadata=NO_STAMPS.get(p.suffix))
    plt.close(fig)
    return paths


def plot_arguments(doc: str | None, mixed: bool = False) -> argparse.ArgumentParser:
    """The command line every plot module takes: a records folder and the output's stem (PNG and PDF); with
    `mixed`, --allow-mixed-commits (args.allow_mixed_commits) for a figure that may draw several commits."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    if mixed:
        ap.add_argument("--allow-mixed-commits", action="store_true", help="draw records of several commits")
    return ap


def cli(fn: Callable[[], None]) -> None:
    """Runs a plot command: a RecordError becomes one `error:` line on stderr and exit status 2."""
    try:
        fn()
    except RecordError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def tokens(n: int) -> str:
    """A token count as the runner spells it: 131072 -> 128K, 7680 -> 7.5K, 1500 -> 1500."""
    return f"{n / 1024:g}K" if n % 256 == 0 and n >= 1024 else str(n)
