"""`harness preflight`: prove before launch that every host can run the job.

Exports run_preflight, preflight_command, Report, Check and Status, imported on first use: this
file must stay import-free so that `python -m harness.node.allreduce` runs on hosts that have
torch but not paramiko.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "run_preflight": "harness.preflight.runner",
    "preflight_command": "harness.preflight.command",
    "Report": "harness.preflight.report",
    "Check": "harness.preflight.report",
    "Status": "harness.preflight.report",
}
__all__ = ["Check", "Report", "Status", "preflight_command", "run_preflight"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'harness.preflight' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
