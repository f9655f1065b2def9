"""The user docs hold together: every relative link and #anchor resolves, and the README's figures
come from docs/benchmarks.md.

Rules checked (no network, no rendering; a few milliseconds):
1. Every relative link (Markdown, or an HTML a / img / source tag) in README.md, CHANGELOG.md, docs/*.md and benchmarks/NOTES.md names a file
   or folder that exists, and its #anchor, if any, is a heading of the Markdown file it names.
   Anchors are GitHub's: the heading's text lower-cased, everything but letters, digits, spaces,
   hyphens and underscores dropped, spaces made hyphens, a repeated one suffixed -1, -2, ...
   Links and headings inside fenced code blocks and inline code do not count.
2. Each row of the README's headline table links to a section of docs/benchmarks.md, and every
   number in the row, and its card, appears in that section, beside a command and a commit: a
   figure quoted in the README is one the reference states, with how it was measured.
3. The README carries no commit hashes: they live in the reference.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "NOTES.md",
               *(ROOT / "docs").glob("*.md")])
BENCHMARKS = ROOT / "docs" / "benchmarks.md"

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
HTML_LINK = re.compile(r"<(?:a|img|source)\b[^>]*?\s(?:href|src)=[\"']([^\"']+)[\"']", re.I)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\w])")
COMMIT = re.compile(r"`[0-9a-f]{7,40}`")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def heading_text(raw: str) -> str:
    """A heading as GitHub renders its text: code spans keep their content, links their text."""
    text = INLINE_CODE.sub(lambda m: m.group(2), raw)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    return text.replace("*", "")


def slug(raw: str) -> str:
    text = heading_text(raw).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(path: Path) -> list[tuple[int, int, str]]:
    """(line number, level, anchor) of each heading, anchors de-duplicated as GitHub does."""
    seen: dict[str, int] = {}
    out = []
    for number, line in prose_lines(path.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        anchor = slug(match.group(2))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        out.append((number, len(match.group(1)), anchor if count == 0 else f"{anchor}-{count}"))
    return out


def links(path: Path) -> list[tuple[int, str]]:
    out = []
    for number, line in prose_lines(path.read_text()):
        bare = INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line)
        out += [(number, m.group(1)) for m in LINK.finditer(bare)]
        out += [(number, m.group(1)) for m in REFERENCE_DEF.finditer(bare)]
        out += [(number, m.group(1)) for m in HTML_LINK.finditer(bare)]
    return out


def broken(path: Path, target: str) -> str | None:
    """Why a link from `path` to `target` does not resolve, or None."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
        return None
    file_part, _, anchor = target.partition("#")
    dest = (path.parent / file_part).resolve() if file_part else path
    if not dest.exists():
        return f"no file {file_part}"
    if anchor and dest.suffix == ".md" and anchor not in {a for _, _, a in headings(dest)}:
        return f"no heading #{anchor} in {dest.name}"
    return None


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(path: Path) -> None:
    problems = [f"{path.relative_to(ROOT)}:{number}: ({target}) {why}"
                for number, target in links(path) if (why := broken(path, target))]
    assert not problems, "\n".join(problems)


def test_anchors_follow_github_rules() -> None:
    assert slug("Where a frame's time goes (`benchmarks/profile_frame.py`)") == \
        "where-a-frames-time-goes-benchmarksprofile_framepy"
    assert slug("`/v1/live/sessions` (GPT-Live)") == "v1livesessions-gpt-live"
    assert slug("PersonaPlex: load and prefill") == "personaplex-load-and-prefill"


def test_a_repeated_heading_gets_a_numbered_anchor_and_code_holds_none(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Notes\n\n## Run\n\n```\n# not a heading\n```\n\n## Run\n")
    assert [anchor for _, _, anchor in headings(page)] == ["notes", "run", "run-1"]


def section(path: Path, anchor: str) -> str:
    """The text under a heading, to the next heading of its level or above."""
    lines = path.read_text().splitlines()
    found = headings(path)
    for index, (number, level, name) in enumerate(found):
        if name == anchor:
            end = next((n for n, lv, _ in found[index + 1:] if lv <= level), len(lines) + 1)
            return "\n".join(lines[number - 1:end - 1])
    raise AssertionError(f"docs/benchmarks.md has no section #{anchor}")


def headline_rows() -> list[list[str]]:
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("## Headline figures")
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("|") and not re.match(r"^\|[\s|:-]+\|$", line):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows[1:]  # the header row


def test_every_headline_figure_is_stated_in_its_benchmarks_section() -> None:
    rows = headline_rows()
    assert len(rows) >= 5
    for *cells, card, link in rows:
        match = re.search(r"\]\(docs/benchmarks\.md#([^)]+)\)", link)
        assert match, f"row {cells[0]!r} links to no section of docs/benchmarks.md"
        text = section(BENCHMARKS, match.group(1))
        stated = set(NUMBER.findall(text))
        missing = [n for cell in cells for n in NUMBER.findall(cell) if n not in stated]
        assert not missing, f"README row {cells[0]!r}: {missing} not in docs/benchmarks.md#{match.group(1)}"
        assert card in text, f"README row {cells[0]!r}: card {card} not in its section"
        assert "python benchmarks/" in text, f"#{match.group(1)} gives no command"
        assert COMMIT.search(text), f"#{match.group(1)} names no commit"


def test_the_readme_names_no_commit() -> None:
    readme = (ROOT / "README.md").read_text()
    assert not COMMIT.findall(readme)


def test_the_checker_sees_a_broken_link_and_a_broken_anchor(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n## A `code` heading\n\n[ok](#a-code-heading) [bad](#nope) [gone](missing.md)\n"
                    "```\n[in code](nowhere.md)\n```\n`[inline](nowhere.md)`\n<img src=\"shot.png\" alt=\"x\">\n")
    found = {target: broken(page, target) for _, target in links(page)}
    assert found == {"#a-code-heading": None, "#nope": "no heading #nope in page.md", "missing.md": "no file missing.md",
                     "shot.png": "no file shot.png"}


def test_the_architecture_picture_is_what_its_source_draws():
    """docs/figures/architecture.svg is generated (docs/figures/architecture.py): rendering the source
    must give the committed picture byte for byte, so the two cannot drift apart."""
    import importlib.util

    source = ROOT / "docs" / "figures" / "architecture.py"
    spec = importlib.util.spec_from_file_location("architecture_figure", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    drawn = module.render()
    assert drawn.startswith("<svg") and "engine client" in drawn
    assert drawn == (ROOT / "docs" / "figures" / "architecture.svg").read_text(), \
        "run `python docs/figures/architecture.py` and commit the SVG"
