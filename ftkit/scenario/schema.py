"""The scenario format as a published JSON Schema file, for editors and outside tools.

``scenario.schema.json`` beside this module is generated from the scenario models and each
fault kind's params model, and ships in the package. ``tests/unit/test_schema.py`` fails when
the file and the models differ::

    python -m ftkit.scenario.schema --write      # rewrite ftkit/scenario/scenario.schema.json
    python -m ftkit.scenario.schema              # print it (as `ftkit schema` does)

What a caller may rely on:

* The schema is JSON Schema draft-07, the newest draft that the common YAML editor support
  (yaml-language-server, behind VS Code's YAML extension and others) implements fully.
* Its ``$id`` is ``urn:ftkit:scenario:<format version>``. It is a name, not an address: the
  project publishes no web site, and an ``https:`` id would promise a download that does not
  exist. Editors find the file through the path in a scenario's modeline instead.
* Every object forbids unknown keys, every field has a description, and a fault's ``params``
  are checked against the params model of the fault's ``kind``, as the loader checks them.
* It covers keys and types. The semantic rules (``ftkit.scenario.rules``: a rank exists, a
  token is computed ...) are not in it, and JSON cannot tell ``2.0`` from ``2``, which the
  loader rejects where an integer is expected: ``ftkit validate`` remains the full check.
* ``render()`` is a pure function of the models and ends with one newline; ``ftkit schema``
  prints the same text.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

#: The published file, inside the package.
SCHEMA_FILE = Path(__file__).with_name("scenario.schema.json")
#: The draft the schema is written in.
DRAFT = "http://json-schema.org/draft-07/schema#"
#: The command that rewrites the file (named in the file and in the test's message).
REGENERATE = "python -m ftkit.scenario.schema --write"
#: What the modeline of a scenario file starts with; the schema's path follows it.
MODELINE = "# yaml-language-server: $schema="

_REF_TEMPLATE = "#/definitions/{model}"


def schema_id() -> str:
    """The schema's ``$id``: a URN naming the scenario format and its version."""
    from ftkit.scenario.model import FORMAT_VERSION

    return f"urn:ftkit:scenario:{FORMAT_VERSION}"


def build() -> dict[str, Any]:
    """The JSON Schema of the scenario format, built from the models."""
    from ftkit.scenario.model import FORMAT_VERSION, Scenario

    generated = Scenario.model_json_schema(ref_template=_REF_TEMPLATE)
    definitions: dict[str, Any] = generated.pop("$defs")
    definitions["FaultSpec"].setdefault("allOf", []).extend(_params_by_kind(definitions))
    body = _wrap_refs(generated)
    return {
        "$schema": DRAFT,
        "$id": schema_id(),
        "title": f"ftkit scenario (format {FORMAT_VERSION})",
        "description": body.pop("description"),
        "$comment": f"Generated from ftkit's scenario models by `{REGENERATE}`; do not edit "
                    "by hand. It checks keys and types; `ftkit validate` also checks the "
                    "semantic rules.",
        **{key: value for key, value in body.items() if key != "title"},
        "definitions": _wrap_refs(definitions),
    }


def render() -> str:
    """The schema file's text."""
    return json.dumps(build(), indent=2) + "\n"


def write(path: Path = SCHEMA_FILE) -> Path:
    """Rewrite the schema file (by default the published one); return its path."""
    path.write_text(render())
    return path


def _params_by_kind(definitions: dict[str, Any]) -> list[dict[str, Any]]:
    """One ``if kind is K then params is K's model`` clause per fault kind; each params
    model joins ``definitions`` under its class name."""
    from ftkit.kinds import KIND_SPECS

    clauses = []
    for kind, spec in KIND_SPECS.items():
        name = spec.params.__name__
        model_schema = spec.params.model_json_schema(ref_template=_REF_TEMPLATE)
        for def_name, definition in {**model_schema.pop("$defs", {}), name: model_schema}.items():
            if definitions.setdefault(def_name, definition) != definition:
                raise RuntimeError(f"two schema definitions are named {def_name}")
        clauses.append({
            "if": {"properties": {"kind": {"const": kind.value}}, "required": ["kind"]},
            "then": {"properties": {"params": {"$ref": _REF_TEMPLATE.format(model=name)}}},
        })
    return clauses


def _wrap_refs(node: Any) -> Any:
    """``node`` with every ``$ref`` that has sibling keys moved into an ``allOf``.

    Pydantic puts a field's description and default beside its ``$ref``; draft-07 ignores
    everything beside a ``$ref``, so editors would lose the description.
    """
    if isinstance(node, list):
        return [_wrap_refs(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _wrap_refs(value) for key, value in node.items()}
    if "$ref" in node and len(node) > 1:
        ref = node.pop("$ref")
        node = {"allOf": [{"$ref": ref}], **node}
    return node


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ftkit.scenario.schema",
                                 description="Print or rewrite the scenario JSON Schema file.")
    ap.add_argument("--write", action="store_true",
                    help=f"rewrite {SCHEMA_FILE.name} in the package instead of printing it")
    args = ap.parse_args(argv)
    if args.write:
        print(write())
    else:
        sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
