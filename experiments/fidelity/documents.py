"""Long natural-language documents for the fidelity workload, offline: the Python documentation's reStructuredText
sources as the Debian package python3.11-doc installs them (`apt-get install python3.11-doc`; the Python Software
Foundation License; docs/fidelity.md). Prose about the language and its library - tutorials, HOWTOs, the language
reference, the library reference, the release notes - written by people, not generated and not repeated.

A document is a source file with at least the model's whole context in tokens (every length then takes its first L
tokens of the same files, so that lengths compare like with like); which of those files are taken is a seeded
sample from their sorted list, so a seed names the same documents on every machine with the same package."""

from __future__ import annotations

import glob
import hashlib
import random
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvoffload.errors import ConfigError

SOURCES = ("python-docs",)
# where Debian's python3.X-doc puts the sources: a package's standard location, not a machine's
DEBIAN_SOURCES = "/usr/share/doc/python3*/html/_sources"
# folders of prose; c-api (declarations), distutils/install (deprecated), the changelog (one line per fix) and the
# licence are left out
PROSE_FOLDERS = ("tutorial", "howto", "faq", "reference", "library", "whatsnew", "using", "extending")
EXCLUDED = ("whatsnew/changelog.rst.txt",)


@dataclass(frozen=True)
class Document:
    name: str  # its path under the sources folder
    ids: tuple[int, ...]  # its first tokens (as many as the selection asked for)
    sha256: str  # of the file's text: the record says exactly what was read


def sources_dir(source: str, docs_dir: str | None) -> Path:
    """The folder of the documentation's sources: docs_dir when set, else the Debian package's."""
    if source not in SOURCES:
        raise ConfigError(f"workload.source={source!r} is no document source; valid: {', '.join(SOURCES)}")
    if docs_dir:
        path = Path(docs_dir)
        if not path.is_dir():
            raise ConfigError(f"workload.docs_dir={docs_dir}: no such folder")
        return path
    found = sorted(glob.glob(DEBIAN_SOURCES))
    if not found:
        raise ConfigError(
            "workload.source=python-docs needs the Python documentation's sources: `apt-get install python3.11-doc` "
            f"(Debian/Ubuntu; it installs {DEBIAN_SOURCES}), or workload.docs_dir=<a folder of its _sources>"
        )
    return Path(found[-1])


def package_version(folder: Path) -> str | None:
    """The Debian package that installed `folder` and its version, when dpkg knows it."""
    try:
        owner = subprocess.run(["dpkg", "-S", str(folder)], capture_output=True, text=True, timeout=10)
        pkg = owner.stdout.split(":", 1)[0].strip()
        if owner.returncode or not pkg:
            return None
        ver = subprocess.run(["dpkg-query", "-W", "-f=${Version}", pkg], capture_output=True, text=True, timeout=10)
        return f"{pkg} {ver.stdout.strip()}" if ver.returncode == 0 else pkg
    except (OSError, subprocess.SubprocessError):
        return None


def candidates(folder: Path) -> list[Path]:
    """The prose files under folder, sorted by path."""
    out = []
    for path in sorted(folder.rglob("*.txt")):
        rel = path.relative_to(folder).as_posix()
        if rel.split("/")[0] in PROSE_FOLDERS and rel not in EXCLUDED:
            out.append(path)
    return out


def select(folder: Path, tokenizer, count: int, min_tokens: int, take: int, seed: int) -> list[Document]:
    """The first `count` documents of at least min_tokens tokens in a seeded order, each cut to its first `take`
    tokens."""
    eligible = []
    for path in candidates(folder):
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) < min_tokens:  # a token is at least one character: too short whatever its tokens
            continue
        ids = tokenizer.encode(text)
        if len(ids) >= min_tokens:
            digest = hashlib.sha256(text.encode()).hexdigest()
            eligible.append(Document(path.relative_to(folder).as_posix(), tuple(ids[:take]), digest))
    if len(eligible) < count:
        raise ConfigError(
            f"workload.documents={count}: {folder} has {len(eligible)} prose files of at least {min_tokens} tokens"
        )
    random.Random(seed).shuffle(eligible)  # a seeded order: more documents extend the same selection
    return eligible[:count]
