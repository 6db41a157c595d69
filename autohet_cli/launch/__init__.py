"""Launch: pure launch specs (what --dry-run prints) and the executor that runs them."""
