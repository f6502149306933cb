"""What keeps a failed run's terminal on its root cause: once a rank fails, its peers fail too, each with a
traceback that only says a peer went away (gloo's `Connection closed by peer`, NCCL's abort, a store
that closed). Those consequent tracebacks, and whatever such a rank prints after one, are held back
from the terminal; so is a traceback the same as one another rank showed (every rank of a script that
asks for CUDA on a CPU machine fails alike). The record keeps them all (`harness logs`). Pure: lines in,
lines to show out."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.control import worker_output
from harness.health.rank_stack import ranks_text
from harness.node.protocol import number_ranges

TRACEBACK = "Traceback (most recent call last):"
LONGEST_TRACEBACK = 400  # lines buffered before a traceback that never ends is shown as it is


@dataclass
class Cascade:
    """One node's ranks: tracebacks being read (rank -> its lines so far), ranks whose failure was a
    consequence (everything they say next is held), and how many lines were held."""

    reading: dict[int, list[str]] = field(default_factory=dict)
    consequent: set[int] = field(default_factory=set)
    held: int = 0
    held_from: set[int] = field(default_factory=set)  # the ranks whose lines were held
    # Every traceback shown (its lines without the rank prefix) -> the rank that showed it: shared by the nodes of
    # an attempt, so that the same traceback is shown once whichever node says it again.
    shown: dict[tuple[str, ...], int] = field(default_factory=dict)
    alike: dict[int, int] = field(default_factory=dict)  # rank -> the rank whose same traceback was shown

    def hold(self, rank: int | None, lines: int = 1) -> None:
        self.held += lines
        if rank is not None:
            self.held_from.add(rank)

    @property
    def idle(self) -> bool:
        """Nothing read or held yet: every line can be shown as it comes."""
        return not self.reading and not self.consequent

    def take(self, rank: int, line: str, text: str) -> list[str]:
        """A line of rank's (text: without the rank prefix); the lines to show now."""
        if rank in self.consequent:
            self.hold(rank)
            return []
        lines = self.reading.get(rank)
        if lines is None:
            if text != TRACEBACK:
                return [line]
            self.reading[rank] = [line]
            return []
        lines.append(line)
        if text.startswith(" ") or not text or text == TRACEBACK:
            return [] if len(lines) < LONGEST_TRACEBACK else self.reading.pop(rank)
        del self.reading[rank]  # the exception line ends the traceback
        if worker_output.after_a_peer(text):
            self.consequent.add(rank)
            self.hold(rank, len(lines))
            return []
        first = self.shown.setdefault(tuple(line[len(f"[rank{rank}]: "):] for line in lines), rank)
        if first != rank:
            self.alike[rank] = first
            return []
        return lines

    def release(self) -> list[str]:
        """The node's output ended: tracebacks cut short are shown as they are."""
        lines = [line for rank in sorted(self.reading) for line in self.reading[rank]]
        self.reading.clear()
        return lines


def alike_words(alike: dict[int, int], logs_command: str) -> list[str]:
    """What the run's end says of the tracebacks held back for being another rank's again: a line per traceback
    shown, naming every rank that failed alike (at 16,384 ranks failing alike, one line, not 16,383)."""
    by_first: dict[int, list[int]] = {}
    for rank, first in sorted(alike.items()):
        by_first.setdefault(first, []).append(rank)
    return [f"{ranks_text(ranks)} failed with the same traceback as rank {first}, held back from this terminal: "
            f"`{logs_command} --rank {number_ranges(ranks)}`" for first, ranks in sorted(by_first.items())]
