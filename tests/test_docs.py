"""The documentation's shape: the README stays a front page, the links between README.md and
docs/*.md resolve (files and headings), docs/index.md links every page, and the architecture
table of docs/interop.md is the registry `tfjax.interop.ARCHITECTURES` loads from.

The pages' ```python blocks run in tests/test_readme.py, whose page list this file shares.
"""

import os
import re

from conftest import ROOT
from test_readme import PAGES

README_MAX_LINES = 250
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(page: str) -> list[tuple[int, str]]:
    """(line number, line) of a page outside its fenced blocks, inline code removed."""
    lines, fenced = [], False
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if re.match(r"^\s*```", line):
                fenced = not fenced
            elif not fenced:
                lines.append((number, re.sub(r"`[^`]*`", "", line)))
    return lines


def heading_anchors(page: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as
    hyphens, a repeated one numbered."""
    anchors: set[str] = set()
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        text = re.sub(r"^\s*```.*?^\s*```", "", f.read(), flags=re.S | re.M)
    for heading in re.findall(r"^#+\s+(.*?)\s*$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def page_links(page: str) -> list[tuple[int, str]]:
    """(line, target) of each relative Markdown link of a page."""
    return [
        (number, target)
        for number, line in _prose(page)
        for target in LINK.findall(line)
        if not re.match(r"^[a-z]+:", target)  # http:, https:, mailto:
    ]


def test_the_readme_is_a_front_page():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, over {README_MAX_LINES}: move detail to docs/"
    )


def test_links_between_the_pages_resolve():
    broken = []
    for page in PAGES:
        for number, target in page_links(page):
            path, _, anchor = target.partition("#")
            file = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path or page))
            if not os.path.exists(file):
                broken.append(f"{page}:{number}: {target} (no file {os.path.relpath(file, ROOT)})")
            elif anchor and file.endswith(".md"):
                if anchor not in heading_anchors(os.path.relpath(file, ROOT)):
                    broken.append(f"{page}:{number}: {target} (no heading #{anchor})")
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)


def test_the_index_and_the_readme_link_every_page():
    pages = {os.path.basename(p) for p in PAGES if p.startswith("docs/")} - {"index.md"}
    index = {os.path.basename(t.partition("#")[0]) for _, t in page_links("docs/index.md")}
    readme = {os.path.basename(t.partition("#")[0]) for _, t in page_links("README.md")}
    assert not pages - index, f"docs/index.md does not link {sorted(pages - index)}"
    assert not pages - readme, f"README.md does not link {sorted(pages - readme)}"


def architecture_table(page: str = "docs/interop.md") -> dict[str, int]:
    """{architecture: line} of the page's table whose first column is the config.json
    architecture: each row names its architectures in backticks in that column."""
    rows, in_table = {}, False
    for number, line in _raw_lines(page):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].startswith("architecture"):
            assert not rows, f"{page}:{number}: a second architecture table"
            in_table = True
        elif in_table and line.startswith("|"):
            if set(cells[0]) <= set("-: "):
                continue  # the header's rule
            names = re.findall(r"`(\w+)`", cells[0])
            assert names, f"{page}:{number}: a row of the architecture table names none"
            rows.update(dict.fromkeys(names, number))
        else:
            in_table = False
    assert rows, f"{page} has no table whose first column is `architecture`"
    return rows


def _raw_lines(page: str) -> list[tuple[int, str]]:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return list(enumerate(f.read().splitlines(), start=1))


def test_the_interop_table_is_the_registry():
    from tfjax import interop

    table = architecture_table()
    registered = set(interop.ARCHITECTURES)
    missing = sorted(registered - set(table))
    unknown = sorted(f"{name} (docs/interop.md:{table[name]})" for name in set(table) - registered)
    assert not missing, f"registered in interop.ARCHITECTURES, not in docs/interop.md: {missing}"
    assert not unknown, f"in docs/interop.md's table, not in interop.ARCHITECTURES: {unknown}"
    # The converters the table's rows name are interop's.
    rows = set(table.values())
    converters = {
        name
        for number, line in _raw_lines("docs/interop.md")
        if number in rows
        for name in re.findall(r"`((?:from|to)_\w+)`", line)
    }
    absent = sorted(name for name in converters if not hasattr(interop, name))
    assert not absent, f"docs/interop.md names converters tfjax.interop lacks: {absent}"


def test_the_table_parser_reads_every_row_and_refuses_a_second_table(tmp_path, monkeypatch):
    import test_docs

    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    table = "| architecture | x |\n|---|---|\n| `A`, `B` | a |\n| `C` | c |\n"
    page.write_text(f"# p\n\n{table}\ntext\n")
    monkeypatch.setattr(test_docs, "ROOT", str(tmp_path))
    assert architecture_table("docs/page.md") == {"A": 5, "B": 5, "C": 6}
    page.write_text(f"# p\n\n{table}\n{table}")
    try:
        architecture_table("docs/page.md")
    except AssertionError as e:
        assert "a second architecture table" in str(e), e
    else:
        raise AssertionError("a page with two architecture tables was read as one")
