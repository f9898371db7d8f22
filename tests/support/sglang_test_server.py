"""An SGLang-protocol test server for CPU tests, driven by moe-rl's LocalEngine.

It speaks SGLang 0.5.23's HTTP API with its field names and enforces its rules that the
client relies on: HTTP 400 for unknown ``sampling_params`` keys; tensor/distributed
weight updates only between ``/begin_weight_update`` and ``/end_weight_update``;
``output_token_logprobs`` as ``[logprob, token_id, text]``; ``finish_reason`` objects;
``routed_experts`` as base64 int32 ``[prompt + output - 1, num_layers, top_k]``
(only with ``--enable-return-routed-experts``), from ``routed_experts_start_len`` (HTTP 400
when it exceeds the input); seed 42 for requests without
``sampling_seed`` under ``--enable-deterministic-inference``. ``--precision bf16`` (not an
SGLang flag) rounds its weights to bf16 and computes in fp32, like ``rollout.precision``,
so that its routing and log-probs drift from the trainer's as a real engine's do;
``--token-delay-s S`` (not an SGLang flag) holds each /generate reply ``S`` seconds per
output token after generating it (outside the model's lock, so requests overlap as in a
batching server): a response's time grows with its length, as on a real engine (e.g.
``tools/bench/streaming_rewards.py``'s long-tailed lengths); the fault ``token_delay_s``
sets it too. ``--simulate-mismatch JSON`` (not an SGLang flag either) simulates the local engine's larger
mismatch (``rollout.simulate_mismatch``'s fields, e.g. ``{"router_flip_frac": 0.1, "logit_kl":
7.5e-4}``), calibrated at start on a warm-up generation of random prompts and again after every
weight update on what it generated.
``/init_weights_update_group`` joins the weight-update group for real (the request's
backend: gloo here) as rank ``rank_offset``, blocking until every rank joined (several
groups at once, by name); ``/update_weights_from_distributed`` receives each announced
tensor from group rank 0, or with ``load_format="flattened_bucket"`` one flat byte buffer
of them all, refusing a tensor at a byte offset that is not a multiple of its element
size (SGLang 0.5.23's ``FlattenedTensorBucket.empty``);
``/end_weight_update`` loads them into the LocalEngine, refusing an update that lacks any
weight (SGLang would load a partial one; a trainer must send them all).
``/update_weights_from_tensor`` maps SGLang's serialized tensors (shared memory on CPU), a
list of ``(name, tensor)`` or a ``flattened_bucket`` ``{flattened_tensor, metadata}``.
``/update_weight_version`` labels the weights (aborting running requests unless
``abort_all_requests`` is false). ``/release_memory_occupation`` / ``/resume_memory_occupation`` (``tags``): while any
memory is released, or after released weights until a full update, /generate fails.

Fault injection for tests (not part of SGLang): ``POST /_test/faults`` with
``fail_status`` + ``fail_count`` (answer the next N /generate with that status),
``malformed_count`` (N replies that are not JSON), ``delay_s`` (sleep before each
/generate), ``token_delay_s`` (as ``--token-delay-s``), ``late_seeds`` (``{seed: S}``: a
/generate with that ``sampling_seed`` registers its rid S seconds late, as a request still on
its way: an ``/abort_request`` before then is dropped, as SGLang drops one for an unknown rid), ``die_after`` (exit the process when the Nth next /generate arrives),
``refuse_weight_groups`` (refuse the next N ``/init_weights_update_group`` at once),
``refuse_buckets`` (answer the next N ``/update_weights_from_distributed`` HTTP 400 at once,
never entering the broadcast, as a server that does not take the request's ``load_format``),
``stall_weight_groups`` / ``stall_buckets`` (the next N of those requests wait ``stall_s``
seconds without joining the group or receiving, then are refused: a server that never joins),
``old_info_endpoints`` (404 for ``/model_info`` and ``/server_info``, as older servers),
``server_version`` (report that version; before 0.5.6 ignore ``load_format`` in
``/update_weights_from_distributed``, as those servers do). ``GET /_test/stats`` counts
requests: ``/generate`` rids in arrival order and the most in flight at once (since the
last ``/_test/faults``); per weight update request its group and whether it came flattened.
``tests/server/test_sglang_conformance.py`` checks that it answers as real SGLang 0.5.23 does.
``GET /_test/weights_digest``: a hash of the engine's weights.

    python tests/support/sglang_test_server.py --model-path DIR --port N [sglang.launch_server flags]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from moe_rl.rollout.local import LocalEngine
from moe_rl.rollout.settings import SimulatedMismatch
from moe_rl.rollout.types import SamplingParams
from moe_rl.rollout.sglang.weight_updates import FLATTENED_BUCKETS_SINCE, sglang_version
from moe_rl.rollout.weight_sync.cuda_ipc import deserialize_sglang_payload
from moe_rl.routing.encoding import encode_routed_experts
from parallel.weight_update_group import join_weight_update_group, leave_weight_update_group

SAMPLING_KEYS = {
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "n",
    "sampling_seed",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "no_stop_trim",
    "custom_params",
    "json_schema",
    "regex",
    "ebnf",
}


class State:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        precision = {"fp32": None, "bf16": torch.bfloat16}[args.precision]
        mismatch = SimulatedMismatch(**args.simulate_mismatch) if args.simulate_mismatch else None
        self.engine = LocalEngine(
            args.model_path,
            weight_version=args.weight_version,
            weight_precision=precision,
            mismatch=mismatch,
            mismatch_seed=args.random_seed,
        )
        if self.engine.mismatch is not None:
            warm_up(self.engine)
        self.lock = threading.Lock()
        self.in_weight_update = False
        self.paused = threading.Event()
        self.faults: dict = {}
        self.generate_requests = 0
        self.aborts = 0
        self.aborted: list[dict] = []  # the abort requests' bodies
        self.running: dict[str, threading.Event] = {}  # /generate rids being answered -> set when aborted
        self.groups: dict[str, object] = {}  # weight-update process groups by name
        self.received: dict[str, torch.Tensor] = {}  # broadcast weights not yet loaded
        self.version_after_update: str | None = None
        self.released: set[str] = set()  # memory kinds released (/release_memory_occupation)
        self.weights_lost = False  # released weights are gone until the next full update
        self.memory_events: list[list] = []  # [["release" | "resume", tags], ...]
        self.releases_after_updates: list[int] = []  # weight updates done before each release
        self.weight_updates = 0  # completed /update_weights_from_* sequences (and disk loads)
        self.weight_update_requests = 0  # /update_weights_from_distributed requests (buckets)
        self.update_requests: list[dict] = []  # per such request: {"group": name, "flattened": bool}
        self.generate_rids: list[str] = []  # /generate request ids in arrival order
        self.in_flight = self.max_in_flight = 0  # /generate requests being answered (most at once)
        self.count_lock = threading.Lock()

    @property
    def version(self) -> str:
        return str(self.faults.get("server_version") or "0.5.23")


class Handler(BaseHTTPRequestHandler):
    state: State
    wbufsize = 1 << 16  # one write per reply: header and body in separate packets hit delayed ACKs (~40 ms)

    def log_message(self, fmt, *a):  # quiet
        pass

    def _send(self, status: int, body, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _json(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length) or b"{}")

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def _route(self, method: str) -> None:
        st = self.state
        path = self.path.split("?")[0]
        try:
            body = self._json() if method == "POST" else {}
        except json.JSONDecodeError:
            return self._send(400, {"error": {"message": "request body is not JSON"}})
        if path in ("/health", "/health_generate"):
            return self._send(200, b"")
        if path in ("/model_info", "/server_info") and st.faults.get("old_info_endpoints"):
            return self._send(404, {"detail": "Not Found"})  # a server before 0.5.23's names
        if path in ("/model_info", "/get_model_info"):  # the get_ names are deprecated in 0.5.23
            return self._send(
                200,
                {"model_path": st.args.model_path, "is_generation": True, "weight_version": st.engine.weight_version},
            )
        if path in ("/server_info", "/get_server_info"):
            return self._send(
                200,
                {
                    "tp_size": st.args.tp_size,
                    "ep_size": st.args.ep_size,
                    "dp_size": 1,
                    "pp_size": 1,
                    "random_seed": st.args.random_seed,
                    "version": st.version,
                    "weight_version": st.args.weight_version,
                    "enable_return_routed_experts": st.args.enable_return_routed_experts,
                },
            )
        if path == "/generate":
            with st.count_lock:
                st.in_flight += 1
                st.max_in_flight = max(st.max_in_flight, st.in_flight)
                st.generate_rids.append(str(body.get("rid")))
            try:
                return self._generate(body)
            finally:
                with st.count_lock:
                    st.in_flight -= 1
        if path == "/update_weights_from_disk":
            return self._send(*_load_from_disk(st, body))
        if path == "/begin_weight_update":
            if st.in_weight_update:
                return self._send(
                    400,
                    {
                        "success": False,
                        "message": "a weight-update session is already open; call end_weight_update() first",
                    },
                )
            st.in_weight_update = True
            return self._send(200, {"success": True, "message": "Success"})
        if path == "/end_weight_update":
            if not st.in_weight_update:
                return self._send(
                    400,
                    {"success": False, "message": "no weight-update session is open; call begin_weight_update() first"},
                )
            st.in_weight_update = False
            return self._send(*_apply_received(st))
        if path == "/init_weights_update_group":
            return self._send(*_join_group(st, body))
        if path == "/destroy_weights_update_group":
            if body.get("group_name") not in st.groups:
                return self._send(400, {"success": False, "message": "The group to be destroyed does not exist."})
            leave_weight_update_group(st.groups.pop(body.get("group_name")))
            return self._send(200, {"success": True, "message": "Succeeded to destroy custom process group."})
        if path in ("/update_weights_from_distributed", "/update_weights_from_tensor"):
            if not st.in_weight_update:
                return self._send(
                    400,
                    {
                        "success": False,
                        "message": f"{path.strip('/')} must run between begin_weight_update() and end_weight_update()",
                    },
                )
            status, reply = _receive_broadcast(st, body) if path.endswith("distributed") else _receive_tensors(st, body)
            if status != 200:
                return self._send(status, reply)
            if body.get("weight_version") is not None:
                st.version_after_update = str(body["weight_version"])
            return self._send(200, {"success": True, "message": "Succeeded to update parameter online."})
        if path in ("/release_memory_occupation", "/resume_memory_occupation"):
            return self._send(*_memory_occupation(st, path, body))
        if path == "/pause_generation":
            st.paused.set()
            return self._send(200, {"message": "Generation paused successfully.", "status": "ok"})
        if path == "/continue_generation":
            st.paused.clear()
            return self._send(200, {"message": "Generation continued successfully.", "status": "ok"})
        if path == "/flush_cache":
            return self._send(200, b"Cache flushed.\n", content_type="text/plain")
        if path == "/abort_request":  # as SGLang: every running rid that starts with it; an empty reply
            st.aborts += 1
            st.aborted.append(body)
            _abort_running(st, str(body.get("rid") or ""), every=bool(body.get("abort_all")))
            return self._send(200, b"")
        if path == "/update_weight_version":  # as SGLang: no session needed; aborts all unless told not to
            if "new_version" not in body:
                return self._send(400, {"detail": [{"type": "missing", "loc": ["body", "new_version"]}]})
            if body.get("abort_all_requests", True):
                _abort_running(st, "", every=True)
            with st.lock:
                st.engine._version = str(body["new_version"])
            message = f"Weight version updated to {body['new_version']}"
            return self._send(200, {"success": True, "message": message, "new_version": body["new_version"]})
        if path == "/_test/faults":
            st.faults = body
            with st.count_lock:
                st.max_in_flight = st.in_flight  # a new measurement
            return self._send(200, {"success": True})
        if path == "/_test/weights_digest":
            with st.lock:
                return self._send(200, {"digest": weights_digest(st.engine.model)})
        if path == "/_test/stats":
            return self._send(
                200,
                {
                    "generate_requests": st.generate_requests,
                    "aborts": st.aborts,
                    "aborted": st.aborted,
                    "weight_updates": st.weight_updates,
                    "weight_update_requests": st.weight_update_requests,
                    "update_requests": st.update_requests,
                    "generate_rids": st.generate_rids,
                    "max_in_flight": st.max_in_flight,
                    "memory_events": st.memory_events,
                    "releases_after_updates": st.releases_after_updates,
                    "weight_groups": sorted(st.groups),
                },
            )
        return self._send(404, {"detail": "Not Found"})

    def _generate(self, body: dict) -> None:
        st = self.state
        st.generate_requests += 1
        faults = st.faults
        if faults.get("die_after") is not None:
            faults["die_after"] -= 1
            if faults["die_after"] <= 0:
                os._exit(1)
        if faults.get("delay_s"):
            time.sleep(float(faults["delay_s"]))
        if faults.get("fail_count", 0) > 0:
            faults["fail_count"] -= 1
            return self._send(int(faults.get("fail_status", 500)), {"error": {"message": "injected failure"}})
        if faults.get("malformed_count", 0) > 0:
            faults["malformed_count"] -= 1
            return self._send(200, b"{not json")
        sp = body.get("sampling_params") or {}
        unknown = sorted(set(sp) - SAMPLING_KEYS)
        if unknown:
            return self._send(400, {"error": f"unknown field `{unknown[0]}`, expected one of {sorted(SAMPLING_KEYS)}"})
        ids = body.get("input_ids")
        if isinstance(ids, list) and ids and all(isinstance(row, list) for row in ids):  # a batch: one reply each
            replies = [self._generate_one(st, {**body, "input_ids": row, "rid": None}, sp) for row in ids]
            bad = next((r for r in replies if r[0] != 200), None)
            return self._send(*(bad or (200, [r[1] for r in replies])))
        return self._send(*self._generate_one(st, body, sp))

    def _generate_one(self, st: State, body: dict, sp: dict) -> tuple[int, dict]:
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            return 400, {"error": {"message": "input_ids must be a non-empty list of token ids"}}
        if st.released or st.weights_lost:
            why = (
                f"memory {sorted(st.released)} is released"
                if st.released
                else "weights were released and not updated since"
            )
            return 400, {"error": {"message": f"cannot generate: {why}"}}
        if body.get("return_routed_experts") and not st.args.enable_return_routed_experts:
            return 400, {"error": {"message": "return_routed_experts needs --enable-return-routed-experts"}}
        start_len = int(body.get("routed_experts_start_len") or 0)
        if body.get("return_routed_experts") and not 0 <= start_len <= len(ids):  # as SGLang 0.5.23 words it
            why = f"recv_req.routed_experts_start_len={start_len} is higher than the number of input tokens len(req.origin_input_ids)={len(ids)}."
            return 400, {"error": {"message": why}}
        seed = sp.get("sampling_seed")
        if seed is None:
            seed = 42 if st.args.enable_deterministic_inference else int(time.time_ns() % (2**31))
        temperature, top_k = float(sp.get("temperature", 1.0)), int(sp.get("top_k", -1))
        if temperature < 1e-6:  # greedy, as SGLang does it: top-1 at temperature 1 (log-probs at temperature 1)
            temperature, top_k = 1.0, 1
        params = SamplingParams(
            max_new_tokens=int(sp.get("max_new_tokens", 128)),
            temperature=temperature,
            top_p=float(sp.get("top_p", 1.0)),
            top_k=top_k,
            stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
            ignore_eos=bool(sp.get("ignore_eos", False)),
        )
        while st.paused.is_set():
            time.sleep(0.01)
        token_delay_s = float(st.faults.get("token_delay_s", st.args.token_delay_s))
        late_s = float((st.faults.get("late_seeds") or {}).get(str(seed), 0))
        time.sleep(late_s)  # before its rid is known: an abort meanwhile finds nothing, as in SGLang
        rid, arrived, aborted = body.get("rid"), time.monotonic(), threading.Event()
        if rid:  # abortable from here (its computing below is its decoding)
            with st.count_lock:
                st.running[rid] = aborted
        try:
            with st.lock:
                (sample,) = st.engine.generate_seeded(
                    [ids], [int(seed)], params, bool(body.get("return_routed_experts"))
                )
            if token_delay_s:  # a length-proportional decode time, other requests running meanwhile
                sample = _decode_time(sample, token_delay_s, aborted, arrived)
        finally:
            if rid:
                with st.count_lock:
                    st.running.pop(rid, None)
        if sample.finish_reason == "abort":
            finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        elif sample.finish_reason == "stop":
            finish = {"type": "stop", "matched": sample.output_ids[-1]}
        else:
            finish = {"type": "length", "length": len(sample.output_ids)}
        meta = {
            "id": body.get("rid") or f"req-{st.generate_requests}",
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "completion_tokens": len(sample.output_ids),
            "cached_tokens": 0,
            "num_retractions": 0,
            "weight_version": st.engine.weight_version,
            "weight_versions": [{"version": st.engine.weight_version, "start": 0, "end": len(sample.output_ids)}],
        }
        if body.get("return_logprob"):
            meta["input_token_logprobs"] = []  # from logprob_start_len: the client asks for none
            meta["output_token_logprobs"] = [
                [lp, tok, None] for lp, tok in zip(sample.output_logprobs, sample.output_ids)
            ]
        if body.get("return_routed_experts") and sample.output_ids:  # from routed_experts_start_len
            meta["routed_experts"] = encode_routed_experts(sample.routed_experts[start_len:])
        reply = {"text": "", "output_ids": sample.output_ids, "meta_info": meta}
        return 200, _inject_reply_fault(st.faults, reply, sample)


def _decode_time(sample, token_delay_s: float, aborted: threading.Event, arrived: float):
    """Hold the reply ``token_delay_s`` per output token; an ``/abort_request`` since it
    arrived (during its computing too) cuts the sample to the tokens "decoded" at that rate by
    the abort's arrival (as SGLang replies to an aborted request: the tokens, log-probs and routed experts it
    had, ``finish_reason`` abort)."""
    if not aborted.wait(token_delay_s * len(sample.output_ids)):
        return sample
    stopped = getattr(aborted, "at", time.monotonic())  # when the abort came, however long computing took
    kept = min(int((stopped - arrived) / token_delay_s), len(sample.output_ids) - 1)
    positions = len(sample.prompt_ids) + kept - 1
    return dataclasses.replace(
        sample,
        output_ids=sample.output_ids[:kept],
        output_logprobs=sample.output_logprobs[:kept],
        finish_reason="abort",
        routed_experts=None if sample.routed_experts is None else sample.routed_experts[:positions],
    )


def warm_up(engine: LocalEngine, prompts: int = 32, length: int = 6, tokens: int = 16) -> None:
    """A generation of random prompts for the simulated mismatch to calibrate on (its figures dropped)."""
    rng = torch.Generator().manual_seed(0)
    rows = torch.randint(2, engine.model.config.vocab_size, (prompts, length), generator=rng).tolist()
    engine.generate_seeded(rows, list(range(prompts)), SamplingParams(max_new_tokens=tokens), False)
    engine.rollout_scalars()


def weights_digest(model: torch.nn.Module) -> str:
    """A hash of every weight's bytes (bit-equality of two models' weights)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _join_group(st: State, body: dict) -> tuple[int, dict]:
    """Join the weight-update group as ``rank_offset`` (this server's TP rank 0; a test
    server has one rank), blocking until every rank has joined, as SGLang does."""
    if st.args.tp_size != 1:
        return 400, {"success": False, "message": "the test server joins weight-update groups with --tp-size 1 only"}
    if st.faults.get("refuse_weight_groups", 0) > 0:
        st.faults["refuse_weight_groups"] -= 1
        return 200, {"success": False, "message": "Failed to initialize custom process group: injected refusal"}
    if _stalled(st.faults, "stall_weight_groups"):
        return 200, {"success": False, "message": "Failed to initialize custom process group: injected stall"}
    try:
        group = join_weight_update_group(
            backend=body["backend"],
            address=body["master_address"],
            port=int(body["master_port"]),
            world_size=int(body["world_size"]),
            rank=int(body["rank_offset"]),
            group_name=body["group_name"],
            timeout_s=120,
        )
    except Exception as e:  # noqa: BLE001 - reported to the client like SGLang does
        return 200, {"success": False, "message": f"Failed to initialize custom process group: {type(e).__name__}: {e}"}
    leave_weight_update_group(st.groups.pop(body["group_name"], None))
    st.groups[body["group_name"]] = group
    return 200, {"success": True, "message": "Succeeded to initialize custom process group."}


def _receive_broadcast(st: State, body: dict) -> tuple[int, dict]:
    """Receive the announced tensors from group rank 0, in order, as SGLang's ranks do: one
    broadcast each, or one of their packed bytes (``load_format="flattened_bucket"``)."""
    group = st.groups.get(body.get("group_name"))
    if group is None:
        return 400, {"success": False, "message": f"unknown group_name {body.get('group_name')!r}"}
    if st.faults.get("refuse_buckets", 0) > 0:
        st.faults["refuse_buckets"] -= 1
        return 400, {"success": False, "message": f"injected refusal of load_format={body.get('load_format')}"}
    if _stalled(st.faults, "stall_buckets"):
        return 400, {"success": False, "message": "injected stall: the bucket was never received"}
    names, dtypes, shapes = body.get("names", []), body.get("dtypes", []), body.get("shapes", [])
    if not (len(names) == len(dtypes) == len(shapes)):
        return 400, {"success": False, "message": "names, dtypes and shapes differ in length"}
    flattened = body.get("load_format") == "flattened_bucket" and sglang_version(st.version) >= FLATTENED_BUCKETS_SINCE
    st.weight_update_requests += 1
    st.update_requests.append({"group": body["group_name"], "flattened": flattened})
    if flattened:
        try:
            named, flat = _flat_bucket(names, [getattr(torch, d) for d in dtypes], shapes)
        except ValueError as e:
            return 400, {"success": False, "message": f"Failed to receive weights: {e}"}
        torch.distributed.broadcast(flat, group=group, group_src=0)
        st.received.update(named)
        return 200, {}
    for name, dtype, shape in zip(names, dtypes, shapes):
        tensor = torch.empty(shape, dtype=getattr(torch, dtype))
        torch.distributed.broadcast(tensor, group=group, group_src=0)
        st.received[name] = tensor
    return 200, {}


def _stalled(faults: dict, kind: str) -> bool:
    """Fault ``kind`` is due: take one, wait ``stall_s`` (never joining or receiving)."""
    if faults.get(kind, 0) <= 0:
        return False
    faults[kind] -= 1
    time.sleep(float(faults.get("stall_s", 30)))
    return True


def _flat_bucket(
    names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A receive buffer and the named views into it, packed as SGLang packs them (no padding:
    a tensor must start at a multiple of its element size, in its words)."""
    places, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        if offset % dtype.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
        size = torch.Size(shape).numel() * dtype.itemsize
        places.append((name, dtype, shape, offset, offset + size))
        offset += size
    flat = torch.empty(offset, dtype=torch.uint8)
    return {name: flat[start:end].view(dtype).view(shape) for name, dtype, shape, start, end in places}, flat


def _receive_tensors(st: State, body: dict) -> tuple[int, dict]:
    """``/update_weights_from_tensor``: one serialized payload per TP rank, mapped from the
    sender's memory (shared memory here, CUDA IPC on GPUs) and copied: a list of
    ``(name, tensor)``, or a ``flattened_bucket`` of bytes and their layout."""
    if "weights" in st.released:
        return 400, {"success": False, "message": "weights memory is released: /resume_memory_occupation first"}
    serialized = body.get("serialized_named_tensors") or []
    if len(serialized) != st.args.tp_size:
        return 400, {
            "success": False,
            "message": f"serialized_named_tensors has {len(serialized)} entries for tp_size {st.args.tp_size}",
        }
    st.weight_update_requests += 1
    payload = deserialize_sglang_payload(serialized[0])
    if body.get("load_format") == "flattened_bucket":  # SGLang reads these fields of each metadata entry
        flat = payload["flattened_tensor"]
        payload = [(m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in payload["metadata"]]
    st.update_requests.append({"group": None, "flattened": body.get("load_format") == "flattened_bucket"})
    for name, tensor in payload:
        st.received[name] = tensor.clone()
    return 200, {}


def _memory_occupation(st: State, path: str, body: dict) -> tuple[int, dict]:
    """SGLang's memory saver: released memory cannot generate; released weights are lost."""
    if not st.args.enable_memory_saver:
        return 400, {"success": False, "message": f"{path} needs the server started with --enable-memory-saver"}
    tags = set(body.get("tags") or ["weights", "kv_cache", "cuda_graph"])  # none named: all, as in SGLang 0.5.23
    if path.startswith("/release"):
        st.released |= tags
        st.weights_lost = st.weights_lost or "weights" in tags
        st.memory_events.append(["release", sorted(tags)])
        st.releases_after_updates.append(st.weight_updates)
    else:
        st.released -= tags
        st.memory_events.append(["resume", sorted(tags)])
    return 200, {"success": True, "message": ""}


def _load_from_disk(st: State, body: dict) -> tuple[int, dict]:
    """``/update_weights_from_disk``: a directory that does not load is refused (HTTP 400)."""
    try:
        with st.lock:
            st.engine.update_weights_from_disk(
                body["model_path"], str(body.get("weight_version") or st.engine.weight_version)
            )
            st.weights_lost = False
    except (OSError, ValueError, KeyError) as e:
        return 400, {
            "success": False,
            "message": f"Failed to get weights iterator: {type(e).__name__}: {e}",
            "num_paused_requests": 0,
        }
    return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}


def _abort_running(st: State, rid: str, *, every: bool) -> None:
    """Stop every running request whose rid starts with ``rid`` (all with ``every``)."""
    with st.count_lock:
        for running, event in st.running.items():
            if every or (rid and running.startswith(rid)):
                if not event.is_set():
                    event.at = time.monotonic()  # type: ignore[attr-defined]  # its decoding stops here
                event.set()


def _apply_received(st: State) -> tuple[int, dict]:
    """Load what the broadcasts brought (every weight of the model must have come)."""
    received, st.received = st.received, {}
    version, st.version_after_update = st.version_after_update, None
    try:
        with st.lock:
            if received:
                st.engine.update_weights(received, version or st.engine.weight_version)
                st.weight_updates += 1
                st.weights_lost = False
            elif version is not None:
                st.engine._version = version
    except ValueError as e:
        return 400, {"success": False, "message": f"weight update failed: {e}"}
    return 200, {"success": True, "message": "weight update ended"}


def _inject_reply_fault(faults: dict, reply: dict, sample) -> dict:
    """``reply_fault`` (``reply_fault_count`` times): an HTTP 200 reply that is wrong in one
    way a real server's can be."""
    kind = faults.get("reply_fault")
    if not kind or faults.get("reply_fault_count", 0) <= 0:
        return reply
    faults["reply_fault_count"] -= 1
    meta = reply["meta_info"]
    if kind == "error_body":
        return {"object": "error", "message": "injected error", "type": "InternalError"}
    if kind == "null_logprob":
        meta["output_token_logprobs"][0][0] = None
    elif kind == "abort":
        meta["finish_reason"] = {"type": "abort", "message": "injected abort"}
    elif kind in ("expert_out_of_range", "expert_repeated"):
        experts = sample.routed_experts.clone()
        experts[0, 0, 0] = 10_000 if kind == "expert_out_of_range" else experts[0, 0, 1]
        meta["routed_experts"] = encode_routed_experts(experts)
    return reply


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--ep-size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float, default=0.8)
    p.add_argument("--enable-return-routed-experts", action="store_true")
    p.add_argument("--enable-deterministic-inference", action="store_true")
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--weight-version", default="default")  # SGLang's own default
    # not SGLang's: weights rounded to bf16 (computed in fp32), an inference engine's numerics
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    # not SGLang's: the local engine's simulated mismatch (rollout.simulate_mismatch's fields as JSON)
    p.add_argument("--simulate-mismatch", type=json.loads, default=None)
    # not SGLang's: seconds each reply is held per output token (a decode time that grows with length)
    p.add_argument("--token-delay-s", type=float, default=0.0)
    args, _unknown = p.parse_known_args(argv)
    Handler.state = State(args)
    ThreadingHTTPServer.request_queue_size = 256  # a client's burst of concurrent requests is not refused
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    print(f"test server ready on {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
