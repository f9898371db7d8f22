"""MoE routing: replay (R2, R3) on megatron-core's RouterReplay, drift metrics, logging."""
