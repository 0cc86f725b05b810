"""The published scenario schema: a draft-07 file in step with the models, read by a standard
validator as the loader reads scenarios, and named by every bundled scenario's modeline."""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import json
import tomllib
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from click.testing import CliRunner
from pydantic import Field

from ftkit.errors import ScenarioError
from ftkit.faults import FaultKind
from ftkit.kinds import KIND_SPECS
from ftkit.scenario import FORMAT_VERSION, load_scenario, load_scenario_text
from ftkit.scenario import model as scenario_model
from ftkit.scenario import schema
from ftkit_cli.main import ftkit

REPO = Path(__file__).resolve().parents[2]
#: Every scenario file the project ships or keeps as a valid example. tests/data/scenarios/bad
#: holds files that are broken on purpose, at line numbers other tests assert on.
BUNDLED = sorted([*(REPO / "scenarios").glob("*.yaml"),
                  *(REPO / "examples" / "downstream" / "scenarios").glob("*.y*ml"),
                  *(REPO / "tests" / "data" / "scenarios" / "good").glob("*.y*ml")])

# A valid scenario with a fault of each kind that takes params.
VALID = {
    "name": "schema-check",
    "engine": {"tensor_parallel_size": 2},
    "workload": {"prompts": ["a prompt", "another prompt"], "max_tokens": 8},
    "faults": [
        {"kind": "uce", "rank": 0, "at": {"request": 0, "token": 2},
         "params": {"region": "weights", "parameter": "model.norm.weight"}},
        {"kind": "hang", "rank": "all", "at": {"request": 1, "token": 3},
         "params": {"op_timeout_s": 1.5}},
        {"kind": "link_flap", "rank": 1, "at": {"request": 0, "token": 4}, "times": 2},
    ],
    "expect": {"timeout_s": 60},
}


def published() -> dict[str, Any]:
    return json.loads(schema.SCHEMA_FILE.read_text())


def validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(published())


def loads(data: dict[str, Any]) -> bool:
    """Whether ftkit's own loader accepts the scenario ``data``."""
    try:
        load_scenario_text(yaml.safe_dump(data, sort_keys=False))
    except ScenarioError:
        return False
    return True


def changed(path: tuple[str | int, ...], value: Any = None, *, rename: str | None = None
            ) -> dict[str, Any]:
    """``VALID`` with the key at ``path`` set to ``value``, or renamed to ``rename``."""
    data = copy.deepcopy(VALID)
    parent = data
    for part in path[:-1]:
        parent = parent[part]
    if rename is not None:
        parent[rename] = parent.pop(path[-1])
    else:
        parent[path[-1]] = value
    return data


# --- the file --------------------------------------------------------------------------------

def test_the_schema_is_draft_07_with_an_id_and_the_format_version():
    found = published()
    jsonschema.Draft7Validator.check_schema(found)
    assert found["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert found["$id"] == f"urn:ftkit:scenario:{FORMAT_VERSION}"
    assert f"format {FORMAT_VERSION}" in found["title"]


def out_of_step() -> str | None:
    """Why the published file differs from what the models make of it, or ``None``."""
    if schema.SCHEMA_FILE.read_text() == schema.render():
        return None
    return (f"{schema.SCHEMA_FILE.name} is out of date with the scenario models: run "
            f"`{schema.REGENERATE}` and commit the result")


def test_the_published_file_is_what_the_models_make():
    assert out_of_step() is None, out_of_step()


def test_a_scenario_field_added_without_regenerating_is_caught(monkeypatch):
    class Grown(scenario_model.Scenario):
        """A scenario with one more field."""

        owner: str = Field("", description="who looks after this scenario")

    monkeypatch.setattr(scenario_model, "Scenario", Grown)
    assert "owner" in schema.build()["properties"]
    assert schema.REGENERATE in (out_of_step() or "")


def test_a_params_field_added_without_regenerating_is_caught(monkeypatch):
    spec = KIND_SPECS[FaultKind.HANG]

    class GrownParams(spec.params):
        jitter_s: float = Field(0.0, description="random extra wait")

    monkeypatch.setitem(KIND_SPECS, FaultKind.HANG, dataclasses.replace(spec, params=GrownParams))
    assert out_of_step() is not None


def test_ftkit_schema_prints_the_published_file():
    result = CliRunner().invoke(ftkit, ["schema"])
    assert result.exit_code == 0, result.output
    assert result.stdout == schema.SCHEMA_FILE.read_text()


def test_the_file_is_package_data():
    package = resources.files("ftkit.scenario")
    assert Path(str(package / schema.SCHEMA_FILE.name)) == schema.SCHEMA_FILE
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = declared.get("package-data", {}).get("ftkit.scenario", [])
    assert any(fnmatch.fnmatch(schema.SCHEMA_FILE.name, p) for p in patterns), (
        "pyproject.toml must declare the schema as package data of ftkit.scenario")


# --- what it accepts and rejects, as the loader does ---------------------------------------

@pytest.mark.parametrize("path", BUNDLED, ids=lambda p: str(p.relative_to(REPO)))
def test_every_bundled_scenario_validates(path):
    validator().validate(yaml.safe_load(path.read_text()))
    load_scenario(path)


def test_the_scenarios_are_all_there():
    names = {p.relative_to(REPO).parts[0] for p in BUNDLED}
    assert names == {"scenarios", "examples", "tests"}
    assert len(BUNDLED) >= 18


REJECTED = {
    "misspelled param": changed(("faults", 0, "params", "region"), rename="regoin"),
    "another kind's param": changed(("faults", 1, "params", "op_timeout_s"), rename="region"),
    "params for a kind without params": changed(("faults", 2, "params"), {"size": 3}),
    "bad param value": changed(("faults", 0, "params", "region"), "cache"),
    "param of the wrong type": changed(("faults", 1, "params", "op_timeout_s"), "2"),
    "unknown top-level key": changed(("owner",), "me"),
    "unknown nested key": changed(("workload", "max_tokens"), rename="max_tokenz"),
    "wrong type": changed(("engine", "tensor_parallel_size"), "two"),
    "bool for a number": changed(("expect", "timeout_s"), True),
    "wrong kind name": changed(("faults", 2, "kind"), "link_flapp"),
    "bad rank": changed(("faults", 0, "rank"), "any"),
    "missing field": changed(("faults", 0, "at"), {"request": 0}),
}


def test_the_valid_base_passes_both():
    assert validator().is_valid(VALID)
    assert loads(VALID)


@pytest.mark.parametrize("case", sorted(REJECTED))
def test_the_schema_rejects_what_the_loader_rejects(case):
    data = REJECTED[case]
    assert not validator().is_valid(data), f"the schema accepts a scenario with a {case}"
    assert not loads(data), f"the loader accepts a scenario with a {case}"


def test_a_misspelled_param_is_named_by_the_validator():
    [error] = validator().iter_errors(REJECTED["misspelled param"])
    assert list(error.absolute_path) == ["faults", 0, "params"]
    assert "'regoin'" in error.message


ACCEPTED = {
    "no params": changed(("faults", 1, "params"), {}),
    "an integer for a float": changed(("faults", 1, "params", "op_timeout_s"), 2),
    "process_kill target": changed(("faults", 0), {"kind": "process_kill", "rank": 0,
                                                   "at": {"request": 0, "token": 2},
                                                   "params": {"target": "engine"}}),
    "null parameter": changed(("faults", 0, "params", "parameter"), None),
    "engine args": changed(("engine", "args"), {"enforce_eager": False, "foo": [1, {"a": 2}]}),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_the_schema_accepts_what_the_loader_accepts(case):
    assert validator().is_valid(ACCEPTED[case])
    assert loads(ACCEPTED[case])


def test_the_semantic_rules_are_left_to_the_loader():
    # Documented: the schema checks keys and types only; `ftkit validate` checks the rules.
    data = changed(("faults", 0, "rank"), 5)  # the world size is 2
    assert validator().is_valid(data)
    assert not loads(data)


# --- descriptions and strictness ------------------------------------------------------------

def fields(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every field (an entry of a ``properties`` map) of a schema, with its path. The
    ``if``/``then`` clauses that pick a kind's params restate fields, not declare them."""
    if isinstance(node, list):
        for index, item in enumerate(node):
            yield from fields(item, f"{path}[{index}]")
    elif isinstance(node, dict):
        for key, value in node.items():
            if key in ("if", "then", "else"):
                continue
            if key == "properties":
                for name, prop in value.items():
                    yield f"{path}.{name}", prop
            yield from fields(value, f"{path}/{key}")


def test_every_field_has_a_description():
    found = list(fields(published()))
    assert len(found) >= 30
    assert [path for path, prop in found if not prop.get("description")] == []


def test_the_description_walk_finds_a_field_without_one():
    bare = {"definitions": {"X": {"properties": {"a": {"type": "integer"},
                                                 "b": {"description": "b"}}}}}
    assert [path for path, prop in fields(bare) if not prop.get("description")] == \
        ["/definitions/X.a"]


def objects(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, list):
        for item in node:
            yield from objects(item)
    elif isinstance(node, dict):
        if "properties" in node and "if" not in node and node.get("type") == "object":
            yield node
        for value in node.values():
            yield from objects(value)


def test_every_object_forbids_unknown_keys():
    found = list(objects(published()))
    assert len(found) >= 12  # the scenario, its seven sections and models, four params models
    assert all(obj.get("additionalProperties") is False for obj in found)


def test_params_are_typed_for_every_kind():
    found = published()
    clauses = found["definitions"]["FaultSpec"]["allOf"]
    by_kind = {c["if"]["properties"]["kind"]["const"]: c["then"]["properties"]["params"]["$ref"]
               for c in clauses}
    assert set(by_kind) == {kind.value for kind in KIND_SPECS}
    for kind, spec in KIND_SPECS.items():
        definition = found["definitions"][by_kind[kind.value].rsplit("/", 1)[-1]]
        assert set(definition["properties"]) == set(spec.params.model_fields)
        assert definition["additionalProperties"] is False


# --- the modeline ---------------------------------------------------------------------------

def modeline_target(path: Path) -> Path | None:
    """The schema file a scenario's first line names, resolved, or ``None``."""
    first = path.read_text().split("\n", 1)[0]
    if not first.startswith(schema.MODELINE):
        return None
    return (path.parent / first[len(schema.MODELINE):]).resolve()


@pytest.mark.parametrize("path", BUNDLED, ids=lambda p: str(p.relative_to(REPO)))
def test_every_bundled_scenario_names_the_schema(path):
    assert modeline_target(path) == schema.SCHEMA_FILE.resolve(), (
        f"{path.relative_to(REPO)} must start with `{schema.MODELINE}` and the schema's "
        f"path relative to it")


def test_a_missing_or_wrong_modeline_is_caught(tmp_path):
    scenario = tmp_path / "s.yaml"
    scenario.write_text("name: s\n")
    assert modeline_target(scenario) is None
    scenario.write_text(f"{schema.MODELINE}../ftkit/scenario/scenario.schema.json\nname: s\n")
    assert modeline_target(scenario) != schema.SCHEMA_FILE.resolve()


def test_errors_in_a_file_with_a_modeline_name_the_right_line(tmp_path):
    text = (REPO / "scenarios" / "link_flap.yaml").read_text()
    assert text.startswith(schema.MODELINE)
    broken = text.replace("    rank: 1\n", "    rank: -1\n")
    line = broken.splitlines().index("    rank: -1") + 1
    path = tmp_path / "link_flap.yaml"
    path.write_text(broken)
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    [error] = info.value.errors
    assert (error.line, error.field) == (line, "faults[0].rank")
