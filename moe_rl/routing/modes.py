"""The routing-replay modes (a light module: the config checks them without importing megatron-core)."""

REPLAY_MODES = ("none", "r2", "r3")  # off | the old policy's routing | the inference engine's
