"""Writing a file so that no reader (another terminal, kubectl, a node) ever sees half of it, and a
failure loses nothing: the run record, manifests, a saved job spec; and the record's folders, made with the
permissions asked for whatever the umask."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

UMASK = os.umask(0o022)  # read once (os.umask can only be read by setting it), then put back
os.umask(UMASK)


def file_mode(folder: Path) -> int:
    """The permissions of a record's files: its folder's, without execute (0600 in a private one)."""
    try:
        return folder.stat().st_mode & 0o666
    except OSError:
        return 0o600


def folder_mode(folder: Path) -> int:
    """The permissions of the folders in a record's folder: its own (0700 in a private one)."""
    try:
        return folder.stat().st_mode & 0o777
    except OSError:
        return 0o700


def make_folders(path: Path, mode: int) -> None:
    """path and each missing folder above it, each with exactly mode: mkdir's mode is the umask's to cut, so a umask
    of 002 or 000 would leave them open to the group or to everyone. One that exists is left as it is."""
    missing = [folder for folder in [path, *path.parents] if not folder.exists()]
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=mode)
        except FileExistsError:  # made meanwhile (another launch): theirs as it is
            continue
        os.chmod(folder, mode)


def write_text_atomic(path: Path, text: str, mode: int | None = None) -> None:
    """Readers (another terminal, kubectl) never see a half-written file, and a failure loses nothing. mode: the
    file's permissions (None: what the umask gives a new file: a manifest, a saved spec, for others to read too)."""
    write_bytes_atomic(path, text.encode(), mode)


def write_bytes_atomic(path: Path, data: bytes, mode: int | None = None) -> None:
    """As write_text_atomic. Safe in a folder others can write (the job's volume): the partial file gets a fresh
    random name, created exclusively (a link planted there is never followed), and the rename replaces whatever
    is at path, a link too, without following it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o666 & ~UMASK if mode is None else mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
