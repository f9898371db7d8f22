"""The rollout half of a run: engines, samplers, scorers and weight syncs built from the config;
the first rank's collector (prompts -> rollout -> rewards -> advantages), background rollouts,
held-out evaluation and the sample log. Nothing here imports :mod:`moe_rl.trainer`."""
