"""One GRPO step (rollout + update) of the same tiny Qwen3-MoE and batch in TRL's
GRPOTrainer and in moe-rl, each in its own process; prints JSON (median step time,
peak RSS). Run by tools/bench.py; needs `pip install trl` for the TRL side.

    python tools/bench_peer.py --side trl|moe-rl --model DIR [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")
PROMPTS, GROUP, NEW_TOKENS = 8, 4, 6


def trl_side(model_dir: str, steps: int) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from moe_rl.data.tasks import ArithmeticTask
    from moe_rl.rewards import RewardInput
    from moe_rl.rewards.rules import math_correct

    problems = [p for s in range(steps + 2) for p in ArithmeticTask().problems(1, s, PROMPTS)]
    data = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def correct(completions, answer, **_):
        return [math_correct(RewardInput("", c, a)) for c, a in zip(completions, answer)]

    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=PROMPTS * GROUP, num_generations=GROUP,
        max_completion_length=NEW_TOKENS, max_steps=steps, learning_rate=2e-4, logging_steps=100, report_to=[],
        bf16=False, use_cpu=True, loss_type="dapo", gradient_checkpointing=False, save_strategy="no", beta=0.0,
        temperature=1.0, dataloader_num_workers=0, seed=1,
    )  # fmt: skip
    trainer = GRPOTrainer(model=model_dir, reward_funcs=[correct], args=args, train_dataset=data, processing_class=tokenizer,
                          callbacks=[Timer()])  # fmt: skip
    trainer.train()
    return {"step_times": times}


def moe_rl_side(model_dir: str, steps: int, run_dir: str) -> dict:
    overrides = [
        f"model.hf_dir={model_dir}", f"train.run_dir={run_dir}", f"train.steps={steps}", "train.progress=false",
        f"rollout.prompts_per_step={PROMPTS}", f"rollout.group_size={GROUP}", f"rollout.max_new_tokens={NEW_TOKENS}",
        "algorithm.updates_per_batch=1", "routing.metrics=false", "algorithm.micro_batch_size=32",
        "reward.rewards=[{name: correct, fn: math_correct}]", "reward.conditionals=[]",
    ]  # fmt: skip
    from moe_rl.cli import main

    code = main(["train", *overrides])
    if code != 0:
        raise SystemExit(code)
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {"step_times": [r["perf/step_time_s"] for r in rows]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", choices=["trl", "moe-rl"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    if args.side == "trl":
        out = trl_side(args.model, args.steps)
    else:
        out = moe_rl_side(args.model, args.steps, tempfile.mkdtemp())
    times = out["step_times"][1:] or out["step_times"]  # the first step warms up
    out.update(median_step_s=statistics.median(times), peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print("BENCH_JSON " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
