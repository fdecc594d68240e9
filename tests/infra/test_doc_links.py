"""Every link between the README and the docs lands: the file it names exists, and a `#section` it names is one of
that file's headings (as GitHub derives a heading's anchor); and every results page is in the results index, where
the reference pages find it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#+\s+(.*?)\s*$", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces as `-`."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {anchor(h) for h in HEADING.findall(FENCE.sub("", path.read_text()))}


def broken_links(document: Path, root: Path = ROOT) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", document.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        name, _, section = target.partition("#")
        path = (document.parent / name).resolve() if name else document
        if not path.exists():
            broken.append(f"{document.relative_to(root)}: {target} (no such file)")
        elif section and path.suffix == ".md" and section not in anchors(path):
            broken.append(f"{document.relative_to(root)}: {target} (no such section)")
    return broken


def test_every_link_in_the_readme_and_docs_lands():
    assert [b for d in DOCUMENTS for b in broken_links(d)] == []


def test_the_check_finds_a_missing_file_and_a_missing_section(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("## Chunk routing, and `top_k`\n\n[here](#chunk-routing-and-top_k) [gone](other.md) "
                    "[nowhere](#no-section) [web](https://example.com)\n")
    assert broken_links(page, tmp_path) == ["page.md: other.md (no such file)",
                                            "page.md: #no-section (no such section)"]


def test_every_results_page_is_in_the_results_index():
    results = ROOT / "docs" / "results"
    index = (results / "README.md").read_text()
    assert [p.name for p in sorted(results.glob("2*.md")) if f"]({p.name})" not in index] == []
