"""moe-rl's tools, by kind: ``bench/`` (benchmarks that print figures), ``gpu_check/`` (the
check a lent GPU machine runs), ``reliability/`` (long runs, kills), ``dev/`` (the import graph,
the config reference); ``setup.sh`` installs. Python tools run as modules from the repository
root: ``.venv/bin/python -m tools.bench.run``."""
