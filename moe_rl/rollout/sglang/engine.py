"""SGLang servers over HTTP (SGLang 0.5.23's API; only httpx is needed).

- ``/generate`` per sample with ``input_ids``, ``return_logprob``, a distinct
  ``sampling_seed`` (deterministic servers would otherwise use 42 for every sample of a
  group) and ``return_routed_experts`` when R3 is on;
- at most ``ceil(max_concurrency / servers)`` requests in flight per server, over one
  connection pool of that many connections per server (httpx's default pool holds 100);
  a prompt's samples (and every turn of a multi-turn sample) go to one server, whose
  prefix cache then holds their shared prompt; prompts take the servers in turn;
- timeouts; retries with exponential backoff on connection errors, timeouts, 5xx and
  malformed replies (the next attempt goes to the next server), then a
  :class:`RolloutError` naming the server and cause; 4xx is not retried (the request is wrong);
- weight sync by ``/update_weights_from_disk`` (any setup) or a weight-update group
  (``/init_weights_update_group`` sent to every server at once, cumulative rank offsets;
  ``/update_weights_from_distributed`` per bucket inside ``/begin_weight_update`` ...
  ``/end_weight_update``, with generation paused, the served version checked after), each
  bucket one flat broadcast (``load_format="flattened_bucket"``) where every server is
  SGLang 0.5.6 or later, else one broadcast per tensor;
- every sample's ``weight_version`` is checked against the version last synced.
"""

from __future__ import annotations

from typing import Callable, Sequence

from moe_rl.rollout.contracts import DistributedWeightReceiver, MemoryReleaser, TensorWeightReceiver
from moe_rl.rollout.sglang.client import GenerationClient
from moe_rl.rollout.sglang.memory import MemoryEndpoints
from moe_rl.rollout.sglang.weight_updates import WeightUpdateEndpoints
from moe_rl.rollout.types import RolloutEngine


class SGLangEngine(
    GenerationClient,
    WeightUpdateEndpoints,
    MemoryEndpoints,
    RolloutEngine,
    DistributedWeightReceiver,
    TensorWeightReceiver,
    MemoryReleaser,
):
    """The rollout engine over SGLang servers: generation (:mod:`.client`), weight updates
    (:mod:`.weight_updates`) and memory release (:mod:`.memory`) on one set of servers
    (:mod:`.control`)."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        num_layers: int | None = None,
        top_k: int | None = None,
        num_experts: int | None = None,
        weight_version: str | None = None,
        max_concurrency: int = 64,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        check_weight_version: bool = True,
        nccl_version_probes: Sequence[Callable[[], str | None]] | None = None,
    ) -> None:
        super().__init__(urls, weight_version=weight_version, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s)
        self._init_generation(
            num_layers=num_layers,
            top_k=top_k,
            num_experts=num_experts,
            max_concurrency=max_concurrency,
            max_retries=max_retries,
            backoff_s=backoff_s,
            check_weight_version=check_weight_version,
        )
        self._init_weight_updates(nccl_version_probes)
