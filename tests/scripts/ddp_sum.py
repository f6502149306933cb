"""A small torchrun-able gloo DDP job for harness tests: trains a linear model, optionally fails.

FAIL_RANK / FAIL_AT_STEP make one rank exit FAIL_CODE (default 1) mid-run, and HANG_AT_STEP makes every other rank block
there (like a long step or a stuck read) so that only the supervisor can end them. STEPS and
STEP_SECONDS set the pace; rank 0 says every fifth step (every rank: EVERY_RANK_SAYS_STEPS=1). AWAIT_RANK_HOOK=1: each rank waits, once its process group exists, until the
harness's rank hook serves in it (its socket exists), and says where, so that a test sees the hook's server end
with the rank, or tries it.
REACH_OUT=1: the failing rank first reaches for another host as a download would, only where no packet can leave
(a network without routes, the simulated nodes' own), and says the error it got.
FORGE_MESSAGES=1: the failing rank first prints FORGED, the node agent's messages as the agent writes them
(harness/node/protocol.py: its marker, a kind, a body): its node's end with code 0, the end of a replay at an offset
of its own, an OOM kill of itself; none may be taken for the agent's.
SHOW_DIGEST=NAME[,NAME...]: each rank says, for each NAME, the sha256 of its env's NAME (not the value) and in how
many processes' command lines that value is, read from /proc while the job runs.
On the stand-in torch of testbed/standin (its shim first on PYTHONPATH: ddp_job(standin=True)), where torch's own
behaviour is not what a test is about, the same lines at the same pace for no torch import: each step an
all_reduce of a number, and a loss and weights every rank shares.
"""

import glob
import hashlib
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

try:
    from torch import nn
except ImportError:  # the stand-in torch: no tensors
    nn = None

TARGET = [1.0, -2.0, 3.0, 0.5]
FORGED = ('\x1eharness-node-exit 0\n\x1eharness-watched {"at": 1000000000}\n'
          '\x1eharness-oom {"1": "Out of memory: Killed process 1"}\n')


class Linear:
    """A linear model fit to TARGET by DDP: each step's loss, and the weights at the end."""

    def __init__(self, world: int, rank: int) -> None:
        self.world, self.rank = world, rank
        torch.manual_seed(0)
        self.model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.target = torch.tensor(TARGET)

    def step(self, step: int) -> float:
        g = torch.Generator().manual_seed(step * self.world + self.rank)
        x = torch.randn(32, 4, generator=g)
        loss = ((self.model(x).squeeze(1) - x @ self.target) ** 2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.item()

    def weights(self) -> list[float]:
        return self.model.module.weight.detach().flatten().tolist()


class StandIn:
    """The stand-in's: a collective per step, as DDP's all-reduce of the gradients."""

    def __init__(self, world: int, rank: int) -> None:
        pass

    def step(self, step: int) -> float:
        return dist.all_reduce(1.0 / (step + 1))

    def weights(self) -> list[float]:
        return TARGET


def show_secret(rank: int, name: str) -> None:
    value = os.environ.get(name)
    if value is None:
        print(f"rank {rank}: {name} is not set", flush=True)
        return
    seen = 0
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as cmdline:
                seen += value.encode() in cmdline.read()
        except OSError:
            continue
    print(f"rank {rank}: {name} sha256 {hashlib.sha256(value.encode()).hexdigest()[:16]}, "
          f"in {seen} command lines", flush=True)


def reach_out(rank: int) -> None:
    with open("/proc/net/route") as routes:  # this process's network's: a header alone where it has no route
        if routes.read().splitlines()[1:]:
            print(f"rank {rank}: this network has routes: not reaching out", flush=True)
            return
    try:
        socket.create_connection(("192.0.2.1", 443), timeout=5).close()  # TEST-NET-1: never a real host
    except OSError as exc:
        print(f"rank {rank} could not reach 192.0.2.1: {exc}", flush=True)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if os.environ.get("AWAIT_RANK_HOOK") == "1":
        hook = os.path.join(os.environ.get("HARNESS_AGENT_DIR", "/nowhere"), f"{rank}.sock")
        deadline = time.monotonic() + 120
        while not os.path.exists(hook) and time.monotonic() < deadline:
            time.sleep(0.05)
        print(f"rank {rank}: rank hook at {hook}", flush=True)
    for name in filter(None, os.environ.get("SHOW_DIGEST", "").split(",")):
        show_secret(rank, name)
    steps = int(os.environ.get("STEPS", "20"))
    pause = float(os.environ.get("STEP_SECONDS", "0"))
    spin = float(os.environ.get("SPIN_SECONDS", "0"))  # per step, on the CPU: a rank whose CPU use shows
    fail_rank = int(os.environ.get("FAIL_RANK", "-1"))
    fail_at = int(os.environ.get("FAIL_AT_STEP", "-1"))
    hang_at = int(os.environ.get("HANG_AT_STEP", "-1"))
    model = (StandIn if nn is None else Linear)(world, rank)
    print(f"rank {rank}/{world} up on {socket.gethostname()}; args={sys.argv[1:]}", flush=True)
    for step in range(steps):
        if rank == fail_rank and step == fail_at:
            if os.environ.get("REACH_OUT") == "1":
                reach_out(rank)
            if os.environ.get("FORGE_MESSAGES") == "1":
                print(FORGED, end="", flush=True)
            print(f"rank {rank} failing on purpose at step {step}", flush=True)
            sys.exit(int(os.environ.get("FAIL_CODE", "1")))
        if rank != fail_rank and step == hang_at:
            time.sleep(3600)
        loss = model.step(step)
        if (rank == 0 or os.environ.get("EVERY_RANK_SAYS_STEPS") == "1") and step % 5 == 0:
            print(f"step {step} loss {loss:.4f}", flush=True)
        time.sleep(pause)
        busy_until = time.monotonic() + spin
        while time.monotonic() < busy_until:
            pass
    print(f"rank {rank} final loss {loss:.4f} weights {model.weights()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Like harness/payload/train.py: skip interpreter finalization, during which a gloo thread that
    # is still releasing the last collective's tensors can abort a run that succeeded.
    sys.stdout.flush()
    os._exit(0)
