"""SGLang's memory release: a colocated trainer borrows the servers' GPU memory between rollouts."""

from __future__ import annotations

from typing import Sequence

from moe_rl.rollout.sglang.control import ServerControl


class MemoryEndpoints(ServerControl):
    """Servers started with ``--enable-memory-saver`` free and take back their GPU memory."""

    def release_memory_occupation(self, tags: Sequence[str]) -> None:
        """Servers free the GPU memory ``tags`` name (``weights``, ``kv_cache``,
        ``cuda_graph``) for a colocated trainer; needs ``--enable-memory-saver``. Always
        named: SGLang releases all three for no tags, and each must be taken back."""
        self._post_all("/release_memory_occupation", {"tags": list(tags)})

    def resume_memory_occupation(self, tags: Sequence[str]) -> None:
        """Servers take back the memory ``tags`` name."""
        self._post_all("/resume_memory_occupation", {"tags": list(tags)})
