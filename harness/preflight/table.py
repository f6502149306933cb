"""The preflight report: one row per host and check, as a table a human reads in seconds, or JSON."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from harness.node.probe import Facts


class Status(StrEnum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


@dataclass(frozen=True)
class Check:
    """One verdict about one host: a one-line reason, and for anything not passing, the fix."""

    host: str
    name: str
    status: Status
    reason: str
    fix: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "check": self.name, "status": self.status.value, "reason": self.reason,
                "fix": self.fix, "details": self.details}


@dataclass
class Report:
    """Everything preflight found. `fingerprint` maps host -> field -> value; `mismatched` the differing fields."""

    hosts: list[dict[str, Any]]
    checks: list[Check] = field(default_factory=list)
    facts: dict[str, Facts] = field(default_factory=dict)
    fingerprint: dict[str, dict[str, str]] = field(default_factory=dict)
    mismatched: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    job: dict[str, Any] | None = None
    interfaces: dict[str, str] = field(default_factory=dict)  # host -> the interface gloo and NCCL are pinned to
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status is Status.FAIL]

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "seconds": round(self.seconds, 2),
            "job": self.job,
            "hosts": self.hosts,
            "checks": [c.to_json() for c in self.checks],
            "fingerprint": {"hosts": self.fingerprint, "mismatched": self.mismatched},
            "interfaces": self.interfaces,
            "facts": self.facts,
            "notes": self.notes,
            "failures": [_summary(c) for c in self.failures],
        }

    def render_table(self) -> str:
        master = next((h for h in self.hosts if h["master"]), self.hosts[0])
        job = (f", job {self.job['name']} (backend {self.job['backend']}, master_port {self.job['master_port']})"
               if self.job else "")
        lines = [f"harness preflight: {len(self.hosts)} hosts, master {master['name']} ({master['address']})"
                 f"{job}, {self.seconds:.1f}s"]
        lines += _columns([("HOST", "CHECK", "STATUS", "DETAIL")]
                          + [(c.host, c.name, c.status.name, c.reason) for c in self.checks])
        if self.mismatched:
            names = list(self.fingerprint)
            lines += ["", "software differs across hosts:"]
            lines += _columns([("FIELD", *names)] + [(f, *(self.fingerprint[n].get(f, "?") for n in names))
                                                    for f in self.mismatched], indent="  ")
        lines += [f"note: {note}" for note in self.notes]
        warnings = sum(c.status is Status.WARN for c in self.checks)
        if self.ok:
            lines.append(f"PASSED: {len(self.checks)} checks, {warnings} warnings")
        else:
            lines.append(f"FAILED: {len(self.failures)} of {len(self.checks)} checks")
            lines += [f"  {_summary(c)}" for c in self.failures]
        return "\n".join(lines)


def _summary(check: Check) -> str:
    return f"{check.host} {check.name}: {check.reason}" + (f" -> fix: {check.fix}" if check.fix else "")


def _columns(rows: Sequence[tuple[str, ...]], indent: str = "") -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
            for row in rows]
