"""A shape bug that torch reports from deep inside nn.Module's call machinery, after joining a group."""

import torch
import torch.distributed as dist


def build_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU()), torch.nn.Linear(5, 1))


def train_step(model: torch.nn.Module) -> None:
    batch = torch.randn(2, 8)
    loss = model(batch).sum()  # the user's line: the second layer expects 5 features, gets 4
    loss.backward()


def main() -> None:
    dist.init_process_group("gloo")
    train_step(build_model())


if __name__ == "__main__":
    main()
