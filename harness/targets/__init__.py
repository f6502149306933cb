"""Targets: where a planned job runs, one folder each, behind the two interfaces of base.py.

- local/: simulated nodes on this machine (a Backend);
- ssh/: one node per inventory host over SSH (transport.py: paramiko), optionally inside the job's
  image (container.py) (a Backend);
- slurm/: the sbatch script (batch.py), the command-line client (client.py), sbatch as a Scheduler
  (scheduler.py), and srun steps inside an allocation (srun.py, a Backend);
- k8s/: the Kubernetes manifests (render only);
- agent_link.py: the controller's end of the node agent's protocol (the agent: harness.node.agent);
- address.py, command.py: what the SSH and Slurm targets share.

Nothing here imports preflight, run control or the CLI: the controller drives a target, and the
check a target runs before it starts nodes is handed to it. See docs/architecture.md.
"""
