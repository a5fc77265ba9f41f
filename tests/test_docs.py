"""The documentation: the generated flag reference, links that resolve, commands that parse."""

from __future__ import annotations

import re
import shlex

import pytest

from cli import flag_reference, parse_eval_args, parse_train_args
from tests.conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PROSE = [page for page in PAGES if page != ROOT / "docs" / "cli.md"]  # cli.md is generated
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
MAX_PARAGRAPH_WORDS = 120
MAX_CELL_CHARS = 160


def page_id(page) -> str:
    return str(page.relative_to(ROOT))


def test_the_flag_reference_is_generated_from_the_code():
    committed = (ROOT / "docs" / "cli.md").read_text()
    assert committed == flag_reference(), "run: python cli.py > docs/cli.md"


def test_the_flag_reference_names_every_flag_of_both_scripts():
    reference = flag_reference()
    for option in ("--ray-address", "--repeat-action-probability", "--stall-steps", "--model"):
        assert f"`{option}`" in reference
    assert "`--shared-optimizer / --no-shared-optimizer` | `-so` | on |" in reference


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_relative_link_and_image_points_at_a_file(page):
    missing = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue  # a web address or a heading on the same page
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            missing.append(target)
    assert not missing, f"{page.name} links to missing files: {missing}"


def heading_anchors(page) -> set[str]:
    """The anchors GitHub gives a page's headings (``## Set up a cluster``: set-up-a-cluster)."""
    anchors: set[str] = set()
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # no headings in code
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, re.M):
        anchor = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n, unique = 0, anchor
        while unique in anchors:  # a repeated heading gets -1, -2, ...
            n += 1
            unique = f"{anchor}-{n}"
        anchors.add(unique)
    return anchors


def test_every_link_to_a_heading_finds_it():
    """Links between the pages, and the docs links that the code's messages print."""
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if "#" not in target or re.match(r"^[a-z]+:", target):
                continue
            file, anchor = target.split("#", 1)
            linked = (page.parent / file).resolve() if file else page
            if linked.suffix == ".md" and anchor not in heading_anchors(linked):
                broken.append(f"{page.name}: {target}")
    for source in [*ROOT.glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]:
        for file, anchor in re.findall(r"((?:docs/)?[\w-]+\.md)#([\w-]+)", source.read_text()):
            if anchor not in heading_anchors(ROOT / file):
                broken.append(f"{source.name}: {file}#{anchor}")
    assert not broken, f"links to headings that do not exist: {broken}"


def quick_start_commands() -> list[str]:
    """The python commands of the README's quick-start section (continuations joined)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith(("python main.py", "python gym_eval.py")):
                commands.append(line)
    return commands


def test_the_quick_start_commands_parse():
    commands = quick_start_commands()
    assert any(c.startswith("python main.py") for c in commands)
    assert any(c.startswith("python gym_eval.py") for c in commands)
    for command in commands:
        script, *flags = shlex.split(command)[1:]
        parse = parse_train_args if script == "main.py" else parse_eval_args
        parse(flags)  # a UsageError or argparse's SystemExit fails the test


def blocks(page) -> tuple[list[list[str]], list[str]]:
    """A page's paragraphs (runs of prose lines) and its table rows; code blocks left out.

    A blank line, a heading, a table or a code fence ends a paragraph, and each list item
    starts one: a list of cases is as many paragraphs as it has items.
    """
    paragraphs: list[list[str]] = []
    rows: list[str] = []
    current: list[str] = []
    in_code = False
    for line in page.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            in_code = not in_code
        if in_code or stripped.startswith(("```", "#", "|")) or not stripped:
            if stripped.startswith("|") and not in_code:
                rows.append(stripped)
            if current:
                paragraphs.append(current)
            current = []
            continue
        if re.match(r"^([-*+]|\d+\.) ", stripped) and current:  # a new list item
            paragraphs.append(current)
            current = []
        current.append(stripped)
    if current:
        paragraphs.append(current)
    return paragraphs, rows


def table_cells(row: str) -> list[str]:
    """A markdown table row's cells; a `|` inside a code span or escaped as `\\|` is text."""
    cells, cell, in_code = [], "", False
    previous = ""
    for char in row.strip().strip("|"):
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code and previous != "\\":
            cells.append(cell.strip())
            cell = ""
        else:
            cell += char
        previous = char
    return [*cells, cell.strip()]


@pytest.mark.parametrize("page", PROSE, ids=page_id)
def test_no_paragraph_is_over_120_words(page):
    paragraphs, _ = blocks(page)
    long = [
        f"{len(' '.join(p).split())} words: {' '.join(p)[:70]}..."
        for p in paragraphs
        if len(" ".join(p).split()) > MAX_PARAGRAPH_WORDS
    ]
    assert not long, f"{page_id(page)}: paragraphs over {MAX_PARAGRAPH_WORDS} words: {long}"


@pytest.mark.parametrize("page", PROSE, ids=page_id)
def test_no_table_cell_is_over_160_characters(page):
    _, rows = blocks(page)
    long = [
        f"{len(cell)} chars: {cell[:70]}..."
        for row in rows
        for cell in table_cells(row)
        if len(cell) > MAX_CELL_CHARS
    ]
    assert not long, f"{page_id(page)}: table cells over {MAX_CELL_CHARS} characters: {long}"


def test_the_readme_reads_in_three_minutes():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert len(text.split()) <= 1200


@pytest.mark.parametrize(("name", "most"), [("roadmap.md", 60), ("cluster.md", 250)])
def test_a_doc_stays_within_its_length(name, most):
    lines = len((ROOT / "docs" / name).read_text().splitlines())
    assert lines <= most, f"docs/{name} has {lines} lines, at most {most} wanted"


@pytest.mark.parametrize("page", [p for p in PROSE if p.name != "README.md"], ids=page_id)
def test_every_doc_opens_with_a_summary(page):
    """After its title, a paragraph of at most 5 lines says what the page covers and for whom."""
    lines = page.read_text().splitlines()
    assert lines and lines[0].startswith("# "), f"{page_id(page)} does not open with a title"
    rest = "\n".join(lines[1:]).strip().split("\n\n", 1)[0].splitlines()
    opening = rest[0] if rest else ""
    assert opening and not opening.startswith(("#", "|", "```", "- ", "* ", "!")), (
        f"{page_id(page)}: the title is followed by {opening!r}, not a summary"
    )
    assert len(rest) <= 5, (
        f"{page_id(page)}: the opening paragraph has {len(rest)} lines, at most 5"
    )
