"""Benchmarks: payload speed and harness cost, side by side in one run (`python -m bench --quick|--full`).

throughput.py  1. payload vs the seed recipe (seed.py): img/s, MFU, time to accuracy on digits
ddp.py         2. 1 process vs 1 DDP rank vs 2 DDP ranks
launch.py      3. `harness launch` vs plain torchrun to the first step; 5. failure propagation
harness_cost.py 3b. the payload's img/s under `harness launch` vs plain torchrun
stats.py       interleaved rounds until the 95% interval of a difference or ratio is narrow
preflight.py   4. `harness preflight` over 1, 4, 16 namespace hosts
recovery.py    6. time to recover from a lost rank or host
attach.py      6b. a lost controller: `harness attach` against a relaunch
run.py         the runner: profiles, JSON under bench/results/, docs/benchmarks.md (report.py)
"""
