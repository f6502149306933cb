"""The real clusters that the tests (tests/integration) and the benchmarks (bench/) build on this machine.

cluster: sshd hosts in network namespaces; slurm_cluster: slurmctld and slurmd in network namespaces;
podman_config: each namespace host's podman. Both clusters need root; importing them does not.
The cluster modules also carry their pytest fixtures, which tests/conftest.py loads as plugins.
"""
