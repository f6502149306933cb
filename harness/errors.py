"""Errors that carry their source position, so every bad input is reported where it is."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an input file: where, which key, and what was expected."""

    file: str
    line: int | None
    column: int | None
    key_path: tuple[str | int, ...]
    message: str

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}:{self.column}"
        key = format_key_path(self.key_path)
        return f"{where}: {key}: {self.message}" if key else f"{where}: {self.message}"


def short_repr(value: object, limit: int = 60) -> str:
    """repr for a message, cut so that a hostile megabyte is never echoed back whole."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def format_key_path(key_path: tuple[str | int, ...]) -> str:
    """`hosts[1].address` style, the way users read YAML."""
    text = ""
    for part in key_path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


class HarnessError(Exception):
    """An error the CLI reports in one message and maps to an exit status."""

    exit_code = 1


class SpecError(HarnessError):
    """Bad job spec or inventory (exit status 2): one or more located problems."""

    exit_code = 2

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


class UsageError(HarnessError):
    """Bad command-line use or a request that cannot be planned (exit status 2)."""

    exit_code = 2
