"""`harness preflight` on an inventory it cannot read: exit 2, the JSON report and the located error
(preflight on the namespace cluster: tests/integration/test_preflight.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main


def test_command_exit_2_for_a_bad_inventory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("hosts:\n  - name: Bad_Name\n    address: 10.250.0.9\n")
    assert main(["preflight", str(hosts), "--json"]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out)["ok"] is False
    assert f"harness: error: {hosts}:2:5: hosts[0]: host name must be a DNS-1123 label" in captured.err
