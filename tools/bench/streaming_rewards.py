"""Rewards scored at the end of generation vs as each group finishes (``reward.score_as_finished``).

    .venv/bin/python -m tools.bench.streaming_rewards [--steps 4] [--token-delay-s 0.02] [--json FILE]

One SGLang-protocol stand-in (``tests/support/sglang_test_server.py``) on a tiny random MoE,
holding each reply ``--token-delay-s`` per output token (a decode time that grows with
length), sampled with extra stop tokens so that response lengths are long-tailed (most
short, a few up to ``--max-new-tokens``); a reward that waits ``--reward-s`` per sample (an
external verifier or sandbox). Each step runs the collector's ``generate_and_score`` on the
same problems and seeds in both modes, alternating (end, as-finished, as-finished, end, ...)
so that machine drift hits both alike; the stand-in is deterministic, so both modes score
the very same responses. Reports per mode the median step time, generation time (until the
last response) and the wait for rewards after it, and the share of the end mode's reward
wait that scoring as groups finish hides.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MODES = ("end", "as_finished")


def verifier(sample: Any, seconds: float = 0.05) -> float:
    """A reward that costs ``seconds`` of waiting (an external check), 1 for a boxed answer."""
    time.sleep(seconds)
    return float("\\boxed{" in sample.response)


class TimedSampler:
    """A sampler that remembers how long its last ``sample`` call took (the generation)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler, self.seconds = sampler, 0.0

    def sample(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.sampler.sample(*args, **kwargs)
        finally:
            self.seconds = time.perf_counter() - start


def measure(args: argparse.Namespace) -> dict:
    from moe_rl.data.prompts import PromptFormatter
    from moe_rl.data.tasks import ArithmeticChainTask
    from moe_rl.data.tokenizer import demo_tokenizer, vocab_size
    from moe_rl.experience.collector import generate_and_score
    from moe_rl.models.tiny import save_tiny_checkpoint
    from moe_rl.rewards import RewardScorer, RewardSpec
    from moe_rl.rollout.sglang.engine import SGLangEngine
    from moe_rl.rollout.sglang.server import ServerSettings, SGLangServer
    from moe_rl.rollout.single_turn import SingleTurnSampler
    from moe_rl.rollout.types import SamplingParams
    from parallel.launch import free_port

    tmp = Path(tempfile.mkdtemp())
    tokenizer = demo_tokenizer()
    hf_dir = save_tiny_checkpoint(tmp / "hf", "qwen3_moe", seed=0, vocab_size=vocab_size(), num_hidden_layers=1)
    stand_in = [sys.executable, "-W", "ignore", str(ROOT / "tests" / "support" / "sglang_test_server.py")]
    settings = ServerSettings(
        model_path=hf_dir,
        port=free_port(),
        device="cuda",  # "cuda": no CPU flags (the stand-in knows none)
        deterministic=True,
        launch_command=stand_in,
        extra_args=["--token-delay-s", str(args.token_delay_s)],
    )
    # the demo tokenizer's EOS and two frequent pieces stop a response: geometric, long-tailed lengths
    sampling = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=1.0, stop_token_ids=(tokenizer.eos_token_id, 5, 6)
    )
    spec = RewardSpec("verified", "tools.bench.streaming_rewards:verifier", 1.0, {"seconds": args.reward_s})
    scorers = {mode: RewardScorer([spec], timeout_s=60.0, score_as_finished=mode == "as_finished") for mode in MODES}
    rows: dict[str, list[dict]] = {mode: [] for mode in MODES}
    task, formatter = ArithmeticChainTask(9), PromptFormatter(tokenizer)
    with SGLangServer(settings, tmp / "logs") as server:
        server.wait_healthy(timeout_s=300)
        sampler = TimedSampler(SingleTurnSampler(SGLangEngine([server.url], max_concurrency=256)))
        for step in range(args.steps + 1):  # step 0 warms both modes up, and is not counted
            for mode in MODES if step % 2 == 0 else MODES[::-1]:
                problems = task.problems(0, step, args.prompts)
                start = time.perf_counter()
                sampled = generate_and_score(
                    problems, formatter, sampler, scorers[mode], sampling, args.group_size, seed=step
                )
                seconds = time.perf_counter() - start
                lengths = [len(s.output_ids) for s in sampled.samples]
                row = {"step_s": seconds, "generation_s": sampler.seconds, "lengths": lengths}
                row["reward_wait_s"] = seconds - sampler.seconds
                row["rewards"] = sampled.rewards.values[:, 0].tolist()
                if step:
                    rows[mode].append(row)
                print(f"step {step} {mode:11s}: {seconds:.2f} s (generation {sampler.seconds:.2f} s)", flush=True)
    for scorer in scorers.values():
        scorer.close()
    return summary(rows, args)


def summary(rows: dict[str, list[dict]], args: argparse.Namespace) -> dict:
    """Median figures per mode; the responses' lengths; the share of the reward wait hidden."""
    table: dict[str, Any] = {
        mode: {key: statistics.median(r[key] for r in runs) for key in ("step_s", "generation_s", "reward_wait_s")}
        for mode, runs in rows.items()
    }
    lengths = sorted(n for r in rows["end"] for n in r["lengths"])
    table["lengths"] = {
        "median": statistics.median(lengths),
        "mean": statistics.mean(lengths),
        "max": lengths[-1],
        "p90": lengths[int(0.9 * (len(lengths) - 1))],
    }
    table["same_rewards"] = all(a["rewards"] == b["rewards"] for a, b in zip(rows["end"], rows["as_finished"]))
    table["reward_s_per_step"] = args.reward_s * args.prompts * args.group_size
    end, streamed = table["end"], table["as_finished"]
    table["hidden_share"] = 1 - streamed["reward_wait_s"] / end["reward_wait_s"] if end["reward_wait_s"] else 0.0
    table["speedup"] = end["step_s"] / streamed["step_s"]
    table["settings"] = {
        key: getattr(args, key)
        for key in ("steps", "prompts", "group_size", "max_new_tokens", "token_delay_s", "reward_s")
    }
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="steps measured per mode (after one warm-up step)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--token-delay-s", type=float, default=0.02, help="the stand-in's hold per output token")
    parser.add_argument("--reward-s", type=float, default=0.05, help="seconds each reward call waits")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    table = measure(args)
    for mode in MODES:
        row = table[mode]
        print(
            f"{mode:11s}: median step {row['step_s']:.2f} s = generation {row['generation_s']:.2f} s"
            f" + reward wait {row['reward_wait_s']:.2f} s"
        )
    lengths = table["lengths"]
    print(
        f"response lengths: median {lengths['median']:.0f}, mean {lengths['mean']:.1f}, p90 {lengths['p90']},"
        f" max {lengths['max']} tokens; reward work per step {table['reward_s_per_step']:.2f} s"
    )
    print(
        f"scoring as groups finish hides {table['hidden_share']:.0%} of the reward wait;"
        f" step time {table['speedup']:.2f}x faster; same rewards: {table['same_rewards']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
