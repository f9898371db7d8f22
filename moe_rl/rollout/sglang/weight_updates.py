"""SGLang's weight-update endpoints: a HF directory re-read from disk, a weight-update group
joined for broadcasts, buckets handed over by reference, all inside a paused update session
whose served version is checked after."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import re
from typing import Any, Callable, Iterator, Sequence

import httpx
import torch

from moe_rl.rollout.sglang.control import ServerControl
from moe_rl.rollout.sglang.waits import leave_group_when_made, on_daemon_thread, unless_refused
from moe_rl.rollout.types import RolloutError

log = logging.getLogger(__name__)

# the first SGLang that receives a distributed bucket as one flat broadcast (load_format
# "flattened_bucket" in /update_weights_from_distributed: the 0.5.5.post3 wheel lacks it, the
# 0.5.6 wheel has it). An older server ignores the field and would read the bytes as separate tensors.
FLATTENED_BUCKETS_SINCE = (0, 5, 6)


class WeightUpdateEndpoints(ServerControl):
    """New weights into every server (SGLang's ``/update_weights_from_*`` and their session)."""

    _buckets_sent = 0  # bucket requests of the weight-update session in progress

    def _init_weight_updates(self, nccl_version_probes: Sequence[Callable[[], str | None]] | None) -> None:
        """Each server's ranks (read when first needed) and how to learn its NCCL version."""
        self._server_ranks: list[int] | None = None
        # per server, how to learn its NCCL version (asked only before an NCCL weight-update group)
        self._nccl_probes = list(nccl_version_probes or [lambda: None] * len(self.urls))
        if len(self._nccl_probes) != len(self.urls):
            raise ValueError(f"{len(self._nccl_probes)} NCCL version probes for {len(self.urls)} servers")

    def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        self._post_all(
            "/update_weights_from_disk",
            {"model_path": model_path, "weight_version": weight_version, "flush_cache": True},
        )
        self._version = weight_version

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
                        f"{url}: distributed weight sync to a server with {key}={info[key]} is not supported; use rollout.weight_sync.method=disk"
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
        """Generation paused, inside ``/begin_weight_update`` .. ``/end_weight_update``; then
        every server is labelled ``weight_version`` (only now: SGLang writes each bucket into
        the live model, so a label sent with a bucket would name weights not all there yet)
        and must report it. When anything inside fails, each server is labelled
        ``incomplete-<weight_version>`` (its weights may be part old, part new) and asked to end,
        flush and continue, best effort (the failure stands); before any bucket went out
        their weights are whole and keep their label."""
        self._buckets_sent = 0
        try:
            self._post_all("/pause_generation", check_success=False)
            self._post_all("/begin_weight_update")
            yield
            self._post_all("/end_weight_update")
        except BaseException:
            self._leave_failed_update(weight_version if self._buckets_sent else None)
            raise
        try:
            self._post_all("/update_weight_version", {"new_version": weight_version, "abort_all_requests": False})
        finally:  # never leave the servers paused
            self._post_all("/flush_cache", check_success=False)
            self._post_all("/continue_generation", check_success=False)
        self._version = weight_version
        served = self.read_weight_version()
        if served != weight_version:
            raise RolloutError(
                f"after the weight update the servers serve weight_version {served!r}, not {weight_version!r}"
            )

    def _leave_failed_update(self, weight_version: str | None, timeout_s: float = 5.0) -> None:
        """After a failed update (a refused begin, bucket or end): every server at once is
        asked to end its session, take the label ``incomplete-<weight_version>`` (unless
        ``None``: no bucket went out), flush and continue generating, each request within
        ``timeout_s`` (a server still waiting in a broadcast cannot answer); what fails is
        only logged."""
        steps: list[tuple[str, dict]] = [("/end_weight_update", {})]
        if weight_version is not None:
            label = {"new_version": f"incomplete-{weight_version}", "abort_all_requests": False}
            steps.append(("/update_weight_version", label))
        steps += [("/flush_cache", {}), ("/continue_generation", {})]

        def leave(url: str) -> None:
            with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=2.0)) as client:
                for path, body in steps:
                    try:
                        response = client.post(url + path, json=body)
                    except httpx.TransportError as e:
                        log.warning("%s%s after a failed weight update: %s: %s", url, path, type(e).__name__, e)
                        return
                    if response.status_code >= 400:  # e.g. no session open (its begin was refused)
                        log.info("%s%s after a failed weight update: %s", url, path, response.text[:200])

        concurrent.futures.wait([on_daemon_thread(leave, url) for url in self.urls], timeout=4 * timeout_s + 5)

    def update_weights_from_distributed(
        self,
        tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        broadcast: Callable[[], None],
        *,
        group_name: str,
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
            "flush_cache": False,
        }
        if flattened:
            body["load_format"] = "flattened_bucket"
        self._buckets_sent += 1
        try:
            self._post_each("/update_weights_from_distributed", [body] * len(self.urls), broadcast)
        except RolloutError:
            raise
        except (OSError, RuntimeError, ValueError) as e:  # the broadcast itself (e.g. its group's timeout)
            raise RolloutError(
                f"broadcasting a bucket over weight-update group {group_name} failed: {type(e).__name__}: {e}"
            ) from e

    def update_weights_from_tensor(self, serialized: str | Sequence[Sequence[str]], *, flattened: bool = False) -> None:
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
            }
            for entries in per_server
        ]
        self._buckets_sent += 1
        self._post_each("/update_weights_from_tensor", payloads)

    def supports_flattened_buckets(self) -> bool:
        """Every server takes a bucket as one flat buffer (SGLang 0.5.6 on; an older or
        unknown version gets one broadcast per tensor)."""
        return all(sglang_version(info.get("version")) >= FLATTENED_BUCKETS_SINCE for info in self._get_info("server"))

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
