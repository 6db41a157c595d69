"""Profiles: what each GPU type measured (or is estimated to do) per model layer."""
