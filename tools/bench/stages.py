"""Where one moe-rl step's time goes: the trainer's stages timed inside one training
process (the same tiny Qwen3-MoE, batch and settings as ``tools/bench/peer.py``'s moe-rl
side), medians over the steps after the first few; prints a table and JSON.

    python -m tools.bench.stages [--model DIR] [--steps 30] [--warmup 3] [key=value ...]

The timers are wrappers put around the trainer's methods and functions from outside, in
this process only: the trainer itself carries no timing code and pays nothing for it.
Times are wall clock and inclusive (a stage's row contains its indented sub-stages);
"other" rows are a stage's time its sub-stages do not cover. ``perf/step_time_s`` (what
``bench/peer.py`` compares with TRL) spans ``train_step`` up to its scalars; the logging
and the end-of-step checkpoint work follow it inside the loop, and the "loop" row spans
both. The TensorBoard thread's work is timed on its own thread (it overlaps the next step
and competes with it for the cores). Works on older commits too: a stage whose function
does not exist there is left out.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections import defaultdict

warnings.filterwarnings("ignore")

# (name, depth, "module:attribute" or "module:Class.method", alternatives after "|" for
# older layouts): the table's rows in order
STAGES = [
    ("loop", 0, None),  # one iteration of Trainer.train's loop: train_step and the end of step
    ("train_step", 1, "moe_rl.trainer.trainer:Trainer.train_step"),
    ("collect_experience", 2, "moe_rl.trainer.trainer:Trainer.collect_experience"),
    ("prompt encoding", 3, "moe_rl.data.prompts:PromptFormatter.encode_all"),
    (
        "rollout: generation",
        3,
        "moe_rl.rollout.single_turn:SingleTurnSampler.sample|moe_rl.rollout.multi_turn:SingleTurnSampler.sample"
        "|moe_rl.rollout.local:LocalEngine.generate",
    ),
    ("local engine generate", 4, "moe_rl.rollout.local:LocalEngine.generate"),
    ("rollout: decode responses", 3, "moe_rl.experience.collector:_response_texts"),
    ("rewards", 3, "moe_rl.rewards.scorer:RewardScorer.score"),
    (
        "advantages",
        3,
        "moe_rl.experience.collector:compute_advantages|moe_rl.experience.collector:group_advantages"
        "|moe_rl.trainer.experience:compute_advantages",
    ),
    (
        "rollout scalars",
        3,
        "moe_rl.experience.collector:ExperienceCollector._scalars"
        "|moe_rl.trainer.experience:ExperienceCollector._scalars",
    ),
    ("sample records (decode)", 3, "moe_rl.trainer.trainer:sample_records"),
    ("flat-reward watch", 3, "moe_rl.experience.sample_log:FlatRewardWatch.observe"),
    ("share experience", 3, "moe_rl.trainer.trainer:share_experience"),
    ("make_batch (plan + tensors)", 2, "moe_rl.trainer.trainer:Trainer.make_batch"),
    ("old log-prob pass", 2, "moe_rl.trainer.trainer:Trainer.compute_old_logprobs"),
    ("reference log-prob pass", 2, "moe_rl.trainer.trainer:Trainer.compute_reference_logprobs"),
    ("kept counts", 2, "moe_rl.trainer.trainer:kept_counts"),
    ("update_policy", 2, "moe_rl.trainer.trainer:Trainer.update_policy"),
    ("forward (model + loss)", 3, "megatron.core.pipeline_parallel.schedules:forward_step"),
    ("loss + its metrics", 4, "moe_rl.trainer.objective:PolicyObjective.__call__"),
    ("backward", 3, "megatron.core.pipeline_parallel.schedules:backward_step"),
    ("grad finalize", 3, "megatron.core.distributed.finalize_model_grads:finalize_model_grads"),
    ("finite-grad check", 3, "parallel.optim:_grads_finite"),
    ("optimizer step", 3, None),  # the optimizer's own step(), wrapped on the instance
    ("after-update routing pass", 2, "moe_rl.trainer.trainer:Trainer.measure_routing_after_update"),
    (
        "weight sync (push)",
        2,
        "moe_rl.rollout.weight_sync.in_process:InProcessSync.push|moe_rl.rollout.weight_sync:InProcessSync.push",
    ),
    ("metric reductions", 2, None),  # the reduce_* functions together
    ("padding frac", 2, "moe_rl.trainer.trainer:padding_frac"),
    ("log-ratio histogram values", 2, "moe_rl.trainer.trainer:log_ratio_values"),
    ("logging (jsonl, TB queue, console)", 2, "moe_rl.trainer.metrics:StepLogger.log"),
    ("end of step", 1, "moe_rl.trainer.trainer:Trainer._end_of_step"),
    ("checkpoint poll", 2, "moe_rl.checkpoint.store:Checkpointer.poll|moe_rl.trainer.checkpoint:Checkpointer.poll"),
    ("TensorBoard thread (overlaps)", 0, None),
]
REDUCTIONS = (
    "reduce_step",
    "reduce_update_metrics",
    "reduce_mismatch",
    "reduce_offpolicy",
)  # this version's, then older ones


class Clock:
    """Per step, each stage's summed wall time (the step is train_step's call count)."""

    def __init__(self) -> None:
        self.step = -1
        self.times: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.lock = threading.Lock()

    def add(self, name: str, seconds: float) -> None:
        with self.lock:
            self.times[self.step][name] += seconds

    def timed(self, name: str, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - start)

        return wrapper


def _resolve(spec: str):
    module_name, attr = spec.split(":")
    module = importlib.import_module(module_name)
    owner, _, name = attr.rpartition(".")
    holder = getattr(module, owner) if owner else module
    return holder, name


def install(clock: Clock) -> list[str]:
    """Wrap every stage that exists in this version; the names of those that do not."""
    missing = []
    for name, _, spec in STAGES:
        if spec is None:
            continue
        for candidate in spec.split("|"):
            try:
                holder, attr = _resolve(candidate)
                setattr(holder, attr, clock.timed(name, getattr(holder, attr)))
                break
            except (ImportError, AttributeError):
                continue
        else:
            missing.append(name)
    trainer_mod = importlib.import_module("moe_rl.trainer.trainer")
    for fn in REDUCTIONS:
        if hasattr(trainer_mod, fn):
            setattr(trainer_mod, fn, clock.timed("metric reductions", getattr(trainer_mod, fn)))
    Trainer = trainer_mod.Trainer
    step_fn = Trainer.train_step
    loop_start: list[float] = []

    def train_step(self, step):
        now = time.perf_counter()
        if loop_start:
            clock.add("loop", now - loop_start[0])
        loop_start[:] = [now]
        clock.step = step
        if not getattr(self, "_bench_optimizer_timed", False):  # the optimizer's own step()
            opt = self.policy.optimizer
            opt.step = clock.timed("optimizer step", opt.step)
            self._bench_optimizer_timed = True
        return step_fn(self, step)

    Trainer.train_step = train_step
    try:  # the TensorBoard thread: each queued call timed where it runs
        from moe_rl.trainer.metrics import BackgroundWriter

        serve = BackgroundWriter._serve

        class TimedCalls:  # the writer's queue, each call timed as the thread takes it
            def __init__(self, calls):
                self.calls = calls

            def put(self, call):
                self.calls.put(call)

            def get(self):
                call = self.calls.get()
                if call is None:
                    return None
                method, args, kwargs = call
                return clock.timed("TensorBoard thread (overlaps)", method), args, kwargs

        def timed_serve(self):
            self._calls = TimedCalls(self._calls)
            return serve(self)

        BackgroundWriter._serve = timed_serve
    except (ImportError, AttributeError):
        pass
    return missing


def table(clock: Clock, warmup: int, missing: list[str]) -> tuple[list[dict], str]:
    steps = sorted(s for s in clock.times if s >= warmup)
    rows, lines = [], []
    present = [(n, d) for n, d, _ in STAGES if n not in missing]
    medians = {n: statistics.median(clock.times[s].get(n, 0.0) for s in steps) for n, _ in present}
    step_median = medians.get("train_step", 0.0)
    width = max(len(n) + 2 * d for n, d in present) + 2
    lines.append(f"{'stage':<{width}} {'median ms':>10} {'% of step':>10}")
    for i, (name, depth) in enumerate(present):
        ms = medians[name] * 1e3
        if name != "loop" and ms < 0.005 and not any(clock.times[s].get(name) for s in steps):
            continue  # never ran in this configuration (e.g. the old pass when on-policy)
        rows.append({"stage": name, "depth": depth, "median_ms": ms})
        share = f"{100 * medians[name] / step_median:9.1f}%" if step_median else ""
        lines.append(f"{'  ' * depth + name:<{width}} {ms:10.2f} {share:>10}")
        children = []
        for child, cdepth in present[i + 1 :]:
            if cdepth <= depth:
                break
            if cdepth == depth + 1:
                children.append(child)
        if children and name not in ("loop",):
            per_step = [
                clock.times[s].get(name, 0.0) - sum(clock.times[s].get(c, 0.0) for c in children) for s in steps
            ]
            other = statistics.median(per_step) * 1e3
            rows.append({"stage": f"{name}: other", "depth": depth + 1, "median_ms": other})
            lines.append(f"{'  ' * (depth + 1) + '(other)':<{width}} {other:10.2f}")
    return rows, "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="the tiny model's HF directory (default: the demo model's)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3, help="first steps not counted")
    p.add_argument("overrides", nargs="*", help="more key=value settings")
    args = p.parse_args()
    from tools.bench.peer import moe_rl_overrides

    if args.model is None:
        from tools.bench.run import _demo_model

        args.model = _demo_model()
    clock = Clock()
    missing = install(clock)
    run_dir = tempfile.mkdtemp()
    from moe_rl.cli import main as cli

    overrides = [*moe_rl_overrides(args.model, args.steps, run_dir), *args.overrides]
    stderr = sys.stderr
    sys.stderr = open(os.devnull, "w")  # the console lines
    try:
        code = cli(["train", *overrides])
    finally:
        sys.stderr.close()
        sys.stderr = stderr
    if code != 0:
        raise SystemExit(code)
    metrics = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    rows, text = table(clock, args.warmup, missing)
    step_time = statistics.median(r["perf/step_time_s"] for r in metrics[args.warmup :])
    print(text)
    print(f"perf/step_time_s median {step_time * 1e3:.2f} ms over {len(metrics) - args.warmup} steps")
    if missing:
        print("not in this version: " + ", ".join(missing))
    out = {"stages": rows, "perf_step_ms": step_time * 1e3, "steps": len(metrics) - args.warmup, "missing": missing}
    print("BENCH_JSON " + json.dumps(out))


if __name__ == "__main__":
    main()
