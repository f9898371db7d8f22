"""Requests that block until this process acts (an SGLang server joining a rendezvous or
receiving a broadcast that this process hosts or sends): waited on beside that work, each
on a daemon thread, so that a server's refusal is seen at once."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from typing import Any, Callable

import torch


def on_daemon_thread(fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
    """``fn(*args)`` on a daemon thread (unlike a thread pool's, it never holds up the
    interpreter's exit: a request or collective left blocked ends with the process), on the
    caller's CUDA device and stream where CUDA is in use (a collective there is ordered after
    the work the caller queued)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    stream = torch.cuda.current_stream() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def run() -> None:
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            future.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    return future


def unless_refused(
    requests: list[concurrent.futures.Future],
    work: concurrent.futures.Future,
    abandon: Callable[[concurrent.futures.Future], None] | None,
) -> Any:
    """``work``'s result once it and every request succeeded; a failed request is raised as
    soon as it fails (``abandon(work)`` first), a failed ``work`` as soon as it fails."""
    concurrent.futures.wait([work, *requests], return_when=concurrent.futures.FIRST_EXCEPTION)
    failed = [f for f in requests if f.done() and f.exception() is not None]
    if failed:
        if abandon is not None:
            abandon(work)
        failed[0].result()
    result = work.result()
    for f in requests:
        f.result()
    return result


def leave_group_when_made(join: concurrent.futures.Future) -> None:
    """Leave the weight-update group an abandoned ``join`` makes (one no server will use)."""

    def leave(done: concurrent.futures.Future) -> None:
        if done.exception() is None:
            from parallel.weight_update_group import leave_weight_update_group

            leave_weight_update_group(done.result())

    join.add_done_callback(leave)
