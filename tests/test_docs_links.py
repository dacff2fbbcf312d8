"""Relative links in README.md and docs/*.md resolve: the file exists, and a `#fragment` names
one of its headings (GitHub's anchor rule). Docs are split and sections renamed as the project
grows (hopper.md's history moved to hopper_targets_history.md in session 104); a dangling link
is then silent on GitHub, so it fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings, outside fenced code blocks."""
    anchors, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.*)", line)):
            anchors.add(github_anchor(m.group(1)))
    return anchors


def relative_links(path: Path) -> list[str]:
    """Link targets that are not URLs (`http:`, `mailto:`, ...)."""
    return [t for t in LINK.findall(path.read_text()) if not re.match(r"[a-z]+:", t)]


def test_github_anchor() -> None:
    assert github_anchor("Issue 13's targets: where they stand (session 98)") == (
        "issue-13s-targets-where-they-stand-session-98"
    )
    assert github_anchor("Final-phase precision switch (`--switch-recipe`, `--switch-at`)") == (
        "final-phase-precision-switch---switch-recipe---switch-at"
    )


def test_docs_have_links() -> None:
    assert sum(len(relative_links(p)) for p in DOCS) > 20  # the pattern still finds them


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in relative_links(doc):
        path, _, fragment = target.partition("#")
        dest = doc.parent / path if path else doc
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in headings(dest):
            broken.append(f"{target} (no such heading)")
    assert broken == [], f"{doc.name}: dangling links: {broken}"
