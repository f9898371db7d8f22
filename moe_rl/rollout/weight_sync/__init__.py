"""How the trainer's weights reach the rollout engine, one file per way (chosen once per run):

- ``base``: :class:`~moe_rl.rollout.weight_sync.base.WeightSync` and the trainer's side, ``WeightSource``;
- ``in_process``: full tensors to an engine in this process (the local engine);
- ``disk``: a HF directory every server re-reads;
- ``distributed``: buckets broadcast over weight-update groups the servers join (``nccl``: the version check);
- ``tensor``: buckets handed by reference to servers on the first rank's node (``cuda_ipc``: their form).
"""
