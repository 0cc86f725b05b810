"""What CI reads from the ``ftkit`` command: ``list --json``, ``validate --json`` (one JSON
document on stdout, the exit codes of the text forms) and the exit codes in ``--help``."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from ftkit.kinds import KIND_SPECS
from ftkit_cli.exits import EXIT_CODES
from ftkit_cli.main import ftkit

ROOT = Path(__file__).resolve().parents[2]

GOOD = textwrap.dedent("""\
    name: {name}
    workload:
      prompts: ["the quick brown fox"]
      max_tokens: 8
    faults: []
    """)

BAD = textwrap.dedent("""\
    name: Bad Name
    workload:
      prompts: ["x"]
      max_tokenz: 8
    faults: []
    """)


def invoke(*args: str) -> Result:
    return CliRunner().invoke(ftkit, list(args), env={"COLUMNS": "200"})


def test_list_json_holds_every_fault_kind_the_text_shows():
    result = invoke("list", "--json")
    assert result.exit_code == 0
    document = json.loads(result.stdout)
    assert [k["kind"] for k in document["fault_kinds"]] == [k.value for k in KIND_SPECS]
    for entry in document["fault_kinds"]:
        spec = next(s for k, s in KIND_SPECS.items() if k.value == entry["kind"])
        assert entry["implemented"] is spec.implemented
        assert entry["summary"] == spec.summary
    # The text form lists the same kinds.
    text = invoke("list").stdout.splitlines()
    assert [line.split()[0] for line in text] == [k["kind"] for k in document["fault_kinds"]]


def test_validate_json_of_valid_files_exits_0(tmp_path):
    files = []
    for name in ("one", "two"):
        path = tmp_path / f"{name}.yaml"
        path.write_text(GOOD.format(name=name))
        files.append(str(path))
    result = invoke("validate", "--json", *files)
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {"valid": True, "files": [
        {"file": files[0], "valid": True, "name": "one", "errors": []},
        {"file": files[1], "valid": True, "name": "two", "errors": []}]}


def test_validate_json_gives_every_error_with_file_line_and_field(tmp_path):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(GOOD.format(name="good"))
    bad.write_text(BAD)
    missing = str(tmp_path / "missing.yaml")
    result = invoke("validate", "--json", str(good), str(bad), missing)
    assert result.exit_code == 2
    assert result.stderr == ""  # the document says it all
    document = json.loads(result.stdout)
    assert document["valid"] is False
    by_file = {entry["file"]: entry for entry in document["files"]}
    assert by_file[str(good)]["valid"] is True
    errors = by_file[str(bad)]["errors"]
    assert by_file[str(bad)]["valid"] is False and by_file[str(bad)]["name"] is None
    assert {(e["file"], e["line"], e["field"]) for e in errors} == {
        (str(bad), 1, "name"), (str(bad), 4, "workload.max_tokenz")}
    assert any(e["message"].startswith("unknown key 'max_tokenz'") for e in errors)
    [gone] = by_file[missing]["errors"]
    assert gone["message"] == "no such scenario file or directory"
    assert gone["line"] is None


def test_validate_json_of_a_directory_lists_its_files(tmp_path):
    (tmp_path / "a.yaml").write_text(GOOD.format(name="a"))
    (tmp_path / "b.yaml").write_text(GOOD.format(name="b"))
    result = invoke("validate", "--json", str(tmp_path))
    assert result.exit_code == 0
    assert [(f["file"], f["name"]) for f in json.loads(result.stdout)["files"]] == [
        (str(tmp_path / "a.yaml"), "a"), (str(tmp_path / "b.yaml"), "b")]
    (tmp_path / "c.yaml").write_text(BAD)
    result = invoke("validate", "--json", str(tmp_path))
    assert result.exit_code == 2
    [invalid] = [f for f in json.loads(result.stdout)["files"] if not f["valid"]]
    assert invalid["file"] == str(tmp_path / "c.yaml")


def test_validate_json_with_an_override_error(tmp_path):
    path = tmp_path / "one.yaml"
    path.write_text(GOOD.format(name="one"))
    result = invoke("validate", "--json", str(path), "--set", "engine.dtype=bfloat17")
    assert result.exit_code == 2
    [entry] = json.loads(result.stdout)["files"]
    [error] = entry["errors"]
    assert (entry["file"], error["file"], error["field"]) == (
        str(path), "--set engine.dtype=bfloat17", "engine.dtype")


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"]])
def test_help_lists_every_exit_code_with_its_meaning(args):
    result = invoke(*args)
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    assert "Exit codes of ftkit run:" in text
    for code, meaning in EXIT_CODES:
        assert f"{code} {meaning}" in text, (code, text)


def test_top_level_help_also_gives_the_other_commands_exit_codes():
    text = " ".join(invoke("--help").stdout.split())
    assert "validate: 0 when every file is valid, 2 otherwise." in text
    assert "Exit codes" not in " ".join(invoke("validate", "--help").stdout.split())


def test_the_documented_exit_codes_are_the_commands():
    docs = (ROOT / "docs" / "commands.md").read_text()
    section = docs[docs.index("## Exit codes"):]
    section = section[:section.index("\n## ", 1)]
    documented = {int(code) for code in re.findall(r"^\| `(\d+)` \|", section, re.M)}
    assert documented == {code for code, _ in EXIT_CODES}
