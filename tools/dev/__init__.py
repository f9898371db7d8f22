"""Developer tools: the import graph (``python -m tools.dev.import_graph``) and the config reference (``python -m tools.dev.config_reference --check``)."""
