"""In the style of PyTorch's DDP tutorials: NCCL and CUDA hard-coded, whatever the job says."""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group(backend="nccl")
    torch.cuda.set_device(local_rank)
    model = DDP(torch.nn.Linear(10, 10).to(local_rank), device_ids=[local_rank])
    model(torch.randn(20, 10).to(local_rank)).sum().backward()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
