"""The heterogeneous planner: grouping search, SCIP formulation, baselines, explain (pure)."""
