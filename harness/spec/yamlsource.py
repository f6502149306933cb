"""YAML loading that remembers where every value came from.

Validation errors must name the file, line and column of the offending key, so the loader keeps a
map from key path to source position alongside the plain Python data.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness.errors import Problem, SpecError, short_repr

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


MAX_BYTES = 1 << 20  # a job spec or inventory is a few KB; a bound keeps hostile input bounded
MAX_VALUES = 100_000  # after aliases are expanded: an alias bomb stops here, not at the memory limit
MAX_DEPTH = 32
_TOO_DEEP = f"nested more than {MAX_DEPTH} levels deep (the limit is {MAX_DEPTH}; a job spec or inventory needs a few)"
# What a path may be instead of a regular file: each can block open() or read() forever, or never end.
_NOT_REGULAR = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
_NULL = {"", "~", "null", "Null", "NULL"}
_BOOL = {"true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False}
# YAML 1.2 core schema numbers. YAML 1.1's octal 0123, base-60 12:30, 1_000 and dates are not
# numbers here: they stay the text the user wrote.
_INT = re.compile(r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+")
_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)")
_STR_TAG = "tag:yaml.org,2002:str"
# With no implicit resolvers, an untagged node has its kind's default tag; anything else was written.
_UNTAGGED = {yaml.ScalarNode: _STR_TAG, yaml.SequenceNode: "tag:yaml.org,2002:seq",
             yaml.MappingNode: "tag:yaml.org,2002:map"}


class YamlInt(int):
    """An integer that remembers how it was written: `0123` is text where a string is expected, and a
    leading zero is refused where a number is (YAML 1.1 readers take it for octal)."""

    text: str

    def __new__(cls, text: str) -> YamlInt:
        value = int(text, 0) if text[:2] in ("0o", "0x") else int(text)
        number = super().__new__(cls, value)
        number.text = text
        return number

    @property
    def leading_zero(self) -> bool:
        digits = self.text.lstrip("+-")
        return len(digits) > 1 and digits[0] == "0" and digits[1].isdigit()


class YamlFloat(float):
    """A float that remembers how it was written (`1.10` stays `1.10` where a string is expected)."""

    text: str

    def __new__(cls, text: str) -> YamlFloat:
        special = text.lstrip("+-").lower() in (".inf", ".nan")  # float() reads them without the dot
        number = super().__new__(cls, float(text.replace(".", "", 1) if special else text))
        number.text = text
        return number


def source_text(value: object) -> str | None:
    """What the user wrote for a scalar: the exact text of a number, the string itself; else None."""
    if isinstance(value, (YamlInt, YamlFloat)):
        return value.text
    return value if isinstance(value, str) else None


def as_written(value: object) -> str:
    """A value for a message: numbers exactly as typed, anything else as a repr cut to size."""
    return value.text if isinstance(value, (YamlInt, YamlFloat)) else short_repr(value)


def _plain_scalar(text: str) -> Any:
    if text in _NULL:
        return None
    if text in _BOOL:
        return _BOOL[text]
    if _INT.fullmatch(text):
        try:
            return YamlInt(text)
        except ValueError:  # more digits than int() reads (4300): text, which a number's key refuses
            return text
    if _FLOAT.fullmatch(text):
        return YamlFloat(text)
    return text


class _TooDeep(yaml.MarkedYAMLError):
    """Nesting past MAX_DEPTH, at the node where it begins."""


class _Loader(yaml.SafeLoader):
    """Composes nodes without resolving any scalar: every untagged scalar is text until _Builder types it.
    Nesting is bounded as it is composed: PyYAML composes each level in a recursive call, so a few
    hundred levels would end in a RecursionError that knows no position."""

    yaml_implicit_resolvers: dict[Any, Any] = {}  # noqa: RUF012 - PyYAML's own class-level table, replaced
    depth = 0  # the nodes around the one composed next: the length of its key path

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.depth > MAX_DEPTH:
            raise _TooDeep(problem_mark=self.peek_event().start_mark)
        self.depth += 1
        node = super().compose_node(parent, index)
        self.depth -= 1
        return node


def _mark(node: yaml.Node) -> Mark:
    return Mark(node.start_mark.line + 1, node.start_mark.column + 1)


class _Builder:
    """Turns a composed node tree into plain data, recording key positions on the way."""

    def __init__(self, doc_path: Path) -> None:
        self.doc_path = doc_path
        self.marks: dict[KeyPath, Mark] = {}
        self.values = 0

    def build(self, node: yaml.Node, path: KeyPath) -> Any:
        self.values += 1
        if self.values > MAX_VALUES:
            raise SpecError([self._problem(node, path, f"more than {MAX_VALUES} values once anchors and aliases "
                                                       f"are expanded; write the values out")])
        if len(path) > MAX_DEPTH:
            raise SpecError([self._problem(node, path, _TOO_DEEP)])  # aliases nest what they name deeper
        self.marks.setdefault(path, _mark(node))
        if node.tag != _UNTAGGED[type(node)]:
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            raise SpecError([self._problem(node, path, f"YAML tag {short_repr(tag)} is not supported; "
                                                       f"write a plain value (quote it for a string)")])
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, path)
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, (*path, index)) for index, item in enumerate(node.value)]
        assert isinstance(node, yaml.ScalarNode)
        return _plain_scalar(node.value) if node.style is None else node.value

    def _mapping(self, node: yaml.MappingNode, path: KeyPath) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != _STR_TAG:
                raise SpecError([self._problem(key_node, path, "mapping keys must be plain strings")])
            key = key_node.value
            if key == "<<" and key_node.style is None:
                raise SpecError([self._problem(key_node, path, "YAML merge keys (<<) are not supported; "
                                                               "write the keys out")])
            if key in result:
                raise SpecError([self._problem(key_node, (*path, key), f"duplicate key {short_repr(key)}")])
            self.marks[(*path, key)] = _mark(key_node)
            result[key] = self.build(value_node, (*path, key))
        return result

    def _problem(self, node: yaml.Node, key_path: KeyPath, message: str) -> Problem:
        mark = _mark(node)
        return Problem(str(self.doc_path), mark.line, mark.column, key_path, message)


def _decode(doc_path: Path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise SpecError([Problem(str(doc_path), line, column, (),
                                 f"not UTF-8 text (byte 0x{raw[exc.start]:02x}); save the file as UTF-8")]) from None


def located(path: str | Path | None, key_path: KeyPath, message: str) -> SpecError:
    """An error about a value of a file that was already validated, at the value's line and column."""
    if path is None:
        return SpecError([Problem("<job>", None, None, key_path, message)])
    try:
        return SpecError([load_document(path).problem(key_path, message)])
    except SpecError:  # the file changed meanwhile: the key path still says where
        return SpecError([Problem(str(path), None, None, key_path, message)])


def not_regular(mode: int) -> str | None:
    """What a file of this st_mode is when it is not a regular file ('a FIFO (named pipe)'), else None."""
    return next((kind for test, kind in _NOT_REGULAR if test(mode)), None)


def _regular(doc_path: Path, mode: int) -> None:
    """Refuse what is not a regular file, saying what it is instead."""
    if (kind := not_regular(mode)) is not None:
        raise SpecError([Problem(str(doc_path), None, None, (), f"is {kind}, not a regular file; a job spec or "
                                                                f"inventory is a YAML file")])


def _read(doc_path: Path) -> bytes:
    """The first MAX_BYTES + 1 bytes of a regular file. Anything else is refused before it is opened: a FIFO
    without a writer blocks open() forever, a device or socket may never end. O_NONBLOCK, and the check again
    on the open file, keep a file swapped for a FIFO meanwhile from blocking either."""
    _regular(doc_path, doc_path.stat().st_mode)
    with open(os.open(doc_path, os.O_RDONLY | os.O_NONBLOCK), "rb") as handle:
        _regular(doc_path, os.fstat(handle.fileno()).st_mode)
        return handle.read(MAX_BYTES + 1)


def load_document(path: str | Path) -> Document:
    """Read one YAML document; syntax errors become SpecError with the parser's position."""
    doc_path = Path(path)
    try:
        raw = _read(doc_path)
    except FileNotFoundError:
        raise SpecError([Problem(str(doc_path), None, None, (), "file not found")]) from None
    except OSError as exc:
        raise SpecError([Problem(str(doc_path), None, None, (), f"cannot read: {exc.strerror}")]) from None
    if len(raw) > MAX_BYTES:
        raise SpecError([Problem(str(doc_path), None, None, (), f"larger than {MAX_BYTES} bytes; a job spec or "
                                                                f"inventory is a few kilobytes")])
    text = _decode(doc_path, raw)
    if "\0" in text:
        nul_line = text.count("\n", 0, text.index("\0")) + 1
        raise SpecError([Problem(str(doc_path), nul_line, None, (), "contains a NUL byte; this is not a text file")])
    try:
        root = yaml.compose(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        line: int | None = mark.line + 1 if mark else None
        column: int | None = mark.column + 1 if mark else None
        message = _TOO_DEEP if isinstance(exc, _TooDeep) else f"invalid YAML: {exc.problem}"
        raise SpecError([Problem(str(doc_path), line, column, (), message)]) from None
    except yaml.YAMLError as exc:
        raise SpecError([Problem(str(doc_path), None, None, (), f"invalid YAML: {exc}")]) from None
    if root is None:
        raise SpecError([Problem(str(doc_path), None, None, (), "the file is empty; expected a mapping")])
    builder = _Builder(doc_path)
    data = builder.build(root, ())
    return Document(doc_path, data, builder.marks)
