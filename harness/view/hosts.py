"""`harness hosts`: the machines an earlier failure keeps out of every run (record/hosts_out.py), and bringing
one back once it is mended."""

from __future__ import annotations

import time

from harness.record.hosts_out import ALL, bring_back, hosts_file, hosts_out


def hosts_text() -> str:
    path = hosts_file()
    entries = hosts_out(path)
    if not entries:
        return (f"no host is kept out ({path}): a host lost in a run, or unfit in the check before an attempt, is "
                f"kept out of every run for restarts.cooldown seconds\n")
    now = time.time()
    rows = [("HOST", "ADDRESS", "FOR", "RUN", "WHY")]
    rows += [(e.name, e.machine, f"{(e.until - now) / 60:.0f} min more", e.run_id, e.reason) for e in entries]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join([*(cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)), row[4]])
             for row in rows]
    return "\n".join([*lines, f"bring one back: harness hosts --release HOST (or {ALL})"]) + "\n"


def release(which: str) -> str:
    back = bring_back(hosts_file(), which)
    return "".join(f"{entry.name} ({entry.machine}) is back: the next run may use it\n" for entry in back)
