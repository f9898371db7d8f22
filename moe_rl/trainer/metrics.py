"""A step's figures: the per-micro-batch metrics reduced over micro-batches and ranks as
:mod:`moe_rl.algorithms.metric_spec` declares (collective; the only place they are
reduced), and the first rank's logging of them — TensorBoard scalars (and the
routing tags), a ``metrics.jsonl`` copy, and a progress bar with step, reward and ETA."""

from __future__ import annotations

import itertools
import json
import math
import os
import queue
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TextIO

import numpy as np
import torch
from torch import Tensor

from moe_rl import tags
from moe_rl.disk import OutOfSpace, space_error, with_path
from moe_rl.algorithms.metric_spec import (
    LOGGED_UPDATE_METRICS,
    OFFPOLICY,
    ROLLOUT_MISMATCH_METRICS,
    TOKENS,
    UPDATE_METRICS,
    Reduction,
)
from moe_rl.algorithms.rollout_correction import MISMATCH_SUMS, mismatch_metrics
from moe_rl.experience.sample_log import SAMPLES_TAG, SampleRecord, samples_markdown
from parallel.collectives import all_reduce, reports_loss


def _host_values(
    outputs: Sequence[Mapping], keys: tuple[str, ...], optional: tuple[str, ...] = ()
) -> list[list[float]]:
    """Each output's ``keys`` as host floats (``optional`` ones 0 where absent): the tensors
    of each device stacked and moved in one device-to-host copy for the whole pass (a
    ``float()`` per value is a device sync each on a GPU); a plain number as a tensor of its
    own would hold it (a Python float in fp32)."""
    if not outputs:
        return []
    values = [out.get(key, 0.0) if key in optional else out[key] for out in outputs for key in keys]
    flat = [0.0] * len(values)
    by_device: dict[torch.device, list[int]] = {}
    for i, value in enumerate(values):
        if isinstance(value, Tensor):
            by_device.setdefault(value.device, []).append(i)
        else:
            flat[i] = torch.as_tensor(value).to(torch.float64).item()
    for indices in by_device.values():
        tensors = [values[i] if values[i].dim() == 0 else values[i].reshape(()) for i in indices]
        if len({t.dtype for t in tensors}) > 1:  # each converted exactly, not promoted together
            tensors = [t.to(torch.float64) for t in tensors]
        for i, value in zip(indices, torch.stack(tensors).to(torch.float64).cpu().tolist()):
            flat[i] = value
    return [flat[row * len(keys) : (row + 1) * len(keys)] for row in range(len(outputs))]


def reduce_metrics(values: Sequence[Mapping[str, Tensor | float]], spec: Mapping[str, Reduction]) -> dict[str, float]:
    """Collective. Each of ``spec``'s metrics over this rank's micro-batches (``values``,
    one mapping each: a metric a micro-batch lacks adds nothing) and the data-parallel
    ranks, by its declared reduction: sums, means weighted by each micro-batch's
    ``tokens`` (over the tokens of all micro-batches), minima and maxima (+-inf of none).
    Sums add up in float64 in micro-batch order; the reporting rank of each replica
    (:func:`parallel.collectives.reports_loss`) contributes."""
    names = list(spec)
    weighted = Reduction.TOKEN_MEAN in spec.values()
    sums = [0.0] * (len(names) + 1)  # SUM and weighted TOKEN_MEAN accumulators, then the tokens
    extremes = [math.inf] * len(names)  # MIN: the least value; MAX: the least negated value
    if reports_loss():
        keys = (*names, TOKENS) if weighted else tuple(names)
        for out, row in zip(values, _host_values(values, keys, optional=keys)):
            weight = row[-1] if weighted else 1.0  # (0 where a micro-batch has no tokens)
            if weighted and TOKENS not in out and any(spec[n] is Reduction.TOKEN_MEAN for n in out if n in spec):
                raise ValueError(f"a micro-batch's token means need its {TOKENS!r}: {sorted(out)}")
            for i, name in enumerate(names):
                if name in out:
                    sums[i], extremes[i] = _accumulate(spec[name], row[i], weight, sums[i], extremes[i])
            sums[-1] += weight
    totals = all_reduce(torch.tensor(sums, dtype=torch.float64)).tolist()
    lowest = all_reduce(torch.tensor(extremes, dtype=torch.float64), "min").tolist()
    tokens = max(totals[-1], 1.0)
    reduced = {
        Reduction.SUM: lambda i: totals[i],
        Reduction.TOKEN_MEAN: lambda i: totals[i] / tokens,
        Reduction.MIN: lambda i: lowest[i],
        Reduction.MAX: lambda i: -lowest[i],
    }
    return {name: reduced[spec[name]](i) for i, name in enumerate(names)}


def _accumulate(reduction: Reduction, value: float, weight: float, total: float, lowest: float) -> tuple[float, float]:
    """One micro-batch's ``value`` added to its metric's running sum or extreme."""
    if reduction is Reduction.SUM:
        return total + value, lowest
    if reduction is Reduction.TOKEN_MEAN:
        return total + value * weight, lowest
    return total, min(lowest, value if reduction is Reduction.MIN else -value)


def reduce_step(update: Sequence[Mapping[str, Tensor]], mismatch: Sequence[Mapping[str, Tensor]]) -> dict[str, float]:
    """Collective. A step's ``train/`` figures (untagged) from its per-micro-batch update
    metrics and train-inference mismatch values (one reduction for both): the logged update
    metrics, then :func:`logp_mismatch_scalars` and :func:`offpolicy_scalars`."""
    nothing: Mapping[str, Tensor] = {}  # (off the last pipeline stage: neither has values)
    per_micro_batch = [{**u, **m} for u, m in itertools.zip_longest(update, mismatch, fillvalue=nothing)]
    reduced = reduce_metrics(per_micro_batch, {**UPDATE_METRICS, **ROLLOUT_MISMATCH_METRICS})
    return {
        **{name: 0.0 if math.isinf(reduced[name]) else reduced[name] for name in LOGGED_UPDATE_METRICS},  # (none: 0)
        **logp_mismatch_scalars(reduced),
        **offpolicy_scalars(reduced),
    }


def logp_mismatch_scalars(reduced: Mapping[str, float]) -> dict[str, float]:
    """Mean and max ``|trainer - rollout|`` log-prob over every response token, from the
    reduced ``mismatch_*`` values (0 without any)."""
    worst = reduced["mismatch_max"]
    return {
        "logp_mismatch_mean": reduced["mismatch_sum"] / max(reduced["mismatch_tokens"], 1.0),
        "logp_mismatch_max": worst if worst != -math.inf else 0.0,
    }


def offpolicy_scalars(reduced: Mapping[str, float]) -> dict[str, float]:
    """The step's off-policy diagnostics (``offpolicy/<name>``: KL, perplexities,
    chi-squared, IS weights, truncated / dropped fractions) from the reduced ``offpolicy/``
    sums and extremes."""
    totals = {name: reduced[OFFPOLICY + name] for name in (*MISMATCH_SUMS, "weight_min", "weight_max")}
    return {OFFPOLICY + k: v for k, v in mismatch_metrics(totals).items()}


def padding_frac(batch) -> float:
    """Collective. The share of the step's micro-batch tokens (all ranks) that are padding."""
    real, padded = batch.padding
    totals = all_reduce(torch.tensor([real, padded], dtype=torch.float64))
    return 1.0 - float(totals[0]) / max(float(totals[1]), 1.0)


def routing_split_scalars(replayed: dict[str, Tensor]) -> dict[str, float]:
    """The update passes' ``|log-ratio|``, clip fraction and token counts over tokens whose
    routing changed since the old policy and over the rest (the monitor's ``replayed``
    group), as :func:`moe_rl.tags.train_by_routing` scalars."""
    out = {}
    for changed, part in ((True, "routing_changed"), (False, "routing_same")):
        for metric, key in (
            ("log_ratio_abs", f"log_ratio_abs_{part}"),
            ("clip_frac", f"clip_frac_{part}"),
            ("tokens", f"{part}_tokens"),
        ):
            if key in replayed:
                out[tags.train_by_routing(metric, changed)] = float(replayed[key])
    return out


def log_ratio_values(log_ratios: Tensor | None) -> Tensor | None:
    """This rank's masked token log-ratios of an update pass on the host (for the histogram)."""
    return log_ratios.cpu() if log_ratios is not None else None


def step_line(step: int, total: int, scalars: dict[str, float], *, short: bool = False) -> str:
    """``step 3/30  reward 0.412  loss -0.0213  pass@1 ...  1.2 s``: one line per step."""
    parts = [] if short else [f"step {step}/{total}"]
    for tag, name, fmt in (
        (tags.REWARD_TOTAL, "reward", ".3f"),
        (tags.TRAIN_LOSS, "loss", ".4g"),
        (tags.TRAIN_CLIP_FRAC, "clip", ".3f"),
        (tags.RESPONSE_LENGTH_MEAN, "length", ".1f"),
    ):
        if tag in scalars:
            parts.append(f"{name} {scalars[tag]:{fmt}}")
    if tags.PERF_STEP_TIME in scalars and not short:
        parts.append(f"{scalars[tags.PERF_STEP_TIME]:.1f}s")
    return "  ".join(parts)


def eval_table(step: int, scalars: dict[str, float]) -> str:
    """The held-out evaluation in ``scalars`` (if any) as a two-line table."""
    keys = [k for k in scalars if k.startswith("eval/") and k != tags.EVAL_PROMPTS]
    if not keys:
        return ""
    names = [k.split("/", 1)[1] for k in keys]
    widths = [max(len(n), 6) for n in names]
    head = "  ".join(n.rjust(w) for n, w in zip(names, widths))
    values = "  ".join(f"{scalars[k]:.3f}".rjust(w) for k, w in zip(keys, widths))
    prompts = int(scalars.get(tags.EVAL_PROMPTS, 0))
    return f"eval after step {step} ({prompts} held-out prompts):\n  {head}\n  {values}"


class StepLogger:
    """Logs of a run that starts (or resumes) after ``start_step`` steps: what an earlier
    attempt logged past that step (the steps it did not checkpoint) is dropped, in
    ``metrics.jsonl`` and TensorBoard alike, so every step appears once."""

    writer: BackgroundWriter
    jsonl: TextIO
    samples: TextIO

    def __init__(
        self, run_dir: Path, total_steps: int, start_step: int, *, enabled: bool, progress: bool = True
    ) -> None:
        self.enabled = enabled
        self.run_dir, self.total_steps = run_dir, total_steps
        self.bar: Any = None  # tqdm's, with train.progress
        if not enabled:  # (writer, jsonl and samples exist only where enabled: every method returns first)
            return
        from torch.utils.tensorboard import SummaryWriter

        earlier = (run_dir / "tensorboard").is_dir()  # TensorBoard then hides earlier events past start_step
        self.writer = BackgroundWriter(
            SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1 if earlier else None)
        )
        self.writer.add_custom_scalars(tags.CUSTOM_SCALARS_LAYOUT)
        _keep_rows_up_to(run_dir / "metrics.jsonl", start_step)
        _keep_rows_up_to(run_dir / "samples.jsonl", start_step)
        self.jsonl = open(run_dir / "metrics.jsonl", "a")
        self.samples = open(run_dir / "samples.jsonl", "a")
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc=run_dir.name, unit="step", dynamic_ncols=True)

    def log(
        self,
        step: int,
        scalars: dict[str, float],
        routing: dict[str, dict[str, Tensor]],
        histograms: dict[str, Tensor] | None = None,
        samples: Sequence[SampleRecord] = (),
    ) -> None:
        """``routing``: :meth:`moe_rl.routing.monitor.RoutingMonitor.reduce`'s groups;
        ``histograms`` (e.g. per-token log-ratios) come from this rank's share of the batch;
        ``samples`` go to ``samples.jsonl`` and TensorBoard's text tab."""
        if not self.enabled:
            return
        if samples:
            records = list(samples)  # the table is built on the writer's thread
            self.writer.add_text_of(SAMPLES_TAG, lambda: samples_markdown(records), step)
            _append(self.samples, "".join(json.dumps(r.to_dict()) + "\n" for r in samples))
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        for tag, values in (histograms or {}).items():
            self.writer.add_finite_histogram(tag, values, step)
        written = self._log_routing(step, routing)
        self.writer.flush()
        _append(self.jsonl, json.dumps({"step": step, **scalars, **written}) + "\n")
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(
                reward=f"{scalars.get(tags.REWARD_TOTAL, 0.0):.3f}", loss=f"{scalars.get(tags.TRAIN_LOSS, 0.0):.3f}"
            )
        else:
            self._print(step_line(step, self.total_steps, scalars))
        self._print(eval_table(step, scalars))

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """Scalars outside a training step (the evaluation before the first)."""
        if not self.enabled or not scalars:
            return
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()
        _append(self.jsonl, json.dumps({"step": step, **scalars}) + "\n")
        self._print(eval_table(step, scalars))

    def summary(self, steps_run: int, scalars: dict[str, float], checkpoint: Path | None, seconds: float) -> None:
        """The end of a run: what it reached and where to look (below the closed progress bar,
        which is not drawn again after it)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if steps_run <= 0:
            self._print(
                f"{self.run_dir.name}: nothing to do, its checkpoints already reach train.steps (raise it to go on)"
            )
            return
        lines = [
            f"{self.run_dir.name}: {steps_run} step(s) in {seconds:.0f}s"
            + (f", {step_line(0, 0, scalars, short=True)}" if scalars else "")
        ]
        evaluation = {k: v for k, v in scalars.items() if k.startswith("eval/pass@")}
        if evaluation:
            lines.append("  held-out: " + ", ".join(f"{k.split('/', 1)[1]} {v:.3f}" for k, v in evaluation.items()))
        if checkpoint is not None:
            lines.append(f"  checkpoint: {checkpoint}")
        lines.append(f"  metrics: {self.run_dir / 'metrics.jsonl'}; samples: {self.run_dir / 'samples.jsonl'}")
        lines.append(f"  TensorBoard: tensorboard --logdir {self.run_dir / 'tensorboard'}")
        self._print("\n".join(lines))

    def _print(self, text: str) -> None:
        """A console line that keeps the progress bar intact."""
        if not text:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def _log_routing(self, step: int, routing: dict[str, dict[str, Tensor]]) -> dict[str, float]:
        """Each group under its tags; expert load goes with old->new (same prefix)."""
        if not routing:  # routing metrics off: not even matplotlib's import
            return {}
        from moe_rl.routing.tensorboard import log_routing

        written: dict[str, float] = {}
        images = step % 10 == 0
        for group in (
            "old_vs_new",
            "train_vs_rollout",
            "train_vs_rollout_environment",
            "replayed",
            "expert_bias_effect",
        ):
            if group in routing:
                metrics = dict(routing[group])
                if group == "old_vs_new" and "load" in routing:
                    metrics.update(routing["load"])
                written.update(log_routing(self.writer, step, metrics, group=group, images=images))
        if "load" in routing and "old_vs_new" not in routing:
            written.update(log_routing(self.writer, step, routing["load"], group="load", images=images))
        return written

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        self.writer.close()
        self.jsonl.close()
        self.samples.close()


class BackgroundWriter:
    """A TensorBoard ``SummaryWriter`` whose calls run in order on one worker thread, so
    that building summaries (protobufs, histograms, figures) and flushing the event file
    stay off the training step. The scalars of one step go into one event (a ``Summary``
    with a value per tag, as TensorFlow's merged summaries, where ``add_scalar`` would write
    an event per tag at several times the cost). ``metrics.jsonl`` stays written synchronously: it is
    the record a crash cannot lose. :meth:`close` drains the queue; an error in a call is
    raised by the next call or by :meth:`close`."""

    def __init__(self, writer: Any) -> None:
        self._writer = writer
        # TensorBoard's default ("tensorflow") bin edges as one array: given its list,
        # np.histogram converts the ~1,500 edges on every call (~0.1 ms); the same histogram
        self._bins = np.asarray(writer.default_bins)
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._failed = False  # an error of the thread's has been raised
        self._scalars: list[tuple[str, float]] = []  # of step self._scalars_step, not yet queued
        self._scalars_step = 0
        self._thread = threading.Thread(target=self._serve, name="moe-rl-tensorboard", daemon=True)
        self._thread.start()

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._raise_error()
        if self._scalars and step != self._scalars_step:
            self._queue_scalars()
        self._scalars.append((tag, float(value)))
        self._scalars_step = step

    def add_histogram(self, tag: str, values: Tensor, step: int) -> None:
        self._submit("add_histogram", tag, values, step, bins=self._bins)

    def add_histogram_raw(self, tag: str, **kwargs: Any) -> None:
        self._submit("add_histogram_raw", tag, **kwargs)

    def add_figure(self, tag: str, figure: Any, step: int, close: bool = True) -> None:
        self._submit("add_figure", tag, figure, step, close=close)

    def add_text(self, tag: str, text: str, step: int) -> None:
        self._submit("add_text", tag, text, step)

    def add_text_of(self, tag: str, make_text: Callable[[], str], step: int) -> None:
        """``add_text`` of ``make_text()``, called on the writer's thread."""
        self._raise_error()
        self._queue_scalars()
        self._calls.put((lambda: self._writer.add_text(tag, make_text(), step), (), {}))

    def add_finite_histogram(self, tag: str, values: Tensor, step: int) -> None:
        """``add_histogram`` of the finite ``values`` (NaN/Inf, e.g. an engine's log-probs,
        cannot be binned), none when none is; filtered on the writer's thread."""
        self._raise_error()
        self._queue_scalars()
        self._calls.put((self._finite_histogram, (tag, values, step), {}))

    def _finite_histogram(self, tag: str, values: Tensor, step: int) -> None:
        values = values.float()[torch.isfinite(values)]
        if values.numel():
            self._writer.add_histogram(tag, values, step, bins=self._bins)

    def add_custom_scalars(self, layout: dict) -> None:
        self._submit("add_custom_scalars", layout)

    def flush(self) -> None:
        self._submit("flush")

    def close(self) -> None:
        """Write everything queued, then close the event file (after a failure already
        raised, quietly: the event file's writer raises the same error again)."""
        self._queue_scalars()
        if self._thread.is_alive():
            self._calls.put(None)
            self._thread.join()
        try:
            self._writer.close()
        except Exception:
            if not self._failed:
                raise
        self._raise_error()

    def _submit(self, method: str, *args: Any, **kwargs: Any) -> None:
        self._raise_error()
        self._queue_scalars()
        self._calls.put((getattr(self._writer, method), args, kwargs))

    def _queue_scalars(self) -> None:
        if self._scalars:
            self._calls.put((self._write_scalars, (self._scalars, self._scalars_step), {}))
            self._scalars = []

    def _write_scalars(self, scalars: list[tuple[str, float]], step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        # the values torch.utils.tensorboard.summary.scalar makes, without its numpy
        # round trip per tag (most of this thread's time, taken from the training thread's GIL)
        values = [Summary.Value(tag=tag, simple_value=x) for tag, x in scalars]
        self._writer.file_writer.add_summary(Summary(value=values), step)

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error, self._failed = self._error, None, True
            if space_error(error) is not None:
                raise OutOfSpace(self._writer.log_dir, error) from error
            raise RuntimeError(f"writing TensorBoard events failed: {error!r}") from error

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            method, args, kwargs = call
            if self._error is None:  # calls after a failure are dropped until it has been raised
                try:
                    method(*args, **kwargs)
                except BaseException as e:  # noqa: BLE001 - handed to the training thread
                    self._error = e


def _append(log: TextIO, text: str) -> None:
    """``text`` written and flushed to the open ``log``; a failure names its file (a write to
    an open file names none: a full disk must say where)."""
    try:
        log.write(text)
        log.flush()
    except OSError as e:
        raise with_path(e, log.name) from e


def _keep_rows_up_to(path: Path, step: int) -> None:
    """Rewrite a JSON-lines log (``metrics.jsonl``, ``samples.jsonl``) without the rows past
    ``step`` (and any torn last line)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)
