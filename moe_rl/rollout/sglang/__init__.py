"""The SGLang rollout engine, one file per concern:

- ``engine``: :class:`~moe_rl.rollout.sglang.engine.SGLangEngine`, composed of the parts below;
- ``control``: what every server is asked alike (info, weight version, health, control posts);
- ``client``: generation (``/generate`` with retries, replies parsed, routed experts decoded);
- ``turns``: multi-turn requests, each on the server that holds its prefix;
- ``weight_updates``: the weight-update endpoints (disk, weight-update group, by reference);
- ``waits``: requests that block until this process joins or broadcasts;
- ``memory``: releasing and resuming the servers' GPU memory;
- ``server``: starting and stopping SGLang server processes.
"""
