"""The networks: torchvision's ResNet-18 with the CIFAR stem, and a small CNN for CPU tests.

`--norm group` swaps BatchNorm for GroupNorm: BatchNorm's statistics are per rank, so only a model
without it computes exactly the same function under DDP as in one process on the global batch.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

MODELS = ("resnet18", "small")
NORMS = ("batch", "group")
GROUPS = 8


def build(name: str, in_channels: int, num_classes: int, norm: str = "batch") -> nn.Module:
    norm_layer = _norm_layer(norm)
    if name == "resnet18":
        return resnet18_cifar(in_channels, num_classes, norm_layer)
    if name == "small":
        return small(in_channels, num_classes, norm_layer)
    raise ValueError(f"unknown model {name!r}: expected one of {', '.join(MODELS)}")


def _norm_layer(norm: str) -> Callable[[int], nn.Module]:
    if norm == "batch":
        return nn.BatchNorm2d
    if norm == "group":
        return lambda channels: nn.GroupNorm(GROUPS, channels)
    raise ValueError(f"unknown norm {norm!r}: expected one of {', '.join(NORMS)}")


def resnet18_cifar(in_channels: int, num_classes: int, norm_layer: Callable[[int], nn.Module]) -> nn.Module:
    """3x3 stride-1 first conv and no max-pool: 32x32 inputs keep their resolution into layer1."""
    from torchvision.models import resnet18  # imported here: torchvision adds seconds to every rank's start

    model = resnet18(num_classes=num_classes, norm_layer=norm_layer)
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    model.maxpool = nn.Identity()
    return model


def small(in_channels: int, num_classes: int, norm_layer: Callable[[int], nn.Module], width: int = 16) -> nn.Module:
    """Three conv blocks and two 2x pools: handles 32x32 CIFAR and 8x8 digits natively, fast on CPU."""

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), norm_layer(cout), nn.ReLU(inplace=True)]

    return nn.Sequential(
        *block(in_channels, width),
        nn.MaxPool2d(2),
        *block(width, 2 * width),
        nn.MaxPool2d(2),
        *block(2 * width, 4 * width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * width, num_classes),
    )


def shard_units(model: nn.Module) -> list[nn.Module]:
    """What FSDP shards one by one, each unit's parameters gathered only while it computes: ResNet's
    residual blocks; for the small CNN (a Sequential), each layer with weights."""
    blocks = [m for m in model.modules() if type(m).__name__ == "BasicBlock"]
    return blocks or [m for m in model.children() if any(True for _ in m.parameters(recurse=False))]
