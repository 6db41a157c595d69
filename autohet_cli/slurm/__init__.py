"""Launching on Slurm: the backend, batch scripts, job control, cluster import (the cluster
file's slurm: section is ``autohet_cli.slurmconf``)."""
