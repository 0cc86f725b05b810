"""Read YAML into plain data while remembering the line of every key and item.

PyYAML's ``safe_load`` throws the node marks away, so this composes the node tree and
builds the data itself: mappings become dicts, sequences lists, scalars whatever the safe
constructor makes of them (YAML 1.1 rules: ``yes`` is a bool, ``2024-01-01`` a date; the
strict models then reject what does not fit). Merge keys (``<<``) and aliases work.

What a caller may rely on: ``read_yaml`` raises ``ScenarioErrors`` for text that is not
YAML; otherwise it returns a ``Document`` whose ``problems`` list the structural errors
that YAML allows but a scenario does not (duplicate keys, keys that are neither strings nor
integers), each with its line, and whose ``line_of(loc)`` gives the line of any loc or of its
nearest written parent. Integer keys are kept for the models to judge (``logit_bias`` takes
token ids); the models reject them everywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from ftkit.errors import ScenarioError
from ftkit.scenario.errors import Loc, ScenarioErrors, format_loc

_MAP_TAG = "tag:yaml.org,2002:map"
_SEQ_TAG = "tag:yaml.org,2002:seq"
_MERGE_TAG = "tag:yaml.org,2002:merge"


@dataclass
class Document:
    """YAML data plus the 1-based line of each key (for mapping entries) or item."""

    file: str
    data: Any
    lines: dict[Loc, int] = field(default_factory=dict)
    problems: list[ScenarioError] = field(default_factory=list)

    def line_of(self, loc: Loc) -> int | None:
        """The line of ``loc``, or of its nearest ancestor written in the file."""
        while loc not in self.lines and loc:
            loc = loc[:-1]
        return self.lines.get(loc)

    def error(self, message: str, loc: Loc) -> ScenarioError:
        return ScenarioError(message, file=self.file, line=self.line_of(loc),
                             field=format_loc(loc) or None)


def read_yaml(text: str, file: str) -> Document:
    """Parse one YAML document; an empty one gives ``data=None``."""
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        doc = Document(file=file, data=None)
        if root is not None:
            doc.lines[()] = root.start_mark.line + 1
            doc.data = _Builder(loader, doc).build(root, ())
        return doc
    except yaml.MarkedYAMLError as exc:
        raise ScenarioErrors([_syntax_error(exc, file)]) from None
    except yaml.YAMLError as exc:
        raise ScenarioErrors([ScenarioError(f"invalid YAML: {exc}", file=file)]) from None
    finally:
        loader.dispose()


def _syntax_error(exc: yaml.MarkedYAMLError, file: str) -> ScenarioError:
    mark = exc.problem_mark or exc.context_mark
    message = exc.problem or "invalid YAML"
    if exc.context:
        # "while parsing a flow mapping" starts earlier than the problem: show where.
        started = exc.context_mark
        moved = started is not None and mark is not None and started.line != mark.line
        where = f" (line {started.line + 1})" if moved else ""
        message = f"{exc.context}{where}: {message}"
    return ScenarioError(f"invalid YAML: {message}", file=file,
                         line=mark.line + 1 if mark else None)


class _Builder:
    def __init__(self, loader: yaml.SafeLoader, doc: Document) -> None:
        self._loader = loader
        self._doc = doc
        self._active: set[int] = set()  # nodes being built: an alias back to one is a cycle
        self._flattened: set[int] = set()

    def build(self, node: Node, loc: Loc) -> Any:
        if id(node) in self._active:
            self._problem("an alias refers to a node that contains it", loc, node)
            return None
        self._active.add(id(node))
        try:
            if isinstance(node, MappingNode):
                return self._mapping(node, loc)
            if isinstance(node, SequenceNode):
                return self._sequence(node, loc)
            return self._loader.construct_object(node, deep=True)
        finally:
            self._active.discard(id(node))

    def _mapping(self, node: MappingNode, loc: Loc) -> dict[Any, Any]:
        if node.tag != _MAP_TAG:
            self._problem(f"unsupported tag {node.tag} on a mapping", loc, node)
        if id(node) not in self._flattened:
            self._check_duplicates(node, loc)
            # Merged entries come first and the node's own override them, as in PyYAML.
            self._loader.flatten_mapping(node)
            self._flattened.add(id(node))
        result: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = self._key(key_node, loc)
            if key is None:
                continue
            self._doc.lines[loc + (key,)] = key_node.start_mark.line + 1
            result[key] = self.build(value_node, loc + (key,))
        return result

    def _sequence(self, node: SequenceNode, loc: Loc) -> list[Any]:
        if node.tag != _SEQ_TAG:
            self._problem(f"unsupported tag {node.tag} on a sequence", loc, node)
        items = []
        for index, item in enumerate(node.value):
            self._doc.lines[loc + (index,)] = item.start_mark.line + 1
            items.append(self.build(item, loc + (index,)))
        return items

    def _key(self, key_node: Node, loc: Loc) -> str | int | None:
        key = self._loader.construct_object(key_node, deep=True) \
            if isinstance(key_node, ScalarNode) else key_node
        # Integers are left to the models: token ids key `logit_bias`, as in the OpenAI API.
        if isinstance(key, str) or (isinstance(key, int) and not isinstance(key, bool)):
            return key
        # YAML 1.1 reads unquoted on/off/yes/no/1.5 as bools and numbers: say so.
        shown = key_node.value if isinstance(key_node, ScalarNode) else "a collection"
        self._problem(f"key {shown!r} is not a string (quote it)", loc, key_node)
        return None

    def _check_duplicates(self, node: MappingNode, loc: Loc) -> None:
        first_line: dict[str | int, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG or not isinstance(key_node, ScalarNode):
                continue
            key = self._loader.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                continue
            line = key_node.start_mark.line + 1
            if key in first_line:
                self._problem(f"duplicate key '{key}' (first given on line {first_line[key]})",
                              loc + (key,), key_node)
            else:
                first_line[key] = line

    def _problem(self, message: str, loc: Loc, node: Node) -> None:
        self._doc.problems.append(ScenarioError(message, file=self._doc.file,
                                                line=node.start_mark.line + 1,
                                                field=format_loc(loc) or None))
