"""harness: one job spec and a host inventory become a supervised multi-node torchrun job."""

__version__ = "0.1.0"
