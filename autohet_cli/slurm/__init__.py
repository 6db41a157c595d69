"""Launching on Slurm: settings, batch scripts, job control, cluster import."""
