"""One GRPO step (rollout + update) of the same tiny Qwen3-MoE and batch in TRL's
GRPOTrainer and in moe-rl, each in its own process; prints JSON (median step time,
mean response tokens, peak RSS). Run by tools/bench/run.py; needs `pip install trl`.

    python -m tools.bench.peer --side both|trl|moe-rl --model DIR [--steps 24] [--steps-per-turn 3]
        [--new-tokens 6] [--device cpu|cuda]
    python -m tools.bench.peer --side ab --base CHECKOUT --model DIR [--steps 120]

``--device`` (default: cuda where a GPU is there, else cpu) is where both sides run: TRL with
``use_cpu`` off and bf16 on CUDA; on a CPU both processes see no GPU.

``--side both`` runs the two processes taking turns of a few steps (one runs while
the other waits for its turn): the machine's slow and fast spells, which last seconds,
then hit both sides alike, and each process's peak memory is still its own.
``--side ab`` runs this tree's moe-rl against another checkout's (``git worktree add
/tmp/base REF``) the same way, for changes smaller than the run-to-run spread of the
TRL ratio (the median turn ratio of this tree to the base; run it once with each side
starting, ``--first base`` and ``--first this``: an A/A run reads 0.985-0.989).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import select
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")
PROMPTS, GROUP, NEW_TOKENS = 8, 4, 6
TURN_TIMEOUT_S = 600.0
DEVICES = ("cpu", "cuda")


class Turns:
    """This side's end of the turn-taking pipes: a turn is ``steps`` steps; :meth:`wait`
    (before a step) blocks until this side's turn, :meth:`done` (after it) hands the turn
    over after its last step. Without pipes both return at once."""

    def __init__(self, fds: str | None, steps: int) -> None:
        self.go, self.finished = map(int, fds.split(",")) if fds else (None, None)
        self.steps, self.taken = steps, 0

    def wait(self) -> None:
        if self.go is not None and self.taken % self.steps == 0:
            if not select.select([self.go], [], [], TURN_TIMEOUT_S)[0] or not os.read(self.go, 1):
                raise SystemExit(f"no turn in {TURN_TIMEOUT_S:.0f}s: the other side stopped")

    def done(self) -> None:
        self.taken += 1
        if self.finished is not None and self.taken % self.steps == 0:
            os.write(self.finished, b".")

    def warm(self, times: list[float]) -> list[list[float]]:
        """The step times to compare, turn by turn: none of the first turn (warm-up) or the
        last (the side that finished first is saving and exiting meanwhile), and no turn's
        first step (it starts with caches the other process filled and its threads asleep).
        Without pipes: one turn of every step but the first."""
        if self.go is None:
            return [times[1:] or times]
        starts = range(self.steps, len(times), self.steps)[:-1]
        return [times[i + 1 : i + self.steps] for i in starts]


def trl_side(model_dir: str, steps: int, turns: Turns, new_tokens: int = NEW_TOKENS, device: str = "cpu") -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from moe_rl.data.tasks import ArithmeticTask
    from moe_rl.rewards import RewardInput
    from moe_rl.rewards.rules import math_correct

    problems = [p for s in range(steps + 2) for p in ArithmeticTask().problems(1, s, PROMPTS)]
    data = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def correct(completions, answer, completion_ids, **_):
        lengths.append(statistics.mean(len(c) for c in completion_ids))
        return [math_correct(RewardInput("", c, a)) for c, a in zip(completions, answer)]

    times: list[float] = []
    lengths: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            turns.wait()
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)
            turns.done()

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=PROMPTS * GROUP,
        num_generations=GROUP,
        max_completion_length=new_tokens,
        max_steps=steps,
        learning_rate=2e-4,
        logging_steps=100,
        report_to=[],
        bf16=device == "cuda",
        use_cpu=device == "cpu",
        loss_type="dapo",
        gradient_checkpointing=False,
        save_strategy="no",
        beta=0.0,
        temperature=1.0,
        dataloader_num_workers=0,
        seed=1,
    )
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=[correct],
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[Timer()],
    )
    trainer.train()
    return {"step_times": times, "response_tokens": lengths}


def moe_rl_overrides(model_dir: str, steps: int, run_dir: str, new_tokens: int = NEW_TOKENS) -> list[str]:
    """The moe-rl run this benchmark compares (the batch and settings TRL's side gets)."""
    return [
        f"model.hf_dir={model_dir}",
        f"train.run_dir={run_dir}",
        f"train.steps={steps}",
        "train.progress=false",
        f"rollout.prompts_per_step={PROMPTS}",
        f"rollout.group_size={GROUP}",
        f"rollout.max_new_tokens={new_tokens}",
        "algorithm.updates_per_batch=1",
        "routing.metrics=false",
        "algorithm.micro_batch_size=32",
        "reward.rewards=[{name: correct, fn: math_correct}]",
        "reward.conditionals=[]",
    ]


def moe_rl_side(model_dir: str, steps: int, run_dir: str, turns: Turns, new_tokens: int = NEW_TOKENS) -> dict:
    overrides = moe_rl_overrides(model_dir, steps, run_dir, new_tokens)
    from moe_rl import tags
    from moe_rl.cli import main
    from moe_rl.trainer.trainer import Trainer

    train_step = Trainer.train_step

    def taking_turns(trainer: Trainer, step: int) -> dict:
        turns.wait()
        try:
            return train_step(trainer, step)
        finally:
            turns.done()

    Trainer.train_step = taking_turns  # perf/step_time_s is timed inside train_step
    code = main(["train", *overrides])
    if code != 0:
        raise SystemExit(code)
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {
        "step_times": [r["perf/step_time_s"] for r in rows],
        "response_tokens": [r[tags.RESPONSE_LENGTH_MEAN] for r in rows],
    }


def both_sides(
    model_dir: str, steps: int, steps_per_turn: int, first: str = "moe-rl", run: tuple[str, ...] = ()
) -> dict:
    """moe-rl and TRL, each in its own process, taking turns of ``steps_per_turn`` steps
    (``first`` starts); their JSON and the per-turn paired time ratios (moe-rl / TRL).
    ``run``: the arguments both sides get (``--new-tokens``, ``--device``)."""
    sides = {"moe-rl": ["--side", "moe-rl", *run], "trl": ["--side", "trl", *run]}
    return _paired(sides, "moe-rl", "trl", first, model_dir, steps, steps_per_turn)


def this_tree_vs(
    base: str, model_dir: str, steps: int, steps_per_turn: int, first: str = "base", run: tuple[str, ...] = ()
) -> dict:
    """This script's checkout's moe-rl and the checkout ``base``'s (each imported from its own
    folder, whichever one the environment installed), taking turns as :func:`both_sides`;
    the per-turn paired time ratios are this tree's / the base's."""
    this = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this script's checkout
    sides = {
        "this": ["--side", "moe-rl", "--src", this, *run],
        "base": ["--side", "moe-rl", "--src", os.path.abspath(base), *run],
    }
    return _paired(sides, "this", "base", first, model_dir, steps, steps_per_turn)


def _paired(
    sides: dict[str, list[str]], top: str, bottom: str, first: str, model_dir: str, steps: int, steps_per_turn: int
) -> dict:
    """Each side (its name, and its ``--side ...`` arguments) in its own process, taking
    turns (``first`` starts); their JSON, and turn by turn ``top``'s median step time over
    ``bottom``'s (turn i of one side and turn i of the other ran right after each other)."""
    order = [first, *(name for name in sides if name != first)]
    procs, go, finished, logs = {}, {}, {}, {}
    for side in order:
        go_r, go[side] = os.pipe()
        finished[side], done_w = os.pipe()
        logs[side] = tempfile.TemporaryFile("w+")
        cmd = [
            sys.executable,
            "-W",
            "ignore",
            __file__,
            *sides[side],
            "--model",
            model_dir,
            "--steps",
            str(steps),
            "--turns",
            f"{go_r},{done_w}",
            "--steps-per-turn",
            str(steps_per_turn),
        ]
        procs[side] = subprocess.Popen(
            cmd, pass_fds=(go_r, done_w), stdout=logs[side], stderr=subprocess.STDOUT, text=True
        )
        os.close(go_r)
        os.close(done_w)
    try:
        _take_turns(list(order), procs, go, finished, logs)
    finally:
        for proc in procs.values():
            proc.kill()
    out = {side: _side_json(side, procs[side], logs[side]) for side in order}
    pairs = zip(out[top]["warm_turns"], out[bottom]["warm_turns"])
    ratios = [statistics.median(a) / statistics.median(b) for a, b in pairs]
    out["turn_time_ratios"], out["median_turn_time_ratio"] = ratios, statistics.median(ratios)
    return out


def _take_turns(running: list[str], procs: dict, go: dict, finished: dict, logs: dict) -> None:
    """Hand the turn round ``running`` until every side has exited; a side that fails
    (or ends no turn within the timeout) stops the run at once."""
    turn = 0
    _give_turn(go[running[0]])
    while running:
        side = running[turn % len(running)]
        if not select.select([finished[side]], [], [], TURN_TIMEOUT_S)[0]:
            raise SystemExit(f"{side}: no turn ended in {TURN_TIMEOUT_S:.0f}s")
        if os.read(finished[side], 1):
            turn += 1
        else:  # the side exited
            _side_json(side, procs[side], logs[side])  # raises with its log unless it succeeded
            running.remove(side)
        if running:
            _give_turn(go[running[turn % len(running)]])


def _give_turn(fd: int) -> None:
    try:
        os.write(fd, b".")
    except BrokenPipeError:  # that side has exited (its end of the pipe tells the loop next)
        pass


def _side_json(side: str, proc: subprocess.Popen, log) -> dict:
    code = proc.wait()
    log.seek(0)
    text = log.read()
    m = re.search(r"^BENCH_JSON (.*)$", text, re.M)
    if code != 0 or not m:
        raise SystemExit(f"{side} failed ({code}): {text[-1500:]}")
    return json.loads(m.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", choices=["both", "ab", "trl", "moe-rl"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--steps-per-turn", type=int, default=3, help="with --side both|ab: >= 2, and --steps > 2x it")
    p.add_argument(
        "--first",
        choices=["moe-rl", "trl", "this", "base"],
        help="the side that starts (--side both: moe-rl or trl, default moe-rl; --side ab: this or base, default base)",
    )
    p.add_argument("--base", help="with --side ab: the other moe-rl checkout (e.g. a git worktree of another commit)")
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="new tokens per response (both sides)")
    p.add_argument("--device", choices=DEVICES, help="where both sides run (default: cuda where a GPU is there)")
    p.add_argument("--src", help=argparse.SUPPRESS)  # --side moe-rl: the checkout to import moe-rl from
    p.add_argument("--turns", help=argparse.SUPPRESS)  # "GO_FD,DONE_FD", set by --side both|ab
    args = p.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # (the children inherit it: neither side takes a GPU)
    run = ("--new-tokens", str(args.new_tokens), "--device", args.device)
    if args.side in ("both", "ab"):
        if args.steps_per_turn < 2 or args.steps <= 2 * args.steps_per_turn:
            p.error(
                f"--side {args.side} needs --steps-per-turn >= 2 and --steps > 2 x --steps-per-turn (a turn's first "
                "step, the first turn and the last are not counted)"
            )
        firsts = ("moe-rl", "trl") if args.side == "both" else ("base", "this")
        if args.first is not None and args.first not in firsts:
            p.error(f"--side {args.side} takes --first {' or '.join(firsts)}")
        if args.side == "both":
            out = both_sides(args.model, args.steps, args.steps_per_turn, args.first or "moe-rl", run)
        elif not args.base or not os.path.isdir(os.path.join(args.base, "moe_rl")):
            p.error(f"--side ab needs --base, a checkout of moe-rl (a folder with moe_rl/ in it), got {args.base!r}")
        else:
            out = this_tree_vs(args.base, args.model, args.steps, args.steps_per_turn, args.first or "base", run)
        print("BENCH_JSON " + json.dumps(out), flush=True)
        return
    if args.src:  # before anything imports moe_rl
        sys.path.insert(0, args.src)
        os.chdir(args.src)
    turns = Turns(args.turns, args.steps_per_turn)
    if args.side == "trl":
        out = trl_side(args.model, args.steps, turns, args.new_tokens, args.device)
    else:
        out = moe_rl_side(args.model, args.steps, tempfile.mkdtemp(), turns, args.new_tokens)
    out["warm_turns"] = turns.warm(out["step_times"])
    out["median_step_s"] = statistics.median(t for turn in out["warm_turns"] for t in turn)
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.device == "cuda":
        import torch

        out["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    print("BENCH_JSON " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
