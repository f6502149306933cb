"""Slurm: the sbatch script, the command-line client, the sbatch scheduler and srun steps in an allocation."""
