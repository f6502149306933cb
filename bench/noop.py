"""The trivial distributed job of benchmark 3's end-to-end rows: join, one all_reduce, leave. Its whole
run is the launcher's cost and torch's start, nothing else."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
print(f"rank {dist.get_rank()}: sum {total.item():g}", flush=True)
dist.destroy_process_group()
