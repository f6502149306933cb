"""The stand-in torch (testbed/standin): no tensors, only what the harness's hook and the stand-in ranks use."""

__version__ = "0.0+standin"
