"""The built-in rollout engine: a transformers model with a KV cache, in this process.

Same interface and log-prob semantics as :class:`moe_rl.rollout.sglang.engine.SGLangEngine`:
log-probs at the sampling temperature before top-p/top-k truncation, one seeded
random stream per sample (drawn for every row at once), and routed experts in SGLang's layout
(``[prompt + output - 1, num_layers, top_k]``; dense layers get ``0..k-1``) in
:func:`moe_rl.routing.encoding.expert_index_dtype`, as the SGLang client decodes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from typing import AsyncIterator, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, PreTrainedModel

from moe_rl.models.architectures import architecture_of
from moe_rl.routing.encoding import expert_index_dtype
from moe_rl.routing.hf_routing import RouterCapture
from moe_rl.rollout.contracts import InProcessWeightReceiver
from moe_rl.rollout.mismatch import MismatchSimulation
from moe_rl.rollout.settings import SimulatedMismatch
from moe_rl.rollout.types import (
    GenerationRequest,
    GroupCallback,
    GroupProgress,
    RolloutEngine,
    RolloutError,
    Sample,
    SamplingParams,
    TurnSource,
    sample_seed,
)


class LocalEngine(RolloutEngine, InProcessWeightReceiver):
    """Generates with ``model`` (or loads ``model_path``); fp32 on CPU by default.

    ``weight_precision`` (e.g. ``torch.bfloat16``) rounds every weight it loads or
    receives to that dtype while computing in ``dtype``: an inference engine's lower
    precision, without bf16 arithmetic (hundreds of times slower on CPUs).
    ``mismatch`` (enabled) simulates a larger train-inference mismatch: the engine's routing
    and logits perturbed to its targets (:mod:`moe_rl.rollout.mismatch`, seeded by
    ``mismatch_seed``); evaluation (:meth:`evaluation`) runs without it."""

    def __init__(
        self,
        model_path: str | None = None,
        *,
        model: PreTrainedModel | None = None,
        weight_version: str = "0",
        dtype: torch.dtype = torch.float32,
        weight_precision: torch.dtype | None = None,
        mismatch: SimulatedMismatch | None = None,
        mismatch_seed: int = 0,
    ) -> None:
        if (model_path is None) == (model is None):
            raise ValueError("give LocalEngine exactly one of model_path or model")
        self.dtype = dtype
        self.weight_precision = weight_precision
        if model is None:
            assert model_path is not None
            model = self._load(model_path)
        self.model = model
        self.model.eval()
        self.mismatch: MismatchSimulation | None = None  # made once the routers are found
        self._round_weights()
        self._version = weight_version
        self._sources: list[tuple[Tensor, str]] | None = None  # made at the first weight update
        cfg = self.model.config
        self.arch = architecture_of(cfg)
        self._routers = RouterCapture(self.model)
        self.mismatch = (
            MismatchSimulation(self.model, self._routers, mismatch, mismatch_seed)
            if mismatch is not None and mismatch.enabled
            else None
        )
        self._evaluating = False
        if self.mismatch is None:  # hooked only for the batches whose routing is returned
            self._routers.remove()
        self._index_dtype = expert_index_dtype(self.arch.num_experts(cfg))
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None) or cfg.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))
        self.tokens_generated = 0
        self.seconds_generating = 0.0

    def returns_routed_experts(self) -> bool:
        return True

    def _load(self, path: str) -> PreTrainedModel:
        return AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype, local_files_only=True)

    @torch.no_grad()
    def _round_weights(self) -> None:
        if self.weight_precision is not None:
            for tensor in self.model.state_dict().values():
                tensor.copy_(self._rounded(tensor))
        if self.mismatch is not None:
            self.mismatch.refresh()  # the weights just loaded are the trained ones

    def _rounded(self, tensor: Tensor) -> Tensor:
        return tensor if self.weight_precision is None else tensor.to(self.weight_precision).to(tensor.dtype)

    @property
    def weight_version(self) -> str:
        return self._version

    def rollout_scalars(self) -> dict[str, float]:
        """The simulated mismatch's figures since the last call (none when it is off)."""
        return self.mismatch.take_scalars() if self.mismatch is not None else {}

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        """Generation inside is the trained model's own: no simulated mismatch, and nothing
        of it tallied or kept to calibrate on."""
        if self.mismatch is None:
            yield
            return
        was, self._evaluating = self._evaluating, True
        try:
            with self.mismatch.unperturbed():
                yield
        finally:
            self._evaluating = was

    # ------------------------------------------------------------ weights

    def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        fresh = self._load(model_path)
        self.model.load_state_dict(fresh.state_dict())
        self._round_weights()
        self._version = weight_version

    @torch.no_grad()
    def update_weights(self, hf_tensors: Mapping[str, Tensor], weight_version: str) -> None:
        """Weights from the trainer in this process, by HF checkpoint names (as
        :func:`moe_rl.models.hf_weights.gather_hf_tensors` gives them)."""
        if self._sources is None:
            self._sources = self._weight_sources()
        missing = sorted({key for _, key in self._sources if key not in hf_tensors})
        if missing:
            raise ValueError(f"weight update lacks {len(missing)} tensors, e.g. {missing[:3]}")
        targets, values = [], []
        for target, key in self._sources:
            value = hf_tensors[key]
            if value.shape != target.shape:
                raise ValueError(
                    f"weight update: {key} has shape {tuple(value.shape)}, the engine's is {tuple(target.shape)}"
                )
            targets.append(target)
            values.append(self._rounded(value))
        if all(t.device == v.device for t, v in zip(targets, values)):
            torch._foreach_copy_(targets, values)  # one call, not one per tensor (each expert's are many)
        else:  # from the trainer's device (foreach ops take one device)
            for target, value in zip(targets, values):
                target.copy_(value)
        if self.mismatch is not None:
            self.mismatch.refresh()
        self._version = weight_version

    def _weight_sources(self) -> list[tuple[Tensor, str]]:
        """(a view of this model's weights, the HF checkpoint tensor that fills it): the
        stacked experts' ``gate_up_proj`` / ``down_proj`` by each expert's (and half's) key."""
        keys = self.arch.experts
        num_experts = self.arch.num_experts(self.model.config)
        sources = []
        for name, target in self.model.state_dict().items():
            m = re.fullmatch(
                r"model\.layers\.(\d+)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)", name
            )
            l = int(m.group(1)) if m else None
            if m and m.group(2) == "experts.gate_up_proj":
                ffn = target.shape[1] // 2
                for e in range(num_experts):
                    sources += [
                        (target[e, :ffn], keys.gate.format(l=l, e=e)),
                        (target[e, ffn:], keys.up.format(l=l, e=e)),
                    ]
            elif m and m.group(2) == "experts.down_proj":
                sources += [(target[e], keys.down.format(l=l, e=e)) for e in range(num_experts)]
            elif m:
                sources.append((target, keys.router.format(l=l)))
            elif not (name == "lm_head.weight" and self.model.config.tie_word_embeddings):
                sources.append((target, name))
        return sources

    # ------------------------------------------------------------ generation

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
        """Prompts of one length decode as one batch; ``on_group`` gets a prompt's samples
        when its batch ends (a group never spans two batches: its rows share a prompt)."""
        if n < 1:
            raise ValueError(f"n={n} samples per prompt must be >= 1")
        rows = [list(p) for p in prompts for _ in range(n)]
        seeds = [sample_seed(seed, i, j, n) for i in range(len(prompts)) for j in range(n)]

        def hand_over(batch_rows: list[int], batch: list[Sample]) -> None:
            assert on_group is not None
            done = dict(zip(batch_rows, batch))
            for i in sorted({r // n for r in batch_rows}):
                on_group(i, [done[r] for r in range(i * n, (i + 1) * n)])

        samples = self.generate_seeded(rows, seeds, params, return_routed_experts, hand_over if on_group else None)
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    def generate_seeded(
        self,
        prompts: Sequence[Sequence[int]],
        seeds: Sequence[int],
        params: SamplingParams,
        routed: bool,
        on_batch: Callable[[list[int], list[Sample]], None] | None = None,
    ) -> list[Sample]:
        """One sample of each prompt with its own seed; prompts of one length share a batch
        (no padding: the numerics of a batch of one), ``on_batch(rows, samples)`` as each ends."""
        params.validate()
        start = time.perf_counter()
        mismatch = self._active_mismatch()
        if mismatch is not None and not mismatch.calibrated:
            self._calibrate_mismatch(mismatch, prompts, seeds, params)
        out: list[Sample | None] = [None] * len(prompts)
        for indices in _by_length(prompts):
            samples = self.generate_rows(
                [list(prompts[i]) for i in indices], [seeds[i] for i in indices], params, routed
            )
            for i, sample in zip(indices, samples):
                out[i] = sample
            if on_batch is not None:
                on_batch(indices, samples)
        self.seconds_generating += time.perf_counter() - start
        done = [sample for sample in out if sample is not None]
        assert len(done) == len(out)  # every prompt is in one length's batch
        self.tokens_generated += sum(len(s.output_ids) for s in done)
        return done

    def generate_requests(
        self,
        requests: Sequence[GenerationRequest],
        params: Sequence[SamplingParams],
        *,
        routed: bool,
        groups_needed: int,
    ) -> list[Sample]:
        """Requests of one length and settings decode as one batch, batch after batch; the
        decoding stops at the step in which the ``groups_needed``-th group is done (a
        deterministic point: the same requests stop at the same tokens)."""
        for p in set(params):
            p.validate()
        start = time.perf_counter()
        mismatch = self._active_mismatch()
        if mismatch is not None and not mismatch.calibrated:
            self._calibrate_mismatch(mismatch, [r.token_ids for r in requests], [r.seed for r in requests], params[0])
        groups = GroupProgress([r.group for r in requests], groups_needed)
        out: list[Sample | None] = [None] * len(requests)
        for indices in _by_length([r.token_ids for r in requests], params):
            if groups.enough():
                break
            batch = [requests[i] for i in indices]
            samples = self.generate_rows(
                [r.token_ids for r in batch],
                [r.seed for r in batch],
                params[indices[0]],
                routed,
                offsets=[r.generated for r in batch],
                stop=lambda finished: groups.finish([indices[j] for j in finished]),
                routing_from=[r.routing_from for r in batch],
            )
            for i, sample in zip(indices, samples):
                out[i] = sample
        self.seconds_generating += time.perf_counter() - start
        done = [s if s is not None else r.not_started(self._version) for s, r in zip(out, requests)]
        self.tokens_generated += sum(len(s.output_ids) for s in done)
        return done

    def _calibrate_mismatch(
        self,
        mismatch: MismatchSimulation,
        prompts: Sequence[Sequence[int]],
        seeds: Sequence[int],
        params: SamplingParams,
    ) -> None:
        """Calibrate the simulated mismatch for the weights held now, on the last samples; the
        first time on a trial generation of these prompts (calibrated on the prompts alone,
        whose tokens route unlike responses'), which is then discarded."""
        if not mismatch.has_samples:
            mismatch.calibrate(prompts, params.temperature)
            for rows in _by_length(prompts):
                self.generate_rows([list(prompts[i]) for i in rows], [seeds[i] for i in rows], params, False)
            mismatch.take_scalars()  # the trial's figures are not the run's
        mismatch.calibrate(prompts, params.temperature)

    def _active_mismatch(self) -> MismatchSimulation | None:
        """The mismatch this generation simulates (none during :meth:`evaluation`)."""
        return None if self._evaluating else self.mismatch

    @contextlib.asynccontextmanager
    async def turns(self, *, return_routed_experts: bool) -> AsyncIterator[TurnSource]:
        """Requests made while the event loop runs are batched (as :meth:`generate_seeded`)."""
        yield _BatchingTurns(self, return_routed_experts)

    @torch.no_grad()
    def generate_rows(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        params: SamplingParams,
        routed: bool,
        *,
        offsets: Sequence[int] = (),
        stop: Callable[[list[int]], bool] | None = None,
        routing_from: Sequence[int] = (),
    ) -> list[Sample]:
        """One sample per row: ``prompts[r]`` (all of one length) sampled with ``seeds[r]``
        (SGLang's per-request ``sampling_seed``), its draws from output index ``offsets[r]``
        on (a continued partial response). ``stop(rows)`` after each step with the rows
        that finished in it: ``True`` ends the batch there, the unfinished rows
        ``"abort"``. ``routing_from[r]``: the first position of row ``r``'s routed experts."""
        if not prompts[0]:
            raise ValueError("empty prompt")
        n, prompt_len = len(seeds), len(prompts[0])
        vocab = self.model.config.vocab_size
        if max(max(p) for p in prompts) >= vocab or min(min(p) for p in prompts) < 0:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        mismatch = self._active_mismatch()
        simulating = mismatch is not None
        tracked = routed or simulating
        with self._routers.attached() if tracked else contextlib.nullcontext():
            d = self._decode(prompts, seeds, params, tracked, simulating, offsets, stop)
        # outside inference mode from here: the tensors made below (kept by the mismatch, or
        # returned) are ordinary ones
        samples = []
        full_routing = torch.cat(d.routing, dim=1) if tracked else None  # [n, positions, L, k]
        if mismatch is not None:
            assert full_routing is not None  # a simulated mismatch tracks routing
            mismatch.observe(
                torch.cat(d.fed, 1),
                full_routing,
                prompt_len,
                torch.stack(d.drawn, 1),
                torch.stack(d.drawn_logps, 1),
                params.temperature,
            )
        for j in range(n):
            routed_j = None
            if routed:
                assert full_routing is not None
                # its own storage, not the batch's
                first = routing_from[j] if routing_from else 0
                routed_j = full_routing[j, first : prompt_len + len(d.outputs[j]) - 1].to(self._index_dtype, copy=True)
            samples.append(
                Sample(
                    prompt_ids=list(prompts[j]),
                    output_ids=d.outputs[j],
                    output_logprobs=d.logprobs[j],
                    finish_reason=d.reasons[j] or "length",
                    weight_version=self._version,
                    seed=seeds[j],
                    routed_experts=routed_j,
                )
            )
        return samples

    @torch.inference_mode()
    def _decode(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        params: SamplingParams,
        tracked: bool,
        simulating: bool,
        offsets: Sequence[int] = (),
        stop: Callable[[list[int]], bool] | None = None,
    ) -> _Decoded:
        """The prefill and decode steps (in inference mode: no autograd bookkeeping per
        operation; the tensors it returns are read outside it, never changed in place);
        ``simulating``: keep what the simulated mismatch observes; ``offsets``, ``stop``:
        as :meth:`generate_rows`."""
        n, prompt_len = len(seeds), len(prompts[0])
        stop_ids = (set() if params.ignore_eos else self.eos_ids) | set(params.stop_token_ids)
        row_seeds = np.array([s % 2**64 for s in seeds], dtype=np.uint64)
        row_offsets = np.array(offsets or [0] * n, dtype=np.uint64)
        ids = torch.tensor(prompts, device=self.model.device)
        # the last position's logits only: the prompt's others are never read (at a 151k
        # vocabulary, prompt_len x 151k floats a row)
        step_out = self.model(ids, use_cache=True, logits_to_keep=1)
        d = _Decoded(n, fed=[ids], routing=[self._routers.take(n, prompt_len)[0]] if tracked else [])
        for step in range(params.max_new_tokens):
            if step % _UNIFORM_STEPS == 0:
                uniforms = _uniform_steps(
                    row_seeds, step, min(_UNIFORM_STEPS, params.max_new_tokens - step), row_offsets
                )
            logits = _last_logits(step_out, params.temperature)
            logp = torch.log_softmax(logits, dim=-1)
            next_tokens = _draw(_filtered_probs(logits, params.top_p, params.top_k), uniforms[:, step % _UNIFORM_STEPS])
            drawn_logp = logp.gather(1, next_tokens[:, None]).squeeze(1)
            if simulating:
                live = torch.tensor([r is None for r in d.reasons], device=drawn_logp.device)
                d.drawn.append(next_tokens)
                d.drawn_logps.append(drawn_logp.masked_fill(~live, float("nan")))
            finished = d.add(next_tokens.tolist(), drawn_logp.tolist(), stop_ids)
            last = step == params.max_new_tokens - 1
            if last:  # the rows still going end at the limit ("length"): done too
                finished += [j for j, reason in enumerate(d.reasons) if reason is None]
            if stop is not None and stop(finished) and not last:
                d.abort()
                break
            if d.finished() or last:
                break  # the last sampled token is never fed back (as in SGLang)
            step_out = self.model(next_tokens[:, None], use_cache=True, **self._cache_kwargs(step_out))
            if simulating:
                d.fed.append(next_tokens[:, None])
            if tracked:
                d.routing.append(self._routers.take(n, 1)[0])
        return d

    def _cache_kwargs(self, out) -> dict:
        """The KV cache of the last step, under the name this transformers version uses
        (``cache`` in 5.x, ``past_key_values`` before)."""
        if hasattr(out, "cache") and out.cache is not None:
            return {"cache": out.cache}
        return {"past_key_values": out.past_key_values}


class _Decoded:
    """One batch's decoding so far: each row's output tokens, their log-probs and finish
    reason; with a simulated mismatch every step's tokens as fed, drawn, and their
    log-probs (``nan`` once a row has finished); the routing of each forward pass when tracked."""

    def __init__(self, n: int, fed: list[Tensor], routing: list[Tensor]) -> None:
        self.outputs: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[float]] = [[] for _ in range(n)]
        self.reasons: list[str | None] = [None] * n
        self.fed, self.routing = fed, routing
        self.drawn: list[Tensor] = []
        self.drawn_logps: list[Tensor] = []

    def add(self, tokens: list[int], token_logps: list[float], stop_ids: set[int]) -> list[int]:
        """One step's draws (a finished row's draw is fed back and ignored); the rows
        that finished with it."""
        finished = []
        for j, reason in enumerate(self.reasons):
            if reason is None:
                self.outputs[j].append(tokens[j])
                self.logprobs[j].append(token_logps[j])
                if tokens[j] in stop_ids:
                    self.reasons[j] = "stop"
                    finished.append(j)
        return finished

    def abort(self) -> None:
        """The unfinished rows end here, with what they drew."""
        self.reasons = [r or "abort" for r in self.reasons]

    def finished(self) -> bool:
        return all(r is not None for r in self.reasons)


class _BatchingTurns:
    """Single requests of many coroutines gathered into batches: a request waits until no
    other coroutine of the loop has another to add, then every pending one runs at once
    (grouped by sampling settings). The model runs on the loop's thread."""

    def __init__(self, engine: LocalEngine, routed: bool) -> None:
        self.engine, self.routed = engine, routed
        self._pending: list[tuple[list[int], SamplingParams, int, int, asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None

    async def generate(
        self, token_ids: Sequence[int], params: SamplingParams, *, seed: int, routing_from: int = 0
    ) -> Sample:
        ids = list(token_ids)
        vocab = self.engine.model.config.vocab_size
        if not ids or not all(0 <= t < vocab for t in ids):  # refused alone, not with its batch
            shown = (
                "an empty request"
                if not ids
                else f"token ids outside [0, {vocab}): {[t for t in ids if not 0 <= t < vocab][:5]}"
            )
            raise RolloutError(f"the local engine refused {shown} (as SGLang answers HTTP 400)")
        future = asyncio.get_running_loop().create_future()
        self._pending.append((ids, params, seed, routing_from, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        while self._pending:
            count = -1
            while count != len(self._pending):  # until a pass of the loop adds no request
                count = len(self._pending)
                await asyncio.sleep(0)
            batch, self._pending = self._pending, []
            by_params: dict[SamplingParams, list] = {}
            for item in batch:
                by_params.setdefault(item[1], []).append(item)
            for params, items in by_params.items():
                self._run(params, items)

    def _run(self, params: SamplingParams, items: list) -> None:
        try:
            samples = self.engine.generate_seeded([i[0] for i in items], [i[2] for i in items], params, self.routed)
        except Exception as e:  # every request of the batch gets the error
            for *_, future in items:
                if not future.done():
                    future.set_exception(e)
            return
        for (_, _, _, routing_from, future), sample in zip(items, samples):
            if sample.routed_experts is not None and routing_from:
                sample.routed_experts = sample.routed_experts[routing_from:]
            if not future.done():
                future.set_result(sample)


def _by_length(prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams] = ()) -> list[list[int]]:
    """The prompts' indices grouped by prompt length (a batch without padding each) and,
    where given, sampling settings."""
    by_length: dict[tuple, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault((len(p), params[i] if params else None), []).append(i)
    return list(by_length.values())


_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _uniforms(seeds: np.ndarray, step: int | np.ndarray) -> Tensor:
    """One uniform in [0, 1) per row, a function of (the row's seed, ``step``) alone
    (splitmix64 as a counter-based generator): a sample's draws never depend on which
    other rows share its batch. ``step`` may be an array broadcast against ``seeds``."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as intended
        x = seeds * _GOLDEN + (np.asarray(step, dtype=np.uint64) + np.uint64(1)) * _MIX1
        x = (x ^ (x >> np.uint64(30))) * _MIX1
        x = (x ^ (x >> np.uint64(27))) * _MIX2
        x = x ^ (x >> np.uint64(31))
    return torch.from_numpy((x >> np.uint64(11)).astype(np.float64) * 2.0**-53)


_UNIFORM_STEPS = 64  # decode steps whose uniforms are made at once


def _uniform_steps(seeds: np.ndarray, first: int, count: int, offsets: np.ndarray | None = None) -> Tensor:
    """:func:`_uniforms` of steps ``first .. first + count - 1`` (each row's shifted by its
    ``offsets``: the output tokens it already had), ``[rows, count]``."""
    steps = np.arange(first, first + count, dtype=np.uint64)[None, :]
    return _uniforms(seeds[:, None], steps if offsets is None else steps + offsets[:, None])


def _last_logits(out, temperature: float) -> Tensor:
    """The last position's logits in fp32, divided by ``temperature`` (not when it is 1:
    ``x / 1.0`` is ``x``)."""
    logits = out.logits[:, -1].float()
    return logits if temperature == 1.0 else logits / temperature


def _draw(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Row ``r``'s token: the first whose cumulative probability exceeds ``uniforms[r]``
    of the row's total (inverse-CDF sampling; a token of probability 0 is never drawn)."""
    cdf = probs.double().cumsum(-1)
    point = (uniforms.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, point, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def _filtered_probs(logits: Tensor, top_p: float, top_k: int) -> Tensor:
    """Sampling distribution after top-k and top-p (nucleus) truncation."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < top_p  # always keeps the top token
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
