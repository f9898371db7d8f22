"""Built-in environments for multi-turn rollouts (``rollout.multi_turn.generate_fn``)."""
