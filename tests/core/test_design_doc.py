"""The project explains itself: every "rule N" it cites is a rule of docs/design.md, it cites no
document it does not contain, and the README's layout lists exactly the modules that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "crashsafe"
DESIGN = ROOT / "docs" / "design.md"


def _texts() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "DEVELOPERS.md"]
    for folder, pattern in (("src", "*.py"), ("tests", "*.py"), ("bench", "*.py"), ("docs", "*.md")):
        found += sorted((ROOT / folder).rglob(pattern))
    return [p for p in found if p != DESIGN]


def test_every_rule_cited_is_a_rule_of_the_design_doc() -> None:
    rules = {int(n) for n in re.findall(r"^(\d+)\. \*\*", DESIGN.read_text(), re.MULTILINE)}
    assert rules == set(range(1, len(rules) + 1)) and len(rules) >= 18
    cited = {
        f"{path.relative_to(ROOT)}: rule {n}"
        for path in _texts()
        for n in re.findall(r"\brules? (\d+)\b", path.read_text())
        if int(n) not in rules
    }
    assert not cited, sorted(cited)


def test_no_document_outside_the_project_is_cited() -> None:
    outside = [
        str(path.relative_to(ROOT))
        for path in _texts()
        if path != Path(__file__) and re.search(r"\bDESIGN\.md|shared/", path.read_text())
    ]
    assert not outside, outside


def test_the_readme_layout_lists_exactly_the_modules_there_are() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("```\nsrc/crashsafe/\n") :]
    block = block[: block.index("\n```")]
    listed = {m.group(1) for m in re.finditer(r"^  (\S+?\.py|\S+?/)\s", block, re.MULTILINE)}
    present = {p.name for p in PACKAGE.glob("*.py")} | {
        f"{p.name}/" for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()
    }
    assert listed == present, {
        "listed, not present": listed - present,
        "present, not listed": present - listed,
    }
