"""Sub-commands of the ``moe-rl`` command line, one module each."""
