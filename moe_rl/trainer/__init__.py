"""The RL trainer: configs in, a trained MoE policy, checkpoints and TensorBoard logs out."""
