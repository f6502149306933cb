"""What a node's output says, in the user's terms. Pure: lines in, facts out.

torchrun tees each worker's lines with `[rankN]: ` (plan.LOG_LINE_PREFIX); torch adds the same prefix
to an uncaught exception once the process joined a process group, hence `[rank0]: [rank0]: ...`.
Lines without the prefix come from torchrun itself (or the node's setup). With TORCH_CPP_LOG_LEVEL=INFO
(plan.STORE_WATCH_ENV) each process that connects to the rendezvous store says so: that is how a run
is known to have been distributed without touching the user's script.
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterable, Iterator, Sequence
from dataclasses import dataclass

from harness.node.protocol import each_ranks

RANK_PREFIX = re.compile(r"^\[rank(\d+)\]: ")
# torch's own prefix follows torchrun's with a blank (Python tracebacks) or without (C++ log lines).
DOUBLED_PREFIX = re.compile(r"^(\[rank(\d+)\]: )(\[rank\2\]: ?)+")
# glog's INFO format, which torch's C++ logging uses: `[I1123 04:19:10.615279659 socket.cpp:955] ...`
CPP_INFO = re.compile(r"^(\[rank\d+\]: )?\[I\d{4} \d\d:\d\d:\d\d\.\d+ [\w.]+:\d+\] ")
# torch's worker server, started in every rank by the harness's rank hook (harness.node.rank_hook), says at
# WARNING level that it listens on the agent's socket, and at the rank's end (its destructor) that it shuts down:
# the harness's own doing, never the job's, so left out of the stream and the tail whatever the log level. (A
# progress bar's carriage return before it on the same line makes two lines of the stream: LiveNode.take_block.)
RANK_HOOK_SERVER = re.compile(r"^(\[rank\d+\]: ?)?\[W\d{4} [^]]*WorkerServer\.cpp:\d+\] \[c10d\] (Server listening "
                              r"to UNIX \S*/harness-agent-\S*|WorkerServer destructor called without shutdown|Server "
                              r"shutting down|Server exited)$")
# The store names each client it accepts by a reverse lookup of its address; where no name server answers (the
# simulated nodes' own network, targets/local/private_net.py; hosts without reverse DNS) torch warns at every
# connection: never the job's words, and in the job's own network the harness's doing.
UNNAMED_STORE_CLIENT = re.compile(r"^(\[rank\d+\]: ?)?\[W\d{4} [^]]*socket\.cpp:\d+\] \[c10d\] The hostname of the "
                                  r"client socket cannot be retrieved\. err=-3$")
# torchrun's own C++ log lines (no rank prefix: its agent's store client and rendezvous), and the exception
# dumps that follow one: `Exception raised from ...`, `frame #N: ...`, `<omitting python frames>`, a blank.
AGENT_CPP_LOG = re.compile(r"^\[[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ [\w.]+:\d+\] ")
RANK_CPP_LOG = re.compile(r"^\[rank\d+\]: ?\[[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ [\w.]+:\d+\] ")  # torch's C++ logging
CPP_DUMP = re.compile(r"^(Exception raised from .*|frame #\d+: .*|<omitting python frames>|\s*)$")
STORE_CONNECTED = re.compile(r"^\[rank(\d+)\]: \[I\d{4} [^]]*socket\.cpp:\d+\] \[c10d\] The client socket has "
                             r"connected")
# torchrun's own failure report begins with its elastic agent's error or warning log line.
TORCHRUN_REPORT = re.compile(r"^[EW]\d{4} \d\d:\d\d:\d\d\.\d+ \d+ \S*torch/distributed/elastic/")
# A C++ exception nothing caught (gloo's enforce, in its own threads): std::terminate's two lines.
CPP_TERMINATE = re.compile(r"^terminate called after throwing an instance of '(?P<type>[^']+)'$")
CPP_WHAT = re.compile(r"^\s*what\(\):\s*(?P<what>.*)$")
WHAT_WITHIN = 8  # lines after the terminate line its what() line may come, the worker's stdout between
# An exception that only says a peer went away: the rank failed because another one did (control/cascade.py).
AFTER_A_PEER = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|remote worker crash|remote process exited|"
    r"NCCL communicator was aborted|[Ww]atchdog caught collective operation timeout|DistNetworkError|"
    r"DistBackendError|recvBytes|sendBytes|failed to recv|Failed to recv|The client socket has failed|"
    r"Socket Timeout|Application timeout caused pair closure|Socket closed"
)
FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>.+)$')
# Where the standard library and installed packages live: not the user's code.
NOT_USER_CODE = re.compile(r"^<|/site-packages/|/dist-packages/|/lib/python\d\.\d+/")
NO_CUDA = re.compile(
    r"Found no NVIDIA driver|requires at least one CUDA device|no GPUs found|No CUDA GPUs are available|"
    r"Torch not compiled with CUDA enabled|CUDA driver initialization failed|NCCL built in|"
    r"Attempting to deserialize object on a CUDA device but torch\.cuda\.is_available\(\) is False"
)
NO_CUDA_HINT = ("the script asks for CUDA and this machine has none; the job's `backend:` does not change a "
                "backend or device the script hard-codes: run it on GPU hosts, or let the script choose gloo and "
                "the CPU when CUDA is missing (torch.cuda.is_available(), or HARNESS_BACKEND)")

# What a rank that reaches for another host says when there is no route: e.g. a download, a logging service.
NO_NETWORK = re.compile(r"Temporary failure in name resolution|Network is unreachable|\[Errno 101\]|"
                        r"Name or service not known|No route to host")
NO_NETWORK_HINT = ("a rank could not reach another host: simulated nodes run in a network of their own, which reaches "
                   "no other host (simulated.network: private keeps the job's store from the machine's other users); "
                   "fetch what the job downloads in its `setup:` (which runs in this machine's network), or set "
                   "simulated: {network: host} (its store is then open to every user of this machine); on hosts, check "
                   "their DNS and routes")


def normalize(line: str) -> str:
    """One rank prefix, however many torch and torchrun added."""
    return DOUBLED_PREFIX.sub(r"\1", line, count=1)


def rank_of(line: str) -> int | None:
    match = RANK_PREFIX.match(line)
    return int(match.group(1)) if match else None


def is_cpp_info(line: str) -> bool:
    """A line of torch's C++ logging at INFO level."""
    return CPP_INFO.match(line) is not None


def is_harness_doing(line: str) -> bool:
    """A line torch says of what the harness did, never of the job: the worker server the harness's rank hook
    started in the rank, and the store's clients unnamed in the job's own network."""
    return RANK_HOOK_SERVER.match(line) is not None or UNNAMED_STORE_CLIENT.match(line) is not None


def is_agent_cpp_log(line: str) -> bool:
    return AGENT_CPP_LOG.match(line) is not None


def is_rank_cpp_log(line: str) -> bool:
    """A line of torch's C++ logging in a rank (a warning, an error: after a peer's failure, its consequences)."""
    return RANK_CPP_LOG.match(line) is not None


def continues_cpp_dump(line: str) -> bool:
    return CPP_DUMP.match(line) is not None


def after_a_peer(exception: str) -> bool:
    """Whether a rank's exception line says it failed because a peer did."""
    return AFTER_A_PEER.search(exception) is not None


def joined_rank(line: str) -> int | None:
    """The rank whose process connected to the rendezvous store (init_process_group), if line says so."""
    match = STORE_CONNECTED.match(line)
    return int(match.group(1)) if match else None


def starts_torchrun_report(line: str) -> bool:
    return TORCHRUN_REPORT.match(line) is not None


@dataclass(frozen=True)
class UserError:
    """The exception a rank died of, and the innermost frame of the user's own code."""

    exception: str
    file: str | None = None
    line: int | None = None
    function: str | None = None
    source: str | None = None

    @property
    def where(self) -> str | None:
        return None if self.file is None else f"{self.file}:{self.line}, in {self.function}"


def each_rank(lines: Iterable[str], ranks: Container[int] | None = None) -> Iterator[str]:
    """lines, each that an agent collapsed from several ranks as their own lines (ranks: its node's, where known)."""
    for line in lines:
        yield from each_ranks(line, ranks)


def rank_lines(lines: Iterable[str], rank: int) -> list[str]:
    """The rank's own lines, without the prefix."""
    prefix = f"[rank{rank}]: "
    return [line[len(prefix):] for line in each_rank(lines) if line.startswith(prefix)]


def user_error(lines: Sequence[str]) -> UserError | None:
    """From the last Python traceback in lines (one rank's, unprefixed): its exception line and the
    innermost frame outside the standard library and installed packages (the innermost frame at all
    when every frame is theirs)."""
    start = max((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")),
                default=None)
    if start is None:
        return None
    frames: list[tuple[str, int, str, str | None]] = []
    exception = None
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if match := FRAME.match(line):
            following = lines[i + 1] if i + 1 < len(lines) else ""
            source = following.strip() if following.startswith("    ") and not FRAME.match(following) else None
            frames.append((match["file"], int(match["line"]), match["function"], source))
        elif line and not line.startswith(" "):
            exception = line
            break
    if exception is None:
        return None
    ours = [f for f in frames if not NOT_USER_CODE.search(f[0])] or frames
    if not ours:
        return UserError(exception)
    file, number, function, source = ours[-1]
    return UserError(exception, file, number, function, source)


def cpp_exception(lines: Sequence[str]) -> str | None:
    """`TYPE: what()` of the last C++ exception that terminated the process, from one rank's unprefixed
    lines: such a process leaves no Python traceback. Its `what():` line is the first of the next WHAT_WITHIN:
    torchrun reads a worker's stdout and stderr from two files, so the worker's other lines can fall between."""
    for i in range(len(lines) - 1, -1, -1):
        if match := CPP_TERMINATE.match(lines[i]):
            what = next((found for line in lines[i + 1:i + 1 + WHAT_WITHIN] if (found := CPP_WHAT.match(line))), None)
            if what is not None:
                return f"{match['type']}: {what['what']}"
    return None


def hint(lines: Iterable[str]) -> str | None:
    """One line of advice for a failure whose signature is known."""
    seen = list(lines)
    if any(NO_CUDA.search(line) for line in seen):
        return NO_CUDA_HINT
    return NO_NETWORK_HINT if any(NO_NETWORK.search(line) for line in seen) else None
