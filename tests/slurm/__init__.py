"""A real Slurm cluster (slurmctld, several slurmd, a private munged) on one machine, for tests."""
