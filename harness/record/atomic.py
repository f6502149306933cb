"""Writing a file so that no reader (another terminal, kubectl, a node) ever sees half of it, and a
failure loses nothing: the run record, manifests, a saved job spec."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_UMASK = os.umask(0o022)  # read once (os.umask can only be read by setting it), then put back
os.umask(_UMASK)


def write_text_atomic(path: Path, text: str) -> None:
    """Readers (another terminal, kubectl) never see a half-written file, and a failure loses nothing."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp's 0600 would keep others from reading manifests and records
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
