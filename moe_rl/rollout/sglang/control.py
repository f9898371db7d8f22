"""Requests every SGLang server of an engine answers alike: its info, the weight version it
serves, its health, and a control post sent to each in turn."""

from __future__ import annotations

import logging
from typing import Sequence

import httpx

from moe_rl.rollout.types import RolloutError

log = logging.getLogger(__name__)

# SGLang 0.5.23's names first; its deprecated ones (the only ones of older servers) second
_INFO_PATHS = {"model": ("/model_info", "/get_model_info"), "server": ("/server_info", "/get_server_info")}


class ServerControl:
    """The servers at ``urls`` and what every part of :class:`~moe_rl.rollout.sglang.engine.SGLangEngine`
    asks all of them."""

    def __init__(
        self, urls: Sequence[str], *, weight_version: str | None, timeout_s: float, connect_timeout_s: float
    ) -> None:
        if not urls:
            raise ValueError("rollout.sglang.urls is empty: give at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self._version = weight_version
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)

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

    def server_urls(self) -> list[str]:
        return list(self.urls)

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
