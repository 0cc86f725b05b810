"""The scenario reference (``docs/scenarios.md``), generated from the scenario models.

Every field of the format, with its type, default and description, comes from the JSON
Schema of the models (``scenario_json_schema``, published as ``scenario.schema.json``); the
per-kind ``params`` come from each kind's params model in the ``ftkit.kinds`` registry.
Nothing is restated here, so the page cannot drift from the code as long as it is
regenerated; ``tests/unit/test_docs.py`` fails when it was not::

    python -m ftkit.scenario.reference --write      # rewrite docs/scenarios.md and the schema
    python -m ftkit.scenario.reference              # print the page

What a caller may rely on: ``render()`` is a pure function of the models (the same page
for the same code) and ends with one newline.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ftkit.scenario import schema as published
from ftkit.scenario.model import FORMAT_VERSION, scenario_json_schema

#: Where the page lives, relative to the repository root.
PAGE = Path("docs") / "scenarios.md"
#: The command that rewrites the page (named in the page and in the test's message).
REGENERATE = "python -m ftkit.scenario.reference --write"


def render() -> str:
    """The whole reference page as Markdown."""
    schema = scenario_json_schema()
    defs = schema.get("definitions", {})
    parts = [_intro()]
    for path, obj in _sections(schema, defs):
        parts.append(_section(path, obj, defs))
    parts.append(_params_section())
    return "\n\n".join(parts) + "\n"


def write(root: Path) -> Path:
    """Rewrite the page under the repository root ``root``; return its path."""
    page = root / PAGE
    page.write_text(render())
    return page


def _intro() -> str:
    return (
        "# Scenario reference\n\n"
        f"<!-- Generated from the scenario models by `{REGENERATE}`; do not edit by hand. "
        "-->\n\n"
        f"The scenario format, version {FORMAT_VERSION}. A scenario is one YAML file; unknown "
        "keys and wrong types are errors, reported with file, line and field path "
        "(`ftkit validate FILE`). Numbers are not read from strings, and a bool is not a "
        "number.\n\n"
        "Version 1.1 keeps every field and meaning of version 1 (a version 1 file is a valid "
        "1.1 file) and adds the request features: `workload.sampling` (further fields of "
        "vLLM's `SamplingParams` for every request, by vLLM's own names), `workload.requests` "
        "(one entry per request, each with its own sampling fields) and "
        "`expect.logprob_tolerance`. Request *i* is sampled with the workload's `max_tokens`, "
        "`temperature`, `top_p` and `seed` (plus *i*), then `workload.sampling`, then its own "
        "`sampling`, each over the one before; ftkit sets `ignore_eos: true` unless a field "
        "says otherwise. Where vLLM is installed, `ftkit validate` builds vLLM's own "
        "`SamplingParams` from each request's fields, so that a value vLLM refuses is an error "
        "with its file, line and field (`workload.requests[2].sampling.n`); without vLLM only "
        "the types are checked, and vLLM judges the values when the run starts.\n\n"
        f"The same format is published as a JSON Schema (draft-07, `$id` "
        f"`{published.schema_id()}`): the file `{_repo_path(published.SCHEMA_FILE)}`, "
        "installed with the package and printed by `ftkit schema`. It checks keys, types "
        "and each fault kind's `params`, not the rules below. Editors that use "
        "yaml-language-server (such as VS Code's YAML extension) check and complete a "
        "scenario as it is typed when its first line names the schema file by a path "
        "relative to the scenario. Every bundled scenario starts so; in `scenarios/`:\n\n"
        "```yaml\n"
        f"{published.MODELINE}../{_repo_path(published.SCHEMA_FILE)}\n"
        "```\n\n"
        "Scenarios kept outside this repository can point at a copy made by `ftkit schema > "
        "scenario.schema.json`.\n\n"
        "Beyond types, a scenario must make sense: the rules (a fault's rank, request and "
        "token exist, a link fault has a peer, an expected recovery is possible ...) and "
        "what each fault kind does are in [the fault catalogue](faults.md). A complete "
        "example is `scenarios/link_flap.yaml`, shown in the [README](../README.md).")


# --- walking the schema -----------------------------------------------------------------------

def _sections(schema: dict[str, Any], defs: dict[str, Any],
              path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every object of the format with its field path, each followed by its children."""
    yield path, schema
    for name, prop in schema.get("properties", {}).items():
        child = _object_of(prop, defs)
        if child is not None:
            suffix = "[]" if _is_array(prop, defs) else ""
            yield from _sections(child, defs, _join(path, name) + suffix)


def _object_of(prop: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any] | None:
    """The object schema a property holds (directly, in a list, or optional), if any."""
    prop = _resolve(prop, defs)
    if "properties" in prop:
        return prop
    if prop.get("type") == "array":
        return _object_of(prop.get("items", {}), defs)
    for option in prop.get("anyOf", []):
        found = _object_of(option, defs)
        if found is not None:
            return found
    return None


def _is_array(prop: dict[str, Any], defs: dict[str, Any]) -> bool:
    """Whether ``prop`` holds a list (an optional one too)."""
    prop = _resolve(prop, defs)
    return prop.get("type") == "array" or any(_is_array(o, defs) for o in prop.get("anyOf", []))


def _resolve(prop: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    # The schema wraps a reference that has a description beside it as {"allOf": [ref]}.
    if len(prop.get("allOf", [])) == 1 and "$ref" in prop["allOf"][0]:
        prop = {**prop["allOf"][0], **{k: v for k, v in prop.items() if k != "allOf"}}
    ref = prop.get("$ref")
    if ref is None:
        return prop
    return {**defs[ref.rsplit("/", 1)[-1]], **{k: v for k, v in prop.items() if k != "$ref"}}


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


# --- rendering --------------------------------------------------------------------------------

def _section(path: str, obj: dict[str, Any], defs: dict[str, Any]) -> str:
    title = f"`{path}`" if path else "Top level"
    lines = [f"## {title}", ""]
    if obj.get("description"):
        lines += [_prose(obj["description"]), ""]
    lines += _field_table(path, obj, defs)
    return "\n".join(lines)


def _field_table(path: str, obj: dict[str, Any], defs: dict[str, Any]) -> list[str]:
    required = set(obj.get("required", []))
    rows = ["| Field | Type | Default | Description |", "| --- | --- | --- | --- |"]
    for name, prop in obj.get("properties", {}).items():
        field = _join(path, name)
        child = _object_of(prop, defs)
        suffix = "[]" if child is not None and _is_array(prop, defs) else ""
        shown = f"[`{field}`](#{_anchor(field + suffix)})" if child is not None else f"`{field}`"
        # pydantic leaves out a field's description when it repeats its model's docstring.
        description = prop.get("description") or (child or {}).get("description", "")
        rows.append(f"| {shown} | {_type(prop, defs)} | {_default(name, prop, required, defs)} "
                    f"| {_cell(_prose(description))} |")
    return rows


def _anchor(path: str) -> str:
    # GitHub's heading anchors: lower case, punctuation other than - and _ dropped.
    return "".join(c for c in path.lower() if c.isalnum() or c in "-_")


def _type(prop: dict[str, Any], defs: dict[str, Any]) -> str:
    prop = _resolve(prop, defs)
    if "anyOf" in prop:
        options = [o for o in prop["anyOf"] if o.get("type") != "null"]
        text = " or ".join(_type(o, defs) for o in options)
        return text + (" or null" if len(options) < len(prop["anyOf"]) else "")
    if "const" in prop:
        return f"`{json.dumps(prop['const'])}`"
    if "enum" in prop:
        return "one of " + ", ".join(f"`{v}`" for v in prop["enum"])
    kind = prop.get("type")
    if kind == "array":
        items = _type(prop.get("items", {}), defs)
        return ("non-empty " if prop.get("minItems", 0) >= 1 else "") + f"list of {items}"
    if kind == "object":
        return "object" if "properties" in prop else "mapping"
    if kind == "string":
        text = "non-empty string" if prop.get("minLength", 0) >= 1 else "string"
        if "pattern" in prop:
            text += f" matching `{prop['pattern']}`"
        return text
    names = {"integer": "integer", "number": "number", "boolean": "bool"}
    if kind in names:
        return names[kind] + _bounds(prop)
    return "any JSON value"


def _bounds(prop: dict[str, Any]) -> str:
    marks = [(key, sign) for key, sign in (("minimum", ">="), ("exclusiveMinimum", ">"),
                                           ("maximum", "<="), ("exclusiveMaximum", "<"))
             if key in prop]
    text = "".join(f" {sign} {prop[key]}" for key, sign in marks[:1])
    text += "".join(f", {sign} {prop[key]}" for key, sign in marks[1:])
    if "multipleOf" in prop:
        text += f", multiple of {prop['multipleOf']}"
    return text


def _default(name: str, prop: dict[str, Any], required: set[str],
             defs: dict[str, Any]) -> str:
    if name in required:
        return "required"
    if "default" not in prop:
        # A default built by a factory: an object of all-default fields, or an empty mapping.
        return "all defaults" if _object_of(prop, defs) is not None else "`{}`"
    value = prop["default"]
    if value is None:
        return "none"
    if value == "":
        return '`""`'
    return f"`{value if isinstance(value, str) else json.dumps(value)}`"


def _params_section() -> str:
    lines = ["## `faults[].params` by kind", "",
             "Each kind takes its own `params` (unknown keys are errors, with the field path "
             "`faults[i].params.KEY`). What each kind does and what recovery repairs: "
             "[the fault catalogue](faults.md)."]
    for spec in _kinds():
        notes = [_prose(spec.summary[:1].upper() + spec.summary[1:]) + "."]
        if spec.collective:
            notes.append("A link fault: it needs a peer (`engine.tensor_parallel_size >= 2`).")
        if spec.ends_process:
            notes.append("It ends a process: no recovery round runs; the engine is restarted "
                         "and every request resumed.")
        if not spec.implemented:
            notes.append("Not implemented yet: scenarios that use it are rejected.")
        lines += ["", f"### `{spec.kind}`", "", " ".join(notes), ""]
        schema = spec.params.model_json_schema()
        if not schema.get("properties"):
            lines.append("No params.")
            continue
        lines += _field_table("params", schema, schema.get("$defs", {}))
    return "\n".join(lines)


def _kinds() -> list[Any]:
    """The ``KindSpec`` of every registered fault kind, in ``FaultKind`` order."""
    from ftkit.kinds import KIND_SPECS

    return list(KIND_SPECS.values())


def _repo_path(path: Path) -> str:
    """``path`` (a file of the package) relative to the repository root, with slashes."""
    package_root = Path(published.__file__).resolve().parents[2]
    return path.resolve().relative_to(package_root).as_posix()


def _prose(text: str) -> str:
    """A docstring or description as Markdown: reST literals become code spans."""
    return " ".join(text.replace("``", "`").split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ftkit.scenario.reference",
                                 description="Print or rewrite the scenario reference page.")
    ap.add_argument("--write", action="store_true",
                    help=f"rewrite {PAGE} and the published schema file under --root "
                         "instead of printing the page")
    ap.add_argument("--root", type=Path, default=Path.cwd(),
                    help="the repository root (default: the current directory)")
    args = ap.parse_args(argv)
    if args.write:
        print(write(args.root))
        # The schema file is generated from the same models: one command keeps both in step.
        print(published.write(args.root / _repo_path(published.SCHEMA_FILE)))
    else:
        sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
