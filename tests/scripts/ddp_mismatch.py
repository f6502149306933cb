"""A gloo job with a collective mismatch, the bug gloo aborts a rank for: rank 1 all-reduces 3 floats while
every other rank all-reduces 5 ("Received data size doesn't match expected size")."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} up", flush=True)
dist.all_reduce(torch.ones(3 if rank == 1 else 5))
dist.barrier()
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()
