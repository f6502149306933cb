"""What every rank of a function launch runs (`python -m harness.api.rank`, under torchrun as any script): the
caller's function and arguments, called once; what it returned, or what it raised, left for the node's agent to send
back (harness.api.function makes the other end).

The function and its arguments come pickled (cloudpickle) in the rank's environment, HARNESS_CALL_0, _1, ...: the
job's secrets, which travel on the agent's standard input and are written in no file of the run and on no command
line (harness/spec/secrets.py). The rank's result goes, pickled, into its node agent's private directory (0700), which
the agent sends to the controller as RESULT messages when the node ends (harness.node.protocol). The node needs the
caller's Python (its major.minor: pickled code is tied to it), cloudpickle and the modules the function imports.
"""

from __future__ import annotations

import base64
import linecache
import os
import sys
import traceback
from typing import Any

from harness.node.protocol import RESULTS_FOLDER

CALL_VARIABLE = "HARNESS_CALL_"  # HARNESS_CALL_0, HARNESS_CALL_1, ...: the pickled call's base64, in pieces
MAX_RESULT_BYTES = 16 << 20  # a rank's pickled result at most: it travels back as protocol messages


def python_tag() -> bytes:
    """The first line of a pickled call: the Python that pickled it (major.minor)."""
    return f"{sys.version_info[0]}.{sys.version_info[1]}\n".encode()


def take_call(environ: dict[str, str] | os._Environ[str]) -> bytes:
    """The pickled call, its variables taken out of environ (the function's own subprocesses do not carry them)."""
    pieces: list[str] = []
    while f"{CALL_VARIABLE}{len(pieces)}" in environ:
        pieces.append(environ.pop(f"{CALL_VARIABLE}{len(pieces)}"))
    if not pieces:
        raise SystemExit(f"harness: {CALL_VARIABLE}0 is not set: harness.api.rank runs the function of "
                         "`harness.launch(fn, ...)`, which sets it")
    return base64.b64decode("".join(pieces))


def main() -> int:
    import cloudpickle

    rank = os.environ.get("RANK", "0")
    tag, _, pickled = take_call(os.environ).partition(b"\n")
    if tag + b"\n" != python_tag():
        print(f"harness: rank {rank} runs Python {python_tag().decode().strip()}, the caller {tag.decode()}: a "
              "function launch needs the caller's Python (major.minor) on every node", file=sys.stderr, flush=True)
        return 1
    function, args, kwargs, sources = cloudpickle.loads(pickled)
    linecache.cache.update(sources)  # a notebook's cells: its tracebacks show their lines
    try:
        value = function(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are a rank's end too
        if isinstance(exc, SystemExit) and exc.code in (None, 0):
            _leave(rank, ("returned", None))
            return 0
        # The rank's traceback from the function's frame on: this module's is no part of the caller's program.
        shown = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next))  # type: ignore[union-attr]
        print(shown, end="", file=sys.stderr, flush=True)
        _leave(rank, ("raised", type(exc).__qualname__, str(exc), shown, _pickled_or_none(exc)))
        return exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
    sys.stdout.flush()
    _leave(rank, ("returned", value))
    return 0


def _pickled_or_none(exc: BaseException) -> bytes | None:
    import cloudpickle

    try:
        return bytes(cloudpickle.dumps(exc))
    except Exception:  # noqa: BLE001 - the exception's text still goes back
        return None


def _leave(rank: str, result: tuple[Any, ...]) -> None:
    """result pickled into the agent's results folder, whole or not at all (the agent may read it at any time)."""
    import cloudpickle

    try:
        data = cloudpickle.dumps(result)
    except Exception as exc:  # noqa: BLE001 - any value: what cannot be pickled is said, not raised
        data = cloudpickle.dumps(("unpicklable", f"{type(exc).__name__}: {exc}"))
    if len(data) > MAX_RESULT_BYTES:
        data = cloudpickle.dumps(("unpicklable", f"it pickles to {len(data) >> 20} MiB, more than the "
                                                 f"{MAX_RESULT_BYTES >> 20} MiB that come back: save it to a file and "
                                                 "return the file's path"))
    agent = os.environ.get("HARNESS_AGENT_DIR")
    if not agent:
        print(f"harness: rank {rank}'s result cannot go back: its node agent has no directory (HARNESS_AGENT_DIR)",
              file=sys.stderr, flush=True)
        return
    folder = os.path.join(agent, RESULTS_FOLDER)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    partial = os.path.join(folder, f".{rank}.{os.getpid()}")
    with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
        out.write(data)
    os.replace(partial, os.path.join(folder, rank))


if __name__ == "__main__":
    sys.exit(main())
