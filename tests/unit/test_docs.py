"""The documentation stays short, generated where it can be, and linked correctly: the README
under its size limit, the scenario reference equal to what the generator makes of the models
today, every relative link pointing at a file (and heading) that exists, and the module map
naming modules that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ftkit.scenario import reference

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
#: "At most about 10 KB" (issue 14): the README reads in ten minutes.
README_LIMIT_BYTES = 10 * 1024

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$", re.M)


def _prose(path: Path) -> str:
    """The Markdown of ``path`` without its fenced code blocks."""
    return FENCE.sub("", path.read_text())


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_anchor(h) for h in HEADING.findall(_prose(path))}


def test_readme_is_at_most_about_10_kb():
    size = len(README.read_bytes())
    assert size <= README_LIMIT_BYTES, (
        f"README.md is {size} bytes, over {README_LIMIT_BYTES}: move detail to docs/ and link it")


def test_scenario_reference_matches_the_models():
    page = REPO / reference.PAGE
    assert page.is_file(), f"{reference.PAGE} is missing: run `{reference.REGENERATE}`"
    assert page.read_text() == reference.render(), (
        f"{reference.PAGE} is out of date with the scenario models: run "
        f"`{reference.REGENERATE}` and commit the result")


def test_scenario_reference_covers_every_field_and_kind():
    from ftkit.kinds import KIND_SPECS

    page = reference.render()
    for section in ("engine", "workload", "workload.random_prompts", "recovery", "faults[]",
                    "faults[].at", "expect"):
        assert f"## `{section}`" in page
    for kind, spec in KIND_SPECS.items():
        assert f"### `{kind}`" in page
        for field in spec.params.model_fields:
            assert f"`params.{field}`" in page


def test_every_field_of_the_format_is_described():
    """Editors show these descriptions; the reference page is made of them."""
    rows = [line for line in reference.render().splitlines()
            if line.startswith("| `") or line.startswith("| [`")]
    assert rows
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]
    assert {len(c) for c in cells} == {4}  # field, type, default, description
    assert [c[0] for c in cells if not c[3]] == []


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_every_relative_link_points_to_an_existing_file(path):
    broken = []
    for target in LINK.findall(_prose(path)):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{path.relative_to(REPO)}: " + "; ".join(broken)


def test_readme_shows_the_scenario_file_as_it_is():
    shown = re.search(r"```yaml\n(.*?)```", README.read_text(), re.S)
    assert shown is not None
    assert shown.group(1) == (REPO / "scenarios" / "link_flap.yaml").read_text()


def test_architecture_names_modules_that_exist():
    page = REPO / "docs" / "architecture.md"
    missing = sorted({
        name for line in page.read_text().splitlines() if "TODO" not in line
        for name in re.findall(r"`((?:ftkit|cli|tests)/[\w/]+(?:\.py|/))`", line)
        if not (REPO / name).exists()})
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_readme_names_every_recovery_setting():
    from dataclasses import fields

    from ftkit.config import CONFIG_KEY, RecoveryConfig

    text = README.read_text()
    assert f'"{CONFIG_KEY}"' in text
    missing = [f.name for f in fields(RecoveryConfig) if f"| `{f.name}` |" not in text]
    assert not missing, f"README.md's settings table lacks {missing}"
