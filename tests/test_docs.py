"""The documentation: the generated flag reference, links that resolve, commands that parse."""

from __future__ import annotations

import re
import shlex

import pytest

from cli import flag_reference, parse_eval_args, parse_train_args
from tests.conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def test_the_flag_reference_is_generated_from_the_code():
    committed = (ROOT / "docs" / "cli.md").read_text()
    assert committed == flag_reference(), "run: python cli.py > docs/cli.md"


def test_the_flag_reference_names_every_flag_of_both_scripts():
    reference = flag_reference()
    for option in ("--ray-address", "--repeat-action-probability", "--stall-steps", "--model"):
        assert f"`{option}`" in reference
    assert "`--shared-optimizer / --no-shared-optimizer` | `-so` | on |" in reference


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
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
