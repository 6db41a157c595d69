"""Time and memory of a plan: closed form, simulator, and the evaluation of plans (pure)."""
