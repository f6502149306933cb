"""torchrun target for `harness preflight --collective`: a verified all_reduce and its bus bandwidth.

Every rank contributes rank+1, so every element of the sum must equal world*(world+1)/2. Rank 0
prints one JSON line after the marker given as --marker. busbw = algbw * 2(n-1)/n, the figure
nccl-tests report: comparable across world sizes, near the link speed when the network is healthy.
Backend comes from HARNESS_BACKEND like the payload's: auto means nccl with CUDA, else gloo.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist


def _backend() -> str:
    backend = os.environ.get("HARNESS_BACKEND", "auto")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--marker", required=True)
    parser.add_argument("--bytes", type=int, default=0, help="message size; 0 = 256 MiB on nccl, 8 MiB on gloo")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    backend = _backend()
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    size = args.bytes or (256 << 20 if backend == "nccl" else 8 << 20)
    data = torch.empty(size // 4, dtype=torch.float32, device=device)
    expected = world * (world + 1) / 2
    verified, elapsed = True, 0.0
    for step in range(args.iters + 1):  # step 0 warms up connections and is not timed
        data.fill_(rank + 1)
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(data)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step:
            elapsed += time.perf_counter() - started
        verified &= bool(torch.all(data == expected))
    flag = torch.tensor([int(verified)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    seconds = elapsed / args.iters
    algbw = size / seconds / 1e9
    if rank == 0:
        print(args.marker + json.dumps({
            "backend": backend, "world": world, "bytes": size, "iters": args.iters, "seconds": seconds,
            "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (world - 1) / world, "verified": bool(flag.item()),
        }), flush=True)
    dist.destroy_process_group()
    return 0 if flag.item() else 1


if __name__ == "__main__":
    raise SystemExit(main())
