"""Generation on SGLang servers: ``/generate`` requests with retries, their replies parsed
into :class:`Sample` objects (routed experts decoded and checked), prompts spread over the
servers, and what an interrupt left running aborted."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
from typing import Any, AsyncIterator, Callable, Sequence

import httpx
from torch import Tensor

from moe_rl.rollout.sglang.control import ServerControl
from moe_rl.rollout.sglang.turns import HttpTurns
from moe_rl.rollout.types import (
    GenerationRequest,
    GroupCallback,
    GroupProgress,
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

# SGLang drops an abort whose rid it has not registered yet (a request still on its way:
# a new connection, a retry's backoff); a repeat of one that took effect is a no-op there.
# So aborts are sent again, these many seconds apart (doubling), until each request answered.
ABORT_REPEAT_S = 0.1
ABORT_REPEAT_MAX_S = 2.0
# aborts go over a client of their own: the generation's pool may be all taken by the
# requests they stop, and a server that does not answer an abort at once (an empty reply) is
# not waited for the generation's request timeout (rollout.server.request_timeout_s) each round
ABORT_TIMEOUT = httpx.Timeout(10.0, connect=2.0)


class _Retryable(Exception):
    """A failure the next attempt, on the next server, may not repeat."""


class GenerationClient(ServerControl):
    """Samples from the servers, at most ``concurrency_per_server`` requests in flight on each."""

    def _init_generation(
        self,
        *,
        num_layers: int | None,
        top_k: int | None,
        num_experts: int | None,
        max_concurrency: int,
        max_retries: int,
        backoff_s: float,
        check_weight_version: bool,
    ) -> None:
        """The served model's routing shape, the concurrency limit, retries and the version check."""
        self.num_layers, self.top_k, self.num_experts = num_layers, top_k, num_experts
        self._unfinished: set[str] = set()  # request ids sent and not answered (aborted by close())
        self.max_concurrency = max_concurrency
        # requests in flight per server; the connection pool holds that many per server
        self.concurrency_per_server = max(1, math.ceil(max_concurrency / len(self.urls)))
        self._next_server = 0  # the server the next prompt goes to (prompts take them in turn)
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self.check_weight_version = check_weight_version
        self._rr = itertools.count()
        self.retries = 0
        self._aborting: set[str] = set()  # request ids this client aborted: their replies keep what they had
        self._calls = itertools.count()  # partial-rollout calls (their request ids)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        params: SamplingParams,
        *,
        seed: int,
        return_routed_experts: bool = False,
        on_group: GroupCallback | None = None,
    ) -> list[list[Sample]]:
        """Every sample its own request; ``on_group`` as each prompt's last request is answered."""
        params.validate()
        if return_routed_experts and (self.num_layers is None or self.top_k is None):
            raise ValueError("routed experts need num_layers and top_k of the served model")
        expected = self.weight_version
        return asyncio.run(self._generate(prompts, n, params, seed, return_routed_experts, expected, on_group))

    async def _generate(
        self, prompts, n, params, seed, routed, expected_version: str, on_group: GroupCallback | None
    ) -> list[list[Sample]]:
        async with self._client() as client:
            slots = self._server_slots()
            servers = [self.take_server() for _ in prompts]  # a prompt's samples on one server
            request = functools.partial(
                self._request, client, slots, params=params, routed=routed, expected_version=expected_version
            )
            # (every rid ends in ".": SGLang aborts all the rids that start with the one named)
            return await run_groups(
                lambda i, j: request(
                    prompts[i], sample_seed(seed, i, j, n), rid=f"moe-rl-{seed}-{i}-{j}.", server=servers[i]
                ),
                len(prompts),
                n,
                on_group,
            )

    def generate_requests(
        self,
        requests: Sequence[GenerationRequest],
        params: Sequence[SamplingParams],
        *,
        routed: bool,
        groups_needed: int,
    ) -> list[Sample]:
        """Every request its own ``/generate``; once ``groups_needed`` groups are done the
        requests still running are aborted (``/abort_request`` by ``rid``, repeated until each
        replied with the tokens it had) and those not yet sent are not sent."""
        for p in set(params):
            p.validate()
        if routed and (self.num_layers is None or self.top_k is None):
            raise ValueError("routed experts need num_layers and top_k of the served model")
        expected = self.weight_version
        return asyncio.run(self._generate_requests(requests, params, routed, expected, groups_needed))

    async def _generate_requests(
        self,
        requests: Sequence[GenerationRequest],
        params: Sequence[SamplingParams],
        routed: bool,
        expected: str,
        groups_needed: int,
    ) -> list[Sample]:
        call = next(self._calls)
        # SGLang aborts every request whose rid starts with the one named: none may start another's
        rids = [f"moe-rl-partial-{call}-{k}-{r.seed}." for k, r in enumerate(requests)]
        server_of = {g: self.take_server() for g in dict.fromkeys(r.group for r in requests)}
        progress = GroupProgress([r.group for r in requests], groups_needed)
        results: list[Sample | None] = [None] * len(requests)
        running: dict[str, int] = {}  # sent, not answered: rid -> server
        async with self._client() as client, httpx.AsyncClient(timeout=ABORT_TIMEOUT) as aborts:
            slots = self._server_slots()

            async def stop_the_rest() -> None:
                """Abort every request still running, again until each has answered."""
                pause = ABORT_REPEAT_S
                while running:
                    aborting = list(running.items())
                    self._aborting.update(rid for rid, _ in aborting)
                    await asyncio.gather(
                        *(aborts.post(self.urls[s] + "/abort_request", json={"rid": rid}) for rid, s in aborting),
                        return_exceptions=True,
                    )
                    await asyncio.sleep(pause)
                    pause = min(2 * pause, ABORT_REPEAT_MAX_S)

            async def one(k: int) -> None:
                r, rid, server = requests[k], rids[k], server_of[requests[k].group]
                async with slots[server]:
                    if progress.enough():  # never sent
                        return
                    running[rid] = server
                    self._unfinished.add(rid)
                    try:
                        sample = results[k] = await self._post_with_retries(
                            client,
                            "/generate",
                            self._payload(r.token_ids, r.seed, params[k], routed, rid, r.routing_from),
                            functools.partial(
                                self._parse,
                                r.token_ids,
                                r.seed,
                                routed=routed,
                                expected_version=expected,
                                routing_from=r.routing_from,
                                rid=rid,
                            ),
                            server=server,
                            on_attempt=functools.partial(running.__setitem__, rid),  # a retry's server gets the aborts
                        )
                    finally:
                        running.pop(rid, None)
                        self._unfinished.discard(rid)
                        self._aborting.discard(rid)
                if sample.finish_reason != "abort" and progress.finish([k]) and not progress.done[groups_needed:]:
                    await stop_the_rest()  # (once: when the needed-th group is done)

            tasks = [asyncio.ensure_future(one(k)) for k in range(len(requests))]
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
        return [s if s is not None else r.not_started(expected) for s, r in zip(results, requests)]

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
        payload = self._payload(prompt, seed, params, routed, rid, routing_from)
        parse = functools.partial(
            self._parse, list(prompt), seed, routed=routed, expected_version=expected_version, routing_from=routing_from
        )
        self._unfinished.add(rid)  # until answered: close() aborts what an interrupt left running
        sample = await self._post_with_retries(client, "/generate", payload, parse, server=server, slots=slots)
        self._unfinished.discard(rid)
        return sample

    @staticmethod
    def _payload(
        prompt: Sequence[int], seed: int, params: SamplingParams, routed: bool, rid: str, routing_from: int
    ) -> dict:
        """A ``/generate`` request body (``n=1``)."""
        payload: dict[str, Any] = {
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
        return payload

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
        on_attempt: Callable[[int], Any] | None = None,
    ) -> Any:
        """``parse(reply)`` of the first good reply, asking server ``server`` first (default:
        each in turn) within its slot of ``slots``; transport errors, 5xx, replies that are
        not JSON and replies ``parse`` finds malformed or aborted are retried on the next
        server with exponential backoff; 4xx is final. ``on_attempt(server)`` before each
        attempt is sent."""
        start = next(self._rr) if server is None else server
        last = ""
        for attempt in range(self.max_retries + 1):
            index = (start + attempt) % len(self.urls)
            url = self.urls[index]
            try:
                async with slots[index] if slots is not None else contextlib.nullcontext():
                    if on_attempt is not None:
                        on_attempt(index)
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
        self,
        prompt: list[int],
        seed: int,
        reply: dict,
        *,
        routed: bool,
        expected_version: str,
        routing_from: int = 0,
        rid: str = "",
    ) -> Sample:
        """A ``/generate`` reply as a :class:`Sample`; ``_Retryable`` for an error body, an
        aborted request (unless this client aborted ``rid``: then what it had) or a
        malformed reply; final errors for stale weights or missing routing (the server's
        configuration, which a retry cannot change)."""
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
                self._decode_routing(encoded, len(prompt) + len(output_ids) - 1 - routing_from)
                if encoded and output_ids
                else None
            )
        except (KeyError, TypeError, IndexError, ValueError) as e:
            raise _Retryable(f"malformed /generate reply ({type(e).__name__}: {e})") from None
        if finish == "abort" and rid not in self._aborting:
            raise _Retryable("the server aborted the request")
        if finish == "abort" and routed and routed_experts is None:
            # SGLang's abort of a request it had retracted to its waiting queue (KV cache
            # full) returns its tokens without their routing: this segment's tokens are
            # dropped, and the response continues next step from what it had before it
            output_ids, logprobs = [], []
        if routed and routed_experts is None and output_ids:
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

    def returns_routed_experts(self) -> bool:
        """Every server was started with ``--enable-return-routed-experts``."""
        return not self.servers_without_routed_experts()

    def servers_without_routed_experts(self) -> list[str]:
        """The servers whose ``/server_info`` says they do not return routed experts."""
        infos = self._get_info("server")
        return [url for url, info in zip(self.urls, infos) if not info.get("enable_return_routed_experts", False)]

    def close(self) -> None:
        """Abort this engine's requests that are still running on the servers (cancelled
        by an interrupt), best effort; other clients' requests on a shared server stay."""
        rids, self._unfinished = sorted(self._unfinished), set()
        if not rids:
            return
        self._aborting.update(rids)  # their "abort" replies are final, not retried in full
        with httpx.Client(timeout=httpx.Timeout(5.0, connect=2.0)) as client:
            for url in self.urls:
                for rid in rids:
                    try:
                        client.post(url + "/abort_request", json={"rid": rid})
                    except httpx.TransportError:
                        break
