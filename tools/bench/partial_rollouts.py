"""Generation that waits for every response vs partial rollouts (``rollout.partial``).

    .venv/bin/python -m tools.bench.partial_rollouts [--steps 6] [--groups 8] [--group-size 4]
        [--extra-groups 4] [--max-new-tokens 96] [--token-delay-s 0.03] [--real] [--json FILE]

One SGLang-protocol stand-in (``tests/support/sglang_test_server.py``) on a tiny random MoE,
holding each reply ``--token-delay-s`` per output token outside its model lock (a decode
time that grows with length; an abort during the hold returns the tokens "decoded" so far),
sampled with extra stop tokens so that response lengths are long-tailed. ``--real``: real
SGLang 0.5.23 on its CPU backend on the same checkpoint instead (real decode time, no delay).

Each step k loads the weights again as version ``k``, then generates the step's fresh
arithmetic problems in both modes, alternating which goes first so that drift hits both:
``off`` is the plain ``engine.generate`` of ``--groups`` groups, waiting for every response;
``on`` is one :class:`~moe_rl.rollout.partial.PartialRollout` kept across steps: it continues
the groups it carried and starts ``fresh_groups_wanted()`` new ones, returns once ``--groups``
are done, aborts the rest and carries them on. The first ``on`` step has no carry.

Per mode and step: the generation's wall time, the tokens generated in it (``on``: all its
groups' output tokens after the call minus those they had before), the tokens in the groups
returned to train on, and an idle share: ``1 - busy / (wall x requests sent)``, where a
request's busy time is its tokens generated in the call x ``--token-delay-s`` (the share of
the request slots' time spent waiting, not "decoding"; ``n/a`` with ``--real``). On CPU and
the stand-in the absolute numbers mean little (the stand-in computes each response up front
under one lock, 2 shared cores); what they show is the shape: how much of a step's
generation goes to waiting for its longest responses, and what carrying them saves.
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
MODES = ("off", "on")


def tokens(groups: Any) -> int:
    return sum(len(s.output_ids) for g in groups for s in g)


def measure(args: argparse.Namespace) -> dict:
    from moe_rl.data.prompts import PromptFormatter
    from moe_rl.data.tasks import ArithmeticChainTask
    from moe_rl.data.tokenizer import demo_tokenizer, vocab_size
    from moe_rl.models.tiny import save_tiny_checkpoint
    from moe_rl.rollout.partial import PartialRollout
    from moe_rl.rollout.sglang.engine import SGLangEngine
    from moe_rl.rollout.sglang.server import ServerSettings, SGLangServer
    from moe_rl.rollout.types import SamplingParams
    from parallel.launch import free_port

    tmp = Path(tempfile.mkdtemp())
    tokenizer = demo_tokenizer()
    hf_dir = save_tiny_checkpoint(tmp / "hf", "qwen3_moe", seed=0, vocab_size=vocab_size(), num_hidden_layers=1)
    tokenizer.save_pretrained(hf_dir)  # (real SGLang loads a tokenizer with the model)
    if args.real:
        command = [str(ROOT / ".venv-sglang" / "bin" / "python"), "-m", "sglang.launch_server"]
        device, extra = "cpu", []
    else:
        command = [sys.executable, "-W", "ignore", str(ROOT / "tests" / "support" / "sglang_test_server.py")]
        device, extra = "cuda", ["--token-delay-s", str(args.token_delay_s)]  # "cuda": no CPU flags
    settings = ServerSettings(
        model_path=hf_dir,
        port=free_port(),
        device=device,
        deterministic=not args.real,
        launch_command=command,
        extra_args=extra,
    )
    # the demo tokenizer's EOS and two frequent pieces stop a response: geometric, long-tailed lengths
    sampling = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=1.0, stop_token_ids=(tokenizer.eos_token_id, 5, 6)
    )
    rows: dict[str, list[dict]] = {mode: [] for mode in MODES}
    task, formatter = ArithmeticChainTask(9), PromptFormatter(tokenizer)
    n, delay = args.group_size, 0.0 if args.real else args.token_delay_s
    server = SGLangServer(settings, tmp / "logs")
    try:
        server.wait_healthy(timeout_s=400 if args.real else 120)
        engine = SGLangEngine([server.url], max_concurrency=256)
        engine.update_weights_from_disk(hf_dir, "0")
        engine.generate([formatter.encode(p)[0] for p in task.problems(0, 0, 2)], 2, sampling, seed=0)  # warm-up
        partial = PartialRollout(engine, n, args.groups, args.extra_groups, max_staleness=args.max_staleness)
        for step in range(1, args.steps + 1):
            engine.update_weights_from_disk(hf_dir, str(step))
            problems = task.problems(0, step, args.groups + args.extra_groups)
            prompts = [ids for ids, _ in formatter.encode_all(problems)]
            for mode in MODES if step % 2 else MODES[::-1]:
                if mode == "off":
                    start = time.perf_counter()
                    groups = engine.generate(prompts[: args.groups], n, sampling, seed=step)
                    wall = time.perf_counter() - start
                    row = {"new_tokens": tokens(groups), "trained_tokens": tokens(groups), "requests": args.groups * n}
                else:
                    members = [s for g in partial.carried for s in g.samples]
                    stale = [bool(s.output_ids) and step - int(s.weight_version) > args.max_staleness for s in members]
                    fresh = partial.fresh_groups_wanted()  # (members started over count as sent, not as kept)
                    sent = sum(s.finish_reason == "abort" or st for s, st in zip(members, stale)) + fresh * n
                    before = sum(len(s.output_ids) for s, st in zip(members, stale) if not st)
                    start = time.perf_counter()
                    out = partial.sample(
                        problems[:fresh], prompts[:fresh], sampling, seed=step, step=step, routed=False
                    )
                    wall = time.perf_counter() - start
                    after = tokens(out.groups) + out.carried_tokens
                    aborted = [s for g in partial.carried for s in g.samples if s.finish_reason == "abort"]
                    row = {
                        "new_tokens": after - before,
                        "trained_tokens": tokens(out.groups),
                        "requests": sent,
                        "fresh_groups": fresh,
                        "carried_groups": out.carried,
                        "carried_tokens": out.carried_tokens,
                        "restarted": out.restarted,
                        "aborted_without_tokens": sum(not s.output_ids for s in aborted),
                        "aborted": len(aborted),
                        "staleness": max(step - int(s.weight_version) for g in out.groups for s in g),
                        "segments": max(len(s.segments) for g in out.groups for s in g),
                    }
                    groups = out.groups
                row["wall_s"] = wall
                row["lengths"] = [len(s.output_ids) for g in groups for s in g]
                busy = row["new_tokens"] * delay
                row["idle_share"] = 1 - busy / (wall * row["requests"]) if delay else None
                rows[mode].append(row)
                print(
                    f"step {step} {mode:3s}: {wall:.2f} s, {row['new_tokens']} tokens generated,"
                    f" {row['trained_tokens']} trained"
                    + (f"; carried {out.carried} groups / {out.carried_tokens} tokens" if mode == "on" else ""),
                    flush=True,
                )
    finally:
        server.stop()
    return summary(rows, args)


def summary(rows: dict[str, list[dict]], args: argparse.Namespace) -> dict:
    """Median figures per mode; the ON/OFF ratio of the median generation time; ON's carry."""
    table: dict[str, Any] = {}
    for mode, runs in rows.items():
        idle = [r["idle_share"] for r in runs if r["idle_share"] is not None]
        table[mode] = {
            "generation_s": statistics.median(r["wall_s"] for r in runs),
            "tokens_per_s": statistics.median(r["new_tokens"] / r["wall_s"] for r in runs),
            "trained_tokens": statistics.median(r["trained_tokens"] for r in runs),
            "idle_share": statistics.median(idle) if idle else None,
        }
    on = rows["on"]
    table["carry"] = {
        "carried_groups": [r["carried_groups"] for r in on],
        "carried_tokens": [r["carried_tokens"] for r in on],
        "restarted": sum(r["restarted"] for r in on),
        "aborted": sum(r["aborted"] for r in on),
        "aborted_without_tokens": sum(r["aborted_without_tokens"] for r in on),
        "max_staleness": max(r["staleness"] for r in on),
        "max_segments": max(r["segments"] for r in on),
    }
    lengths = sorted(n for r in rows["off"] for n in r["lengths"])
    table["off_lengths"] = {"median": statistics.median(lengths), "max": lengths[-1]}
    table["ratio_on_off"] = table["on"]["generation_s"] / table["off"]["generation_s"]
    table["steps"] = rows
    table["settings"] = {
        key: getattr(args, key)
        for key in ("steps", "groups", "group_size", "extra_groups", "max_new_tokens", "token_delay_s", "real")
    }
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--groups", type=int, default=8, help="groups trained per step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--extra-groups", type=int, default=4, help="partial: groups started beyond --groups")
    parser.add_argument("--max-staleness", type=int, default=2)
    # (the tiny model's context is 128 tokens: --real takes at most ~112)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    # long enough for decoding, not the stand-in's up-front compute under its lock, to set a reply's time
    parser.add_argument("--token-delay-s", type=float, default=0.03, help="the stand-in's hold per output token")
    parser.add_argument("--real", action="store_true", help="real SGLang 0.5.23 on CPU (no token delay)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    table = measure(args)
    print(f"{'mode':4s} {'gen s/step':>10s} {'tokens/s':>9s} {'trained tok/step':>16s} {'idle share':>10s}")
    for mode in MODES:
        row = table[mode]
        idle = "n/a" if row["idle_share"] is None else f"{row['idle_share']:.0%}"
        print(
            f"{mode:4s} {row['generation_s']:10.2f} {row['tokens_per_s']:9.0f}"
            f" {row['trained_tokens']:16.0f} {idle:>10s}"
        )
    carry = table["carry"]
    print(
        f"on/off median generation time: {table['ratio_on_off']:.2f}; off lengths median"
        f" {table['off_lengths']['median']:.0f}, max {table['off_lengths']['max']}"
    )
    print(
        f"on carried groups per step {carry['carried_groups']}, tokens {carry['carried_tokens']};"
        f" max staleness {carry['max_staleness']}, max segments {carry['max_segments']},"
        f" restarted {carry['restarted']}, aborted {carry['aborted']}"
        f" ({carry['aborted_without_tokens']} without tokens)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
