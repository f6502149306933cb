"""Stand-in ranks for measuring the harness itself at scale (bench/scale.py, tests/integration/test_scale.py):
a torch that costs no torch import, so that on this machine hundreds of nodes cost what the harness costs.

shim/ goes first on a job's PYTHONPATH (with the repository after it) and is all a node sees of this:
`python -m torch.distributed.run` there is launcher.py, which starts each rank as torchrun does (its own
Python, torchrun's environment, the `[rankN]: ` prefix on its lines) and, on node 0, the collectives'
coordinator; `import torch.distributed` in a rank is collectives.py (init_process_group, all_reduce,
barrier), and `torch._C._distributed_c10d._WorkerServer` serves the rank's Flight Recorder entries as
torch's own worker server does, so the harness's rank hook, agent and judges run unchanged. rank.py is the
script the ranks run: steps, lines, a warning every rank prints, a rank that hangs.

Nothing here is part of the product: the harness renders and runs torchrun; only the environment differs.
"""
