"""The DDP training payload: a fast, resumable CIFAR-10 ResNet-18 run under plain torchrun.

It imports nothing else from `harness`, so it runs anywhere torch does; the harness only launches it.
"""


class PayloadError(Exception):
    """A problem the user can fix (missing data, bad flags, incompatible checkpoint): one message; training
    exits 2 on it, `harness prepare` 1 (a failed download is not bad usage)."""
