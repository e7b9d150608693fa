"""results/investigations/: the folders that explain a decision, typed by hand. Each has a README, and every file
it names in backticks exists (beside it, under results/ or in the repository), so that a reader can open what a
sentence rests on after files move."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = sorted(p for p in (ROOT / "results" / "investigations").iterdir() if p.is_dir())
FILE = re.compile(r"[\w./-]+\.(py|json|log|txt|md|sh|gz|yaml|png|pdf|csv|pickle)")


def named_files(readme: Path) -> list[str]:
    """The backticked names of files (a test id's file without its ::name), placeholders (<x>, *) left out."""
    names = (tok.split("::")[0] for tok in re.findall(r"`([^`\s]+)`", readme.read_text()))
    return [n for n in names if FILE.fullmatch(n)]


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_every_file_a_readme_names_exists(folder):
    readme = folder / "README.md"
    assert readme.exists(), f"{folder.name} has no README.md"
    missing = [n for n in named_files(readme) if not any((b / n).exists() for b in (folder, ROOT / "results", ROOT))]
    assert not missing, f"{folder.name}/README.md names files that are not there: {missing}"
