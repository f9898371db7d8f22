"""moe-rl: RL post-training for Mixture-of-Experts LLMs on megatron-core."""

__version__ = "0.1.0"
