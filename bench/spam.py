"""Benchmark 11's job: every rank prints LINES lines as fast as it can (a chatty job, a progress bar's
worth of output, a debug print in a loop), and nothing else."""

import os
import sys

lines = int(sys.argv[1]) if len(sys.argv) > 1 else 250_000
rank = os.environ.get("RANK", "?")
write = sys.stdout.write
for i in range(lines):
    write(f"rank {rank} line {i}: loss 0.123456 lr 0.1 images 128 step time 0.0123 s\n")
sys.stdout.flush()
