"""In the style of PyTorch's examples: without enough GPUs it says so and exits 0, never joining a group."""

import os
import sys

import torch


def main() -> None:
    world_size = int(os.environ["WORLD_SIZE"])
    if torch.cuda.device_count() < world_size:
        print(f"Unable to locate sufficient {world_size} gpus to run this example. Exiting.")
        sys.exit(0)
    raise AssertionError("this test machine has no GPUs")


if __name__ == "__main__":
    main()
