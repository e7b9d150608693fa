"""README.md and docs/ are what a clone can follow: no path that leaves the repository, no commit id (a commit says
where a number came from, and results/<folder>/README.md is where numbers and their commits live), every relative link
to a file that exists, a README short enough to be a front door; and code cites docs/, not documents a clone does not
have (the project's old spec sections and issue numbers)."""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from kvoffload.paths import ROOT

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 150

# a hex run of 7-40 characters standing alone (not inside a longer word or path segment); it must mix digits and
# letters, so that plain numbers (1048576) and words (defaced) are not taken for commit ids
HEX = re.compile(r"(?<![0-9A-Za-z])[0-9a-f]{7,40}(?![0-9A-Za-z])")
# a path that climbs: ../ once or more, and what follows up to a space, a quote or a closing bracket
CLIMB = re.compile(r"(?:\.\./)+[^\s`'\")\]>]*")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
EXTERNAL = ("http://", "https://", "mailto:")

# code that cites a document a clone does not have: "spec" or "issue" and a number (any case)
CITATION = re.compile(r"(?<![\w])(?:spec \d|issue \d+)", re.IGNORECASE)
CODE_SUFFIXES = {".py", ".yaml", ".yml", ".sh"}
NOT_CODE = {"results", ".git", ".venv", ".whl", ".resume", "outputs", "multirun", "wandb", "data"}
KEPT: dict[str, int] = {}  # files allowed that many citations (none now)


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def inside(path: Path) -> bool:
    return path.resolve().is_relative_to(ROOT.resolve())


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_no_path_leaves_the_repository(page):
    text = page.read_text()
    outside = [m for m in CLIMB.findall(text) if not inside(page.parent / m)]
    assert not outside, f"{rel(page)} points outside the repository: {outside}"


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_no_commit_ids(page):
    found = [
        (n, m.group())
        for n, line in enumerate(page.read_text().splitlines(), 1)
        for m in HEX.finditer(line)
        if re.search(r"\d", m.group()) and re.search(r"[a-f]", m.group())
    ]
    assert not found, f"{rel(page)} quotes commit ids (line, id): {found}; results/<folder>/README.md holds them"


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if target.startswith(EXTERNAL) or target.startswith("#"):
            continue
        path = page.parent / target.split("#")[0]
        if not inside(path) or not path.exists():
            broken.append(target)
    assert not broken, f"{rel(page)} links to what is not in the repository: {broken}"


def test_readme_is_a_front_door():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"
    text = README.read_text()
    for page in ("docs/running.md", "docs/workloads.md", "docs/systems.md", "docs/gpu.md", "docs/scaleout.md"):
        assert f"]({page})" in text, f"README.md does not link {page}"


def test_the_readme_shows_the_test_commands_ci_runs():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    tests = [line for line in ci if "-m pytest" in line or "interpret_kernels" in line]
    assert any("-m pytest" in line for line in tests), f".ci/run runs no pytest: {ci}"
    missing = [line for line in tests if line not in README.read_text()]
    assert not missing, f"README.md does not show CI's test commands: {missing}"


def code_files():
    """The tracked kinds of code and config outside results/ and data/, without walking .venv or .git."""
    for top in sorted(ROOT.iterdir()):
        if top.name in NOT_CODE or top.name.endswith(".egg-info"):
            continue
        for path in [top] if top.is_file() else sorted(top.rglob("*")):
            if path.suffix in CODE_SUFFIXES and "__pycache__" not in path.parts and path.is_file():
                yield path


def test_code_cites_docs_not_specs_or_issues():
    found = {}
    for path in code_files():
        hits = CITATION.findall(path.read_text(errors="replace"))
        if len(hits) > KEPT.get(rel(path), 0):
            found[rel(path)] = hits
    assert not found, f'cite docs/ instead (e.g. docs/systems.md, "Thresholds"): {found}'


def commented_text(path: Path) -> list[tuple[int, str]]:
    """A Python file's comments and docstrings, with their first line: what a reader takes for explanation."""
    source = path.read_text(errors="replace")
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)]
    out = [(line, text) for line, text in out if text.startswith("#")]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
    return out


def test_code_comments_quote_no_commit_ids():
    """A comment or docstring explains why; the commit a number came from belongs to its record, and an id in a
    comment outlives the history it points into. Tests are exempt: they build records with made-up ids."""
    found = {}
    for path in code_files():
        if path.suffix != ".py" or path.parts[len(ROOT.parts)] == "tests":
            continue
        ids = [
            (line, m.group())
            for line, text in commented_text(path)
            for m in HEX.finditer(text)
            if re.search(r"\d", m.group()) and re.search(r"[a-f]", m.group())
        ]
        if ids:
            found[rel(path)] = ids
    assert not found, f"comments or docstrings quote commit ids (line, id): {found}"
