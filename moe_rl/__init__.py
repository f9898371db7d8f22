"""moe-rl: RL post-training for Mixture-of-Experts LLMs on megatron-core."""

__version__ = "0.1.0"

# before any module here imports megatron-core (a CPU-only torch: no compiler stack imported)
from parallel.fusers import run_megatron_fusers_eagerly_on_cpu_builds  # noqa: E402

run_megatron_fusers_eagerly_on_cpu_builds()
