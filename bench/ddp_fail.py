"""A gloo DDP job in which one rank dies mid-run while the others are blocked (benchmark 5).

Every rank does FAIL_AT_STEP all-reduces; then rank FAIL_RANK writes the wall-clock time to
DEATH_FILE and exits at once (os._exit, like a crash). The others either sleep (BLOCK=sleep: a long
step or a stuck read, where nothing but a supervisor can end them) or wait in an all-reduce that
the dead rank never joins (BLOCK=collective). Run it under torchrun or `harness launch`.
"""

import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    fail_rank, fail_at = int(os.environ.get("FAIL_RANK", "1")), int(os.environ.get("FAIL_AT_STEP", "3"))
    block = os.environ.get("BLOCK", "sleep")
    tensor = torch.ones(1)
    for step in range(fail_at):
        dist.all_reduce(tensor)
        print(f"rank {rank} step {step}", flush=True)
    if rank == fail_rank:
        with open(os.environ["DEATH_FILE"], "w") as f:
            f.write(repr(time.time()))
        os._exit(1)
    if block == "collective":
        dist.all_reduce(tensor)
    time.sleep(3600)


if __name__ == "__main__":
    main()
