"""`harness prepare` exits 1 when the download, its checksum or the disk fails (the same command may work
later or with a mirror), 2 only for bad usage, and its help names the command the user typed. It runs with the
stand-in torch first on its path (PREPARE_ENV): it imports torch (harness.payload.data, for training) but uses none
of it to download, check and unpack, and a real import would be most of each command's cost here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, STANDIN_ENV, free_port, harness

PREPARE_ENV = os.environ | STANDIN_ENV


def test_a_refused_download_exits_1_saying_what_to_do(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/cifar-10-python.tar.gz"  # nothing listens there: refused at once
    result = harness("prepare", "--data-dir", str(tmp_path / "data"), "--url", url, env=PREPARE_ENV)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith(f"harness prepare: error: could not download {url} (<urlopen error [Errno 111] "
                                    f"Connection refused>); fetch it by hand into "
                                    f"{tmp_path / 'data' / 'cifar-10-python.tar.gz'}, or name a mirror with --url, "
                                    "and run prepare again"), result.stderr
    assert list((tmp_path / "data").iterdir()) == []  # no partial download left behind


def test_a_checksum_mismatch_exits_1(tmp_path: Path) -> None:
    mirror = tmp_path / "not-cifar.tar.gz"
    mirror.write_bytes(b"not the archive")
    result = harness("prepare", "--data-dir", str(tmp_path / "data"), "--url", mirror.as_uri(), env=PREPARE_ENV)
    assert result.returncode == 1, result.stderr
    assert f"harness prepare: error: {mirror.as_uri()}: md5 " in result.stderr
    assert "does not match the expected c58f30108f718f92721af3b95e74349a" in result.stderr


def test_a_data_dir_that_cannot_be_made_exits_1(tmp_path: Path) -> None:
    result = harness("prepare", "--data-dir", "/proc/no-such-dir/data", env=PREPARE_ENV)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("harness prepare: error: could not prepare CIFAR-10 in /proc/no-such-dir/data")


@pytest.mark.parametrize(("argv", "said"), [
    ([], "the following arguments are required: --data-dir"),
    (["--data-dir", "d", "--mirror", "x"], "unrecognized arguments: --mirror x"),
    (["--data-dir", "d", "--url", "cifar.tar.gz"], "--url 'cifar.tar.gz': expected a URL starting with http://, "
                                                   "https://, ftp://, file://"),
    (["--data-dir", "job.yaml"], "--data-dir job.yaml is a file, expected a directory"),
])
def test_bad_usage_exits_2(argv: list[str], said: str, tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text("name: x\n")
    result = harness("prepare", *argv, cwd=tmp_path, env=PREPARE_ENV)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("usage: harness prepare ") and f"harness prepare: error: {said}" in result.stderr
    assert not (tmp_path / "d").exists()


def test_help_names_the_command_the_user_ran_and_every_flag() -> None:
    shown = harness("prepare", "--help", env=PREPARE_ENV)
    assert shown.returncode == 0 and shown.stdout.startswith("usage: harness prepare [-h] --data-dir DIR [--url URL]")
    assert all(flag in shown.stdout for flag in ("--data-dir DIR  where the data goes", "--url URL", "Exit status:"))
    alone = subprocess.run([sys.executable, "-m", "harness.payload.prepare", "--help"], cwd=REPO, capture_output=True,
                           text=True, timeout=60, env=PREPARE_ENV)
    assert alone.returncode == 0 and alone.stdout.startswith("usage: harness.payload.prepare [-h] --data-dir DIR")
