"""autohet: plan, launch and heal large-model training on heterogeneous GPU fleets."""

__version__ = "0.1.0"
