"""The check a lent GPU machine runs in one call (``bash tools/gpu_check/run.sh``; docs/gpu.md)."""
