"""``report.md`` and PNG plots for a set of runs, generated from their TensorBoard logs
only (every figure names the tag it comes from)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from moe_rl import tags  # noqa: E402

TAGS = {
    "reward": tags.REWARD_TOTAL,
    "correct": tags.reward("correct"),
    "expert_change": tags.ROUTING_EXPERT_CHANGE,
    "any_layer": tags.ROUTING_ANY_LAYER_CHANGED,
    "replayed": tags.ROUTING_REPLAYED_CHANGED,
    "train_vs_rollout": tags.ROUTING_TRAIN_VS_ROLLOUT_CHANGED,
    "mismatch": tags.TRAIN_LOGP_MISMATCH_MEAN,
    "clip_frac": tags.TRAIN_CLIP_FRAC,
    "ratio_max": tags.TRAIN_RATIO_MAX,
    "log_ratio_p01": tags.TRAIN_LOG_RATIO_P01,
    "log_ratio_p99": tags.TRAIN_LOG_RATIO_P99,
    "step_time": tags.PERF_STEP_TIME,
}


def read_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` from a run's ``tensorboard/`` events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _mean(series: dict[int, float], steps) -> float | None:
    values = [series[s] for s in steps if s in series]
    return sum(values) / len(values) if values else None


def _fmt(x: float | None, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def summarize_run(scalars: dict[str, dict[int, float]], window: int = 5) -> dict:
    reward = scalars.get(TAGS["reward"], {})
    steps = sorted(reward)
    out = {"steps": len(steps)}
    if steps:
        out["first"] = _mean(reward, steps[:window])
        out["final"] = _mean(reward, steps[-window:])
    for key in ("expert_change", "any_layer", "replayed", "train_vs_rollout", "mismatch", "clip_frac", "step_time", "correct"):
        series = scalars.get(TAGS[key], {})
        out[key] = _mean(series, sorted(series)) if series else None
    return out


def seed_table(summary: dict[str, dict], seeds: list[int]) -> list[str]:
    """Mean and spread (min..max) over seeds of each run's headline figures."""
    import statistics

    base_names = sorted({name.rsplit("_s", 1)[0] for name in summary}, key=lambda n: list(summary).index(f"{n}_s{seeds[0]}") if f"{n}_s{seeds[0]}" in summary else 0)
    keys = [("final", "final reward"), ("expert_change", "experts changed per update"), ("train_vs_rollout", "train-vs-rollout routing"),
            ("mismatch", "log-prob mismatch"), ("clip_frac", "clip frac")]  # fmt: skip
    lines = [f"### Over seeds {', '.join(map(str, seeds))}: mean ± std (min..max)", "",
             "| run | " + " | ".join(label for _, label in keys) + " |", "|" + "---|" * (len(keys) + 1)]  # fmt: skip
    for base in base_names:
        cells = []
        for key, _ in keys:
            values = [summary[f"{base}_s{sd}"].get(key) for sd in seeds if f"{base}_s{sd}" in summary]
            values = [v for v in values if v is not None]
            if not values:
                cells.append("—")
                continue
            sd = statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append(f"{statistics.fmean(values):.4f} ± {sd:.4f} ({min(values):.4f}..{max(values):.4f})")
        lines.append(f"| {base} | " + " | ".join(cells) + " |")
    return lines + [""]


def eval_table(data: dict[str, dict[str, dict[int, float]]]) -> list[str]:
    """Held-out evaluation (``eval/*``) of the runs that have one: before training and at
    the last evaluation; empty when no run evaluated."""
    evaluated = {name: s for name, s in data.items() if s.get(tags.eval_pass_at(1))}
    if not evaluated:
        return []
    pass_k = sorted({tag for s in evaluated.values() for tag in s if tag.startswith("eval/pass@") and tag != tags.eval_pass_at(1)})
    columns = [tags.eval_pass_at(1), *pass_k, tags.EVAL_REWARD_MEAN]
    lines = ["## Held-out evaluation", "", "At the first evaluation (step 0: before training) -> the last (its step).", "",
             "| run | " + " | ".join(f"`{c}`" for c in columns) + " | step |", "|" + "---|" * (len(columns) + 2)]  # fmt: skip
    for name, s in evaluated.items():
        steps = sorted(s[tags.eval_pass_at(1)])
        cells = [f"{_fmt(s.get(c, {}).get(steps[0]))} -> {_fmt(s.get(c, {}).get(steps[-1]))}" for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {steps[-1]} |")
    return lines + [""]


def write_report(out_dir: Path, runs: dict[str, Path], fixed_steps: list[int], window: int = 5, extra_sections: str = "",
                 seeds: list[int] | None = None) -> Path:  # fmt: skip
    data = {name: read_scalars(path) for name, path in runs.items()}
    summary = {name: summarize_run(s, window) for name, s in data.items()}
    plots = out_dir / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    for key, title in (("reward", "mean reward"), ("expert_change", "share of activated experts changed per update"),
                       ("mismatch", "train-vs-rollout |log-prob difference|"), ("clip_frac", "clip fraction")):  # fmt: skip
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, s in data.items():
            series = s.get(TAGS[key], {})
            if series:
                xs = sorted(series)
                ax.plot(xs, [series[x] for x in xs], label=name)
        ax.set_title(f"{title} ({TAGS[key]})", fontsize=9)
        ax.set_xlabel("step")
        if ax.get_lines():
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(plots / f"{key}.png", dpi=90)
        plt.close(fig)
    lines = [
        "# moe-rl compare report",
        "",
        "Generated from each run's TensorBoard events (`<run>/tensorboard`); column headers name the tag.",
        f"Reward at fixed steps, and first/last {window}-step means of `{TAGS['reward']}`; other columns are "
        "means over all steps.",
        "",
        "| run | first | final | " + " | ".join(f"step {s}" for s in fixed_steps)
        + f" | experts changed per update (`{TAGS['expert_change']}`) | tokens changed in any layer (`{TAGS['any_layer']}`)"
        f" | replayed-pass routing change (`{TAGS['replayed']}`) | train-vs-rollout routing (`{TAGS['train_vs_rollout']}`)"
        f" | log-prob mismatch (`{TAGS['mismatch']}`) | clip frac (`{TAGS['clip_frac']}`) | step s (`{TAGS['step_time']}`) |",
        "|" + "---|" * (10 + len(fixed_steps)),
    ]
    for name, s in summary.items():
        reward = data[name].get(TAGS["reward"], {})
        fixed = [_fmt(reward.get(step)) for step in fixed_steps]
        lines.append(
            f"| {name} | {_fmt(s.get('first'))} | {_fmt(s.get('final'))} | " + " | ".join(fixed)
            + f" | {_fmt(s['expert_change'], 4)} | {_fmt(s['any_layer'], 4)} | {_fmt(s['replayed'], 4)}"
            f" | {_fmt(s['train_vs_rollout'], 4)} | {_fmt(s['mismatch'], 5)} | {_fmt(s['clip_frac'], 4)} | {_fmt(s['step_time'], 2)} |"
        )
    if seeds and len(seeds) > 1:
        lines += [""] + seed_table(summary, seeds)
    lines += [""] + eval_table(data)
    lines += ["", "Plots: " + ", ".join(f"[{p.stem}](plots/{p.name})" for p in sorted(plots.glob("*.png"))), ""]
    if extra_sections:
        lines += [extra_sections, ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
