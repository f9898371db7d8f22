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

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import math
import re
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

import httpx
import torch
from torch import Tensor

from moe_rl.rollout.contracts import DistributedWeightReceiver, MemoryReleaser, TensorWeightReceiver
from moe_rl.rollout.sglang_turns import HttpTurns
from moe_rl.rollout.sglang_waits import leave_group_when_made, on_daemon_thread, unless_refused
from moe_rl.rollout.types import (
    RolloutEngine,
    RolloutError,
    Sample,
    SamplingParams,
    StaleWeightsError,
    TurnSource,
    run_groups,
    sample_seed,
)
from moe_rl.routing.encoding import decode_routed_experts, repeats_an_expert

log = logging.getLogger(__name__)

# the first SGLang that receives a distributed bucket as one flat broadcast (load_format
# "flattened_bucket" in /update_weights_from_distributed: the 0.5.5.post3 wheel lacks it, the
# 0.5.6 wheel has it). An older server ignores the field and would read the bytes as separate tensors.
FLATTENED_BUCKETS_SINCE = (0, 5, 6)


class _Retryable(Exception):
    pass


class SGLangEngine(RolloutEngine, DistributedWeightReceiver, TensorWeightReceiver, MemoryReleaser):
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
        if not urls:
            raise ValueError("rollout.sglang.urls is empty: give at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.num_layers, self.top_k, self.num_experts = num_layers, top_k, num_experts
        self._unfinished: set[str] = set()  # request ids sent and not answered (aborted by close())
        self._version = weight_version
        self.max_concurrency = max_concurrency
        # requests in flight per server; the connection pool holds that many per server
        self.concurrency_per_server = max(1, math.ceil(max_concurrency / len(self.urls)))
        self._next_server = 0  # the server the next prompt goes to (prompts take them in turn)
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self.check_weight_version = check_weight_version
        self._rr = itertools.count()
        self.retries = 0
        self._server_ranks: list[int] | None = None
        # per server, how to learn its NCCL version (asked only before an NCCL weight-update group)
        self._nccl_probes = list(nccl_version_probes or [lambda: None] * len(self.urls))
        if len(self._nccl_probes) != len(self.urls):
            raise ValueError(f"{len(self._nccl_probes)} NCCL version probes for {len(self.urls)} servers")

    @property
    def weight_version(self) -> str:
        """The version every sample must carry: given, or the servers' own (SGLang starts
        at ``"default"``), read from ``/model_info`` when first needed."""
        if self._version is None:
            self._version = self.read_weight_version()
        return self._version

    def read_weight_version(self) -> str:
        """The servers' current ``weight_version``; they must all serve the same one."""
        versions = {url: str(body.get("weight_version")) for url, body in zip(self.urls, self._get_info("model"))}
        if len(set(versions.values())) > 1:
            raise RolloutError(
                f"the SGLang servers serve different weight versions {versions}: sync their weights first"
            )
        return next(iter(versions.values()))

    # ------------------------------------------------------------ generation

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        params: SamplingParams,
        *,
        seed: int,
        return_routed_experts: bool = False,
    ) -> list[list[Sample]]:
        params.validate()
        if return_routed_experts and (self.num_layers is None or self.top_k is None):
            raise ValueError("routed experts need num_layers and top_k of the served model")
        expected = self.weight_version
        return asyncio.run(self._generate(prompts, n, params, seed, return_routed_experts, expected))

    async def _generate(self, prompts, n, params, seed, routed, expected_version: str) -> list[list[Sample]]:
        async with self._client() as client:
            slots = self._server_slots()
            servers = [self.take_server() for _ in prompts]  # a prompt's samples on one server
            request = functools.partial(
                self._request, client, slots, params=params, routed=routed, expected_version=expected_version
            )
            return await run_groups(
                lambda i, j: request(
                    prompts[i], sample_seed(seed, i, j, n), rid=f"moe-rl-{seed}-{i}-{j}", server=servers[i]
                ),
                len(prompts),
                n,
            )

    def _client(self) -> httpx.AsyncClient:
        """A client whose pool has a connection for every request that may be in flight."""
        total = self.concurrency_per_server * len(self.urls)
        return httpx.AsyncClient(
            timeout=self.timeout, limits=httpx.Limits(max_connections=total, max_keepalive_connections=total)
        )

    def _server_slots(self) -> list[asyncio.Semaphore]:
        """One limit per server: ``concurrency_per_server`` requests in flight."""
        return [asyncio.Semaphore(self.concurrency_per_server) for _ in self.urls]

    def take_server(self) -> int:
        """The index of the server the next prompt goes to (each in turn)."""
        server, self._next_server = self._next_server, (self._next_server + 1) % len(self.urls)
        return server

    async def _request(
        self,
        client: httpx.AsyncClient,
        slots: list[asyncio.Semaphore],
        prompt: Sequence[int],
        seed: int,
        *,
        params: SamplingParams,
        routed: bool,
        expected_version: str,
        rid: str,
        server: int,
        routing_from: int = 0,
    ) -> Sample:
        """One ``/generate`` request (``n=1``) to server ``server`` first; its routed experts
        from position ``routing_from`` (SGLang's ``routed_experts_start_len``: earlier
        positions came with an earlier turn)."""
        payload = {
            "input_ids": list(prompt),
            "sampling_params": params.to_sglang(seed),
            "return_logprob": True,
            "logprob_start_len": len(prompt),
            "rid": rid,
        }
        if routed:
            payload["return_routed_experts"] = True
            if routing_from:
                payload["routed_experts_start_len"] = routing_from
        parse = functools.partial(
            self._parse, list(prompt), seed, routed=routed, expected_version=expected_version, routing_from=routing_from
        )
        self._unfinished.add(rid)  # until answered: close() aborts what an interrupt left running
        sample = await self._post_with_retries(client, "/generate", payload, parse, server=server, slots=slots)
        self._unfinished.discard(rid)
        return sample

    @contextlib.asynccontextmanager
    async def turns(self, *, return_routed_experts: bool) -> AsyncIterator[TurnSource]:
        """Single requests over one connection pool, at most ``concurrency_per_server`` in
        flight per server."""
        if return_routed_experts and (self.num_layers is None or self.top_k is None):
            raise ValueError("routed experts need num_layers and top_k of the served model")
        expected = self.weight_version
        async with self._client() as client:
            yield HttpTurns(self, client, self._server_slots(), return_routed_experts, expected)

    async def _post_with_retries(
        self,
        client: httpx.AsyncClient,
        path: str,
        payload: dict,
        parse: Callable[[dict], Any] = dict,
        *,
        server: int | None = None,
        slots: Sequence[asyncio.Semaphore] | None = None,
    ) -> Any:
        """``parse(reply)`` of the first good reply, asking server ``server`` first (default:
        each in turn) within its slot of ``slots``; transport errors, 5xx, replies that are
        not JSON and replies ``parse`` finds malformed or aborted are retried on the next
        server with exponential backoff; 4xx is final."""
        start = next(self._rr) if server is None else server
        last = ""
        for attempt in range(self.max_retries + 1):
            index = (start + attempt) % len(self.urls)
            url = self.urls[index]
            try:
                async with slots[index] if slots is not None else contextlib.nullcontext():
                    response = await client.post(url + path, json=payload)
                if response.status_code >= 500:
                    raise _Retryable(f"HTTP {response.status_code}: {response.text[:200]}")
                if response.status_code >= 400:
                    raise RolloutError(
                        f"{url}{path} refused the request (HTTP {response.status_code}): {response.text[:500]}"
                    )
                try:
                    body = response.json()
                except ValueError:
                    raise _Retryable(f"reply is not JSON: {response.text[:100]!r}") from None
                return parse(body)
            except (httpx.TransportError, _Retryable) as e:
                last = f"{url}: {type(e).__name__}: {e}"
                if attempt < self.max_retries:
                    self.retries += 1
                    delay = self.backoff_s * 2**attempt
                    log.warning(
                        "rollout request failed (%s); retry %d/%d in %.1fs", last, attempt + 1, self.max_retries, delay
                    )
                    await asyncio.sleep(delay)
        raise RolloutError(f"{path} failed after {self.max_retries + 1} attempts; last error: {last}")

    def _parse(
        self, prompt: list[int], seed: int, reply: dict, *, routed: bool, expected_version: str, routing_from: int = 0
    ) -> Sample:
        """A ``/generate`` reply as a :class:`Sample`; ``_Retryable`` for an error body, an
        aborted request or a malformed reply; final errors for stale weights or missing
        routing (the server's configuration, which a retry cannot change)."""
        if not isinstance(reply, dict) or "error" in reply or reply.get("object") == "error":
            raise _Retryable(f"error reply: {str(reply)[:200]}")
        try:
            meta = reply["meta_info"]
            output_ids = [int(t) for t in reply["output_ids"]]
            entries = meta["output_token_logprobs"]
            logprobs = [float(x[0]) for x in entries]  # a null log-prob is a TypeError here
            if [int(x[1]) for x in entries] != output_ids:
                raise ValueError("output_token_logprobs do not match output_ids")
            finish = meta["finish_reason"]
            finish = finish.get("type", "stop") if isinstance(finish, dict) else str(finish)
            version = str(meta.get("weight_version", ""))
            encoded = meta.get("routed_experts") if routed else None
            routed_experts = (
                self._decode_routing(encoded, len(prompt) + len(output_ids) - 1 - routing_from) if encoded else None
            )
        except (KeyError, TypeError, IndexError, ValueError) as e:
            raise _Retryable(f"malformed /generate reply ({type(e).__name__}: {e})") from None
        if finish == "abort":
            raise _Retryable("the server aborted the request")
        if routed and routed_experts is None:
            raise RolloutError(
                "the server returned no routed_experts: start it with --enable-return-routed-experts (routing replay r3 needs them)"
            )
        if self.check_weight_version and version != expected_version:
            raise StaleWeightsError(
                f"a sample was generated with weight_version {version!r}, expected {expected_version!r}: "
                "the batch would train on the wrong weights"
            )
        return Sample(prompt, output_ids, logprobs, finish, version, seed, routed_experts=routed_experts)

    def _decode_routing(self, encoded: str, positions: int) -> Tensor:
        """SGLang's routed experts in the smallest integer type for ``num_experts`` (int32
        when it is not known), checked: one row per position, ``top_k`` distinct expert ids
        per layer, each below ``num_experts`` (when known). Vectorised, ~25 ms for 8k
        tokens x 48 layers x top-8 (``tools/bench/routing.py``): cheap enough for the event loop."""
        assert self.num_layers is not None and self.top_k is not None  # checked when routing was asked for
        experts = decode_routed_experts(encoded, self.num_layers, self.top_k, self.num_experts)
        if experts.shape[0] != positions:
            raise ValueError(
                f"routed_experts covers {experts.shape[0]} positions, expected prompt+output-1-routed_experts_start_len = {positions}"
            )
        if repeats_an_expert(experts):
            raise ValueError("routed_experts repeats an expert within a token's top-k")
        return experts

    # ------------------------------------------------------------ control

    def _get_info(self, kind: str) -> list[dict]:
        """Every server's ``/model_info`` or ``/server_info`` (``kind``: model | server);
        a server without it (SGLang before 0.5.23) is asked the deprecated ``/get_*`` name."""
        replies = []
        with httpx.Client(timeout=self.timeout) as client:
            for url in self.urls:
                for path in _INFO_PATHS[kind]:
                    try:
                        response = client.get(url + path)
                        if response.status_code == 404 and path != _INFO_PATHS[kind][-1]:
                            continue
                        replies.append(response.raise_for_status().json())
                        break
                    except (httpx.HTTPError, ValueError) as e:
                        raise RolloutError(f"{url}{path}: {type(e).__name__}: {e}") from None
        return replies

    def _post_all(self, path: str, payload: dict | None = None, *, check_success: bool = True) -> list[dict]:
        """``payload`` to every server in turn; the first failure is raised once every server
        was asked (one server's refusal must not leave the others' weight-update sessions open)."""
        replies, failures = [], []
        with httpx.Client(timeout=self.timeout) as client:
            for url in self.urls:
                try:
                    response = client.post(url + path, json=payload or {})
                except httpx.TransportError as e:
                    failures.append(f"{url}{path}: {type(e).__name__}: {e}")
                    continue
                try:
                    body = response.json()
                except ValueError:
                    body = None
                body = body if isinstance(body, dict) else {}  # /flush_cache answers a bare string
                if response.status_code >= 400 or (check_success and body.get("success") is False):
                    failures.append(
                        f"{url}{path} failed (HTTP {response.status_code}): {body.get('message', response.text[:300])}"
                    )
                replies.append(body)
        if failures:
            raise RolloutError(failures[0])
        return replies

    def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        self._post_all(
            "/update_weights_from_disk",
            {"model_path": model_path, "weight_version": weight_version, "flush_cache": True},
        )
        self._version = weight_version

    def server_urls(self) -> list[str]:
        return list(self.urls)

    def server_ranks(self) -> list[int]:
        """How many ranks each server has in a weight-update group (its TP size; read once)."""
        if self._server_ranks is None:
            self._server_ranks = self._read_server_ranks()
        return self._server_ranks

    def _read_server_ranks(self) -> list[int]:
        sizes = []
        for url, info in zip(self.urls, self._get_info("server")):
            for key in ("pp_size", "dp_size"):
                if int(info.get(key) or 1) > 1:
                    raise RolloutError(
                        f"{url}: distributed weight sync to a server with {key}={info[key]} is not supported; use rollout.weight_sync=disk"
                    )
            sizes.append(int(info.get("tp_size") or 1))
        return sizes

    def server_nccl_versions(self) -> list[str | None]:
        """Each server's NCCL version where its probe (a server this run started: its
        python asked) knows it, else ``None``: SGLang does not report it."""
        return [probe() for probe in self._nccl_probes]

    def init_weights_update_group(
        self, master_address: str, master_port: int, group_name: str, backend: str, join: Callable[[int], Any]
    ) -> Any:
        """Every server's ranks join ``group_name`` (server i's TP rank r as
        ``1 + sum(previous servers' TP sizes) + r``) while ``join(world_size)`` makes this
        process rank 0; the requests block until every rank has joined, so they are all in
        flight at once. Returns what ``join`` returns (the group). ``join`` runs on a thread
        of its own: a server that refuses is reported at once, not after the rendezvous'
        timeout."""
        offsets, world_size = weight_group_offsets(self.server_ranks())
        payloads = [
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            }
            for offset in offsets
        ]
        try:
            return self._post_each(
                "/init_weights_update_group", payloads, lambda: join(world_size), abandon=leave_group_when_made
            )
        except RolloutError:
            raise
        except (OSError, RuntimeError, ValueError) as e:  # the rendezvous itself (e.g. its timeout)
            raise RolloutError(
                f"joining weight-update group {group_name} at {master_address}:{master_port} failed: {type(e).__name__}: {e}"
            ) from e

    def destroy_weights_update_group(self, group_name: str) -> None:
        """Ask every server to leave ``group_name`` (best effort: SGLang versions without
        ``/destroy_weights_update_group`` keep it, which costs them only the idle group)."""
        try:
            self._post_all("/destroy_weights_update_group", {"group_name": group_name}, check_success=False)
        except RolloutError as e:
            log.info("servers kept weight-update group %s: %s", group_name, e)

    @contextlib.contextmanager
    def weight_update(self, weight_version: str) -> Iterator[None]:
        """Generation paused, inside ``/begin_weight_update`` .. ``/end_weight_update``;
        afterwards every server must report ``weight_version``. When anything inside fails,
        the servers are asked to end, flush and continue, best effort (the failure stands)."""
        try:
            self._post_all("/pause_generation", check_success=False)
            self._post_all("/begin_weight_update")
            yield
        except BaseException:
            self._leave_failed_update()
            raise
        try:
            self._post_all("/end_weight_update")
        finally:  # never leave the servers paused
            self._post_all("/flush_cache", check_success=False)
            self._post_all("/continue_generation", check_success=False)
        self._version = weight_version
        served = self.read_weight_version()
        if served != weight_version:
            raise RolloutError(
                f"after the weight update the servers serve weight_version {served!r}, not {weight_version!r}"
            )

    def _leave_failed_update(self, timeout_s: float = 5.0) -> None:
        """After a failed update (a refused begin or bucket): every server at once is asked to
        end its session, flush and continue generating, each request within ``timeout_s`` (a
        server still waiting in a broadcast cannot answer); what fails is only logged."""

        def leave(url: str) -> None:
            with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=2.0)) as client:
                for path in ("/end_weight_update", "/flush_cache", "/continue_generation"):
                    try:
                        response = client.post(url + path, json={})
                    except httpx.TransportError as e:
                        log.warning("%s%s after a failed weight update: %s: %s", url, path, type(e).__name__, e)
                        return
                    if response.status_code >= 400:  # e.g. no session open (its begin was refused)
                        log.info("%s%s after a failed weight update: %s", url, path, response.text[:200])

        concurrent.futures.wait([on_daemon_thread(leave, url) for url in self.urls], timeout=3 * timeout_s + 5)

    def update_weights_from_distributed(
        self,
        tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        broadcast: Callable[[], None],
        *,
        group_name: str,
        weight_version: str,
        flattened: bool = False,
    ) -> None:
        """Announce ``tensors`` (name, dtype, shape) to every server, then ``broadcast()``
        them over ``group_name`` from its rank 0 (the trainer's collective, while the servers
        wait in their requests; a no-op here when another process of the trainer is that
        rank 0): ``flattened``, as one flat byte buffer of the tensors in this order (each at a
        byte offset that is a multiple of its element size), else one broadcast per tensor.
        Call inside :meth:`weight_update`."""
        body = {
            "names": [name for name, _, _ in tensors],
            "dtypes": [str(dtype).removeprefix("torch.") for _, dtype, _ in tensors],
            "shapes": [list(shape) for _, _, shape in tensors],
            "group_name": group_name,
            "weight_version": weight_version,
            "flush_cache": False,
        }
        if flattened:
            body["load_format"] = "flattened_bucket"
        try:
            self._post_each("/update_weights_from_distributed", [body] * len(self.urls), broadcast)
        except RolloutError:
            raise
        except (OSError, RuntimeError, ValueError) as e:  # the broadcast itself (e.g. its group's timeout)
            raise RolloutError(
                f"broadcasting a bucket over weight-update group {group_name} failed: {type(e).__name__}: {e}"
            ) from e

    def update_weights_from_tensor(
        self, serialized: str | Sequence[Sequence[str]], *, weight_version: str, flattened: bool = False
    ) -> None:
        """Hand every server one bucket by reference, in SGLang's ``MultiprocessingSerializer``
        form: ``serialized[s][i]`` is what TP rank i of server s maps (each from the GPU it
        runs on, where a trainer rank shares it), or one string every TP rank of every server
        maps. A payload is a ``{flattened_tensor, metadata}`` bucket (``flattened``), else a list
        of ``(name, tensor)``. Servers on this node only; call inside :meth:`weight_update`."""
        sizes = self.server_ranks()
        per_server = [[serialized] * size for size in sizes] if isinstance(serialized, str) else serialized
        for url, size, entries in zip(self.urls, sizes, per_server, strict=True):
            if len(entries) != size:
                raise RolloutError(f"{url} has {size} TP ranks but {len(entries)} weight payloads were made for it")
        load_format = "flattened_bucket" if flattened else None
        payloads = [
            {
                "serialized_named_tensors": list(entries),
                "load_format": load_format,
                "flush_cache": False,
                "weight_version": weight_version,
            }
            for entries in per_server
        ]
        self._post_each("/update_weights_from_tensor", payloads)

    def supports_flattened_buckets(self) -> bool:
        """Every server takes a bucket as one flat buffer (SGLang 0.5.6 on; an older or
        unknown version gets one broadcast per tensor)."""
        return all(sglang_version(info.get("version")) >= FLATTENED_BUCKETS_SINCE for info in self._get_info("server"))

    def release_memory_occupation(self, tags: Sequence[str]) -> None:
        """Servers free the GPU memory ``tags`` name (``weights``, ``kv_cache``,
        ``cuda_graph``) for a colocated trainer; needs ``--enable-memory-saver``. Always
        named: SGLang releases all three for no tags, and each must be taken back."""
        self._post_all("/release_memory_occupation", {"tags": list(tags)})

    def resume_memory_occupation(self, tags: Sequence[str]) -> None:
        """Servers take back the memory ``tags`` name."""
        self._post_all("/resume_memory_occupation", {"tags": list(tags)})

    def _post_each(
        self,
        path: str,
        payloads: Sequence[dict],
        while_waiting: Callable[[], Any] | None = None,
        *,
        abandon: Callable[[concurrent.futures.Future], None] | None = None,
    ) -> Any:
        """``payloads[i]`` to server ``i``, all in flight at once; without ``while_waiting``
        every request has been answered when this returns or raises. Requests that block until
        this process acts (a rendezvous, a broadcast) run ``while_waiting()`` meanwhile, on a
        thread of its own (the caller's CUDA stream), whose result is returned once it and
        every request succeeded. A failed request is raised as soon as it fails, never after
        waiting in a rendezvous or collective that a refusing server will not enter:
        ``abandon`` is then handed ``while_waiting``'s future (running or done)."""
        requests = [on_daemon_thread(self._post_one, url, path, payload) for url, payload in zip(self.urls, payloads)]
        if while_waiting is None:
            concurrent.futures.wait(requests)
            for f in requests:
                f.result()
            return None
        return unless_refused(requests, on_daemon_thread(while_waiting), abandon)

    def _post_one(self, url: str, path: str, payload: dict) -> dict:
        try:
            with httpx.Client(timeout=self.timeout) as client:
                response = client.post(url + path, json=payload)
        except httpx.TransportError as e:
            raise RolloutError(f"{url}{path}: {type(e).__name__}: {e}") from None
        try:
            body = response.json()
        except ValueError:
            body = None
        body = body if isinstance(body, dict) else {}  # some endpoints answer a bare string
        if response.status_code >= 400 or body.get("success") is False:
            raise RolloutError(
                f"{url}{path} failed (HTTP {response.status_code}): {body.get('message', response.text[:300])}"
            )
        return body

    def returns_routed_experts(self) -> bool:
        """Every server was started with ``--enable-return-routed-experts``."""
        return not self.servers_without_routed_experts()

    def servers_without_routed_experts(self) -> list[str]:
        """The servers whose ``/server_info`` says they do not return routed experts."""
        infos = self._get_info("server")
        return [url for url, info in zip(self.urls, infos) if not info.get("enable_return_routed_experts", False)]

    def wait_healthy(self, timeout_s: float = 300.0, poll_s: float = 1.0) -> None:
        """Block until every server answers ``/health_generate``; a clear error after
        ``timeout_s``. A server that does not answer at once is named in one warning (an
        attached URL nobody listens on would otherwise wait in silence)."""
        import time

        deadline = time.monotonic() + timeout_s
        pending = list(self.urls)
        last, warned = "", False
        with httpx.Client(timeout=httpx.Timeout(10.0, connect=2.0)) as client:
            while pending:
                for url in list(pending):
                    try:
                        status = client.get(url + "/health_generate").status_code
                        if status == 200:
                            pending.remove(url)
                        else:
                            last = f"HTTP {status}"
                    except httpx.TransportError as e:
                        last = f"{type(e).__name__}: {e}"
                if pending and time.monotonic() > deadline:
                    raise RolloutError(
                        f"SGLang server(s) {pending} not healthy after {timeout_s:.0f}s ({last or 'no answer'})"
                    )
                if pending and not warned:
                    log.warning("waiting up to %.0fs for SGLang server(s) %s (%s)", timeout_s, pending, last)
                    warned = True
                if pending:
                    time.sleep(poll_s)

    def close(self) -> None:
        """Abort this engine's requests that are still running on the servers (cancelled
        by an interrupt), best effort; other clients' requests on a shared server stay."""
        rids, self._unfinished = sorted(self._unfinished), set()
        if not rids:
            return
        with httpx.Client(timeout=httpx.Timeout(5.0, connect=2.0)) as client:
            for url in self.urls:
                for rid in rids:
                    try:
                        client.post(url + "/abort_request", json={"rid": rid})
                    except httpx.TransportError:
                        break


# SGLang 0.5.23's names first; its deprecated ones (the only ones of older servers) second
_INFO_PATHS = {"model": ("/model_info", "/get_model_info"), "server": ("/server_info", "/get_server_info")}


def sglang_version(text: object) -> tuple[int, ...]:
    """``"0.5.23"`` / ``"0.5.6.post1"`` -> ``(0, 5, 23)`` / ``(0, 5, 6)``; ``()`` when unknown."""
    found = re.match(r"(\d+)\.(\d+)\.(\d+)", str(text or ""))
    return tuple(int(part) for part in found.groups()) if found else ()


def weight_group_offsets(server_ranks: Sequence[int]) -> tuple[list[int], int]:
    """Each server's ``rank_offset`` in a weight-update group whose rank 0 is the trainer's
    sender, and the group's size: ``[1, 1 + n0, 1 + n0 + n1, ...]``, ``1 + sum(n)``."""
    offsets, next_rank = [], 1
    for n in server_ranks:
        if n < 1:
            raise ValueError(f"a server has {n} ranks")
        offsets.append(next_rank)
        next_rank += n
    return offsets, next_rank
