"""Multi-turn requests to SGLang servers: each turn one ``/generate`` request, sent to the
server that already holds its prefix (a prompt's samples and turns share that server's
prefix cache)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Protocol, Sequence

import httpx
import numpy as np

from moe_rl.rollout.types import Sample, SamplingParams


class TurnRequests(Protocol):
    """What :class:`HttpTurns` asks of its engine (:class:`~moe_rl.rollout.sglang.engine.SGLangEngine`)."""

    def take_server(self) -> int:
        """The next server in turn."""
        ...

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
    ) -> Sample: ...


class HttpTurns:
    """:class:`TurnSource` of an :class:`~moe_rl.rollout.sglang.engine.SGLangEngine`: one request per turn, each on the
    server of the first request whose tokens it starts with (a sample's first turn, or
    its prompt's first sample), so a prompt's samples and turns share that server's prefix
    cache; a request that continues none takes the next server."""

    def __init__(
        self,
        engine: TurnRequests,
        client: httpx.AsyncClient,
        slots: list[asyncio.Semaphore],
        routed: bool,
        expected: str,
    ) -> None:
        self.engine, self.client, self.slots, self.routed, self.expected = engine, client, slots, routed, expected
        self._ids = itertools.count()
        self._server_of: dict[tuple[int, int], int] = {}  # a first request's (length, tokens' hash) -> its server
        self._lengths: list[int] = []  # their lengths, longest first

    async def generate(
        self, token_ids: Sequence[int], params: SamplingParams, *, seed: int, routing_from: int = 0
    ) -> Sample:
        params.validate()
        rid = f"moe-rl-turn-{seed}-{next(self._ids)}."  # (none the start of another: SGLang aborts by prefix)
        return await self.engine._request(
            self.client,
            self.slots,
            token_ids,
            seed,
            params=params,
            routed=self.routed,
            expected_version=self.expected,
            rid=rid,
            server=self.server_for(token_ids),
            routing_from=routing_from,
        )

    def server_for(self, token_ids: Sequence[int]) -> int:
        """The server of the longest first request that ``token_ids`` start with; else the
        next server, remembered for the requests that will continue these tokens. Each
        request's prefixes are hashed once, in one pass (not a slice per remembered length)."""
        prefix = prefix_hashes(token_ids)
        for length in self._lengths:
            if length <= len(prefix) and (server := self._server_of.get((length, prefix[length - 1]))) is not None:
                return server
        server = self._server_of[(len(prefix), prefix[-1] if prefix else 0)] = self.engine.take_server()
        if len(prefix) not in self._lengths:
            self._lengths = sorted([*self._lengths, len(prefix)], reverse=True)
        return server


_HASH_BASE = 0x100000001B3  # odd: invertible modulo 2**64
_HASH_BASE_INVERSE = pow(_HASH_BASE, -1, 2**64)


def prefix_hashes(token_ids: Sequence[int]) -> list[int]:
    """``h[i]``: a 64-bit polynomial hash of ``token_ids[: i + 1]`` (sum of ``t_j B^(i-j)``
    modulo 2**64), all prefixes in one vectorised pass: ``B^i`` times the running sum of
    ``t_j B^-j`` (numpy's unsigned arithmetic wraps modulo 2**64)."""
    tokens = np.asarray(token_ids, dtype=np.uint64)
    if tokens.size == 0:
        return []
    powers = np.cumprod(np.full(tokens.size, _HASH_BASE, dtype=np.uint64))  # B^1 .. B^n
    inverse = np.cumprod(np.full(tokens.size, _HASH_BASE_INVERSE, dtype=np.uint64))  # B^-1 .. B^-n
    scaled = tokens * np.concatenate([np.ones(1, dtype=np.uint64), inverse[:-1]])  # t_j B^-j
    return (np.cumsum(scaled, dtype=np.uint64) * np.concatenate([np.ones(1, dtype=np.uint64), powers[:-1]])).tolist()
