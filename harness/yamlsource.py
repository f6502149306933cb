"""YAML loading that remembers where every value came from.

Validation errors must name the file, line and column of the offending key, so the loader keeps a
map from key path to source position alongside the plain Python data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness.errors import Problem, SpecError

KeyPath = tuple[str | int, ...]


@dataclass(frozen=True)
class Mark:
    line: int
    column: int


@dataclass
class Document:
    """Parsed YAML plus the position of every mapping key and sequence item."""

    path: Path
    data: Any
    marks: dict[KeyPath, Mark] = field(default_factory=dict)

    def where(self, key_path: KeyPath) -> Mark | None:
        """Position of the deepest known prefix of key_path (a missing key points at its parent)."""
        for end in range(len(key_path), -1, -1):
            mark = self.marks.get(tuple(key_path[:end]))
            if mark is not None:
                return mark
        return None

    def problem(self, key_path: KeyPath, message: str) -> Problem:
        mark = self.where(key_path)
        return Problem(
            file=str(self.path),
            line=mark.line if mark else None,
            column=mark.column if mark else None,
            key_path=key_path,
            message=message,
        )


def _mark(node: yaml.Node) -> Mark:
    return Mark(node.start_mark.line + 1, node.start_mark.column + 1)


class _Builder:
    """Turns a composed node tree into plain data, recording key positions on the way."""

    def __init__(self, doc_path: Path) -> None:
        self.doc_path = doc_path
        self.marks: dict[KeyPath, Mark] = {}
        self._scalars = yaml.SafeLoader("")

    def build(self, node: yaml.Node, path: KeyPath) -> Any:
        self.marks.setdefault(path, _mark(node))
        if isinstance(node, yaml.MappingNode):
            result: dict[str | int, Any] = {}
            for key_node, value_node in node.value:
                key = self._scalars.construct_object(key_node, deep=True)
                if not isinstance(key, (str, int)) or isinstance(key, bool):
                    raise SpecError([self._problem(key_node, path, "mapping keys must be strings")])
                if key in result:
                    raise SpecError([self._problem(key_node, (*path, key), f"duplicate key {key!r}")])
                self.marks[(*path, key)] = _mark(key_node)
                result[key] = self.build(value_node, (*path, key))
            return result
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, (*path, index)) for index, item in enumerate(node.value)]
        return self._scalars.construct_object(node, deep=True)

    def _problem(self, node: yaml.Node, key_path: KeyPath, message: str) -> Problem:
        mark = _mark(node)
        return Problem(str(self.doc_path), mark.line, mark.column, key_path, message)


def load_document(path: str | Path) -> Document:
    """Read one YAML document; syntax errors become SpecError with the parser's position."""
    doc_path = Path(path)
    try:
        text = doc_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError([Problem(str(doc_path), None, None, (), "file not found")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError([Problem(str(doc_path), None, None, (), f"cannot read: {exc}")]) from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        line, column = (mark.line + 1, mark.column + 1) if mark else (None, None)
        raise SpecError([Problem(str(doc_path), line, column, (), f"invalid YAML: {exc.problem}")]) from None
    if root is None:
        raise SpecError([Problem(str(doc_path), None, None, (), "the file is empty; expected a mapping")])
    builder = _Builder(doc_path)
    data = builder.build(root, ())
    return Document(doc_path, data, builder.marks)
