"""Checkpoints: the dist_checkpointing store (background saves, resume under any layout,
export of the weights) and the run directory's checks before a run starts."""
