"""``MultiSteps`` / ``accumulate``: the Optax transformation that accumulates
across calls."""
