"""Built-in environments for multi-turn rollouts (``rollout.generate_fn``)."""
