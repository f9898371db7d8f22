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


def expert_bias_table(data: dict[str, dict[str, dict[int, float]]]) -> list[str]:
    """Runs whose routers have an expert bias (GLM-4.5, DeepSeek-V3): how far it moved
    per step and how much of the routing change the bias update alone made (means over
    steps); empty when no run has one."""
    delta, effect = tags.routing("expert_bias_delta"), tags.routing("changed_frac", "expert_bias_effect")
    changed = tags.routing("changed_frac")
    biased = {name: s for name, s in data.items() if s.get(delta)}
    if not biased:
        return []
    mean = lambda series: _mean(series, sorted(series)) if series else None  # noqa: E731
    lines = ["## Expert bias (aux-loss-free balancing)", "",
             f"| run | bias moved per step (`{delta}`) | routing changed by the bias alone (`{effect}`) | all routing change (`{changed}`) |",
             "|---|---|---|---|"]  # fmt: skip
    for name, s in biased.items():
        lines.append(f"| {name} | {_fmt(mean(s[delta]), 5)} | {_fmt(mean(s.get(effect)), 4)} | {_fmt(mean(s.get(changed)), 4)} |")
    return lines + [""]


def group_by_run(data: dict[str, dict], seeds: list[int] | None) -> dict[str, dict[str, dict]]:
    """``{base run: {seed: value}}``: run names carry ``_s<seed>`` when there are seeds
    (without seeds every run is its own base, under seed ``""``)."""
    out: dict[str, dict[str, dict]] = {}
    for name, value in data.items():
        base, _, seed = name.rpartition("_s") if seeds else (name, "", "")
        out.setdefault(base, {})[seed] = value
    return out


def ema(values: list[float], alpha: float = 0.3) -> list[float]:
    """Exponential moving average (the smoothed training curve)."""
    out: list[float] = []
    for v in values:
        out.append(v if not out else alpha * v + (1 - alpha) * out[-1])
    return out


def _banded(ax, name: str, seed_series: list[dict[int, float]], smooth: bool) -> None:
    """Mean over seeds (smoothed when asked) with a min..max band over seeds."""
    steps = sorted(set().union(*seed_series))
    per_step = [[s[st] for s in seed_series if st in s] for st in steps]
    mean = [sum(v) / len(v) for v in per_step]
    line = ax.plot(steps, ema(mean) if smooth else mean, label=name)[0]
    if len(seed_series) > 1:
        ax.fill_between(steps, [min(v) for v in per_step], [max(v) for v in per_step], color=line.get_color(), alpha=0.15)
    if smooth:
        ax.plot(steps, mean, color=line.get_color(), alpha=0.3, linewidth=0.8)


def plot_curves(plots: Path, by_run: dict[str, list[dict]]) -> None:
    """One PNG per figure: each run's mean over seeds with a seed band (training reward
    also smoothed, the raw mean faint behind it)."""
    figures = [("reward", TAGS["reward"], "training reward (EMA 0.3; band: seeds min..max)", True),
               ("eval_reward", tags.EVAL_REWARD_MEAN, "held-out reward (fixed prompts and sampling seeds)", False),
               ("eval_pass1", tags.eval_pass_at(1), "held-out pass@1", False),
               ("expert_change", TAGS["expert_change"], "share of activated experts changed per update", False),
               ("mismatch", TAGS["mismatch"], "train-vs-rollout |log-prob difference|", False),
               ("clip_frac", TAGS["clip_frac"], "clip fraction", False)]  # fmt: skip
    for key, tag, title, smooth in figures:
        if not any(s.get(tag) for seeds in by_run.values() for s in seeds):
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, seeds in by_run.items():
            series = [s[tag] for s in seeds if s.get(tag)]
            if series:
                _banded(ax, name, series, smooth)
        _finish(fig, ax, f"{title} ({tag})", "step", plots / f"{key}.png")


def plot_layer_drift(plots: Path, by_run: dict[str, list[dict]]) -> None:
    """Per MoE layer: the share of activated experts an update changed, mean over steps
    and seeds (``routing/expert_change_frac/layer_<l>``)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, seeds in by_run.items():
        layers = sorted({int(t.rsplit("_", 1)[1]) for s in seeds for t in s if t.startswith("routing/expert_change_frac/layer_")})
        values = []
        for layer in layers:
            series = [v for s in seeds for v in s.get(tags.routing("expert_change_frac", layer=layer), {}).values()]
            values.append(sum(series) / len(series) if series else float("nan"))
        if layers:
            ax.plot(layers, values, marker="o", label=name)
    _finish(fig, ax, "experts changed per update, per layer (routing/expert_change_frac/layer_<l>)", "MoE layer",
            plots / "layer_drift.png")


def _finish(fig, ax, title: str, xlabel: str, path: Path) -> None:
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel)
    if ax.get_lines():
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def cost_table(by_run: dict[str, list[dict]], baseline: str = "grpo") -> list[str]:
    """Step time, train time and peak memory per run (means over steps and seeds), and
    their ratio to ``baseline``: what routing replay (R2, R3) costs."""
    keys = [(tags.PERF_STEP_TIME, "step s"), (tags.PERF_TRAIN_TIME, "train s"), (tags.PERF_PEAK_MEMORY_MB, "peak MB")]
    means = {}
    for name, seeds in by_run.items():
        means[name] = {}
        for tag, _ in keys:
            values = [v for s in seeds for v in s.get(tag, {}).values()]
            means[name][tag] = sum(values) / len(values) if values else None
    base = means.get(baseline, {})
    lines = ["## Cost", "", f"Means over steps and seeds; in brackets the ratio to `{baseline}` (same machine, same runs).", "",
             "| run | " + " | ".join(f"{label} (`{tag}`)" for tag, label in keys) + " |", "|" + "---|" * (len(keys) + 1)]  # fmt: skip
    for name, m in means.items():
        cells = []
        for tag, _ in keys:
            ratio = f" ({m[tag] / base[tag]:.2f}x)" if m[tag] is not None and base.get(tag) else ""
            cells.append(_fmt(m[tag], 2) + ratio)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines + [""]


def summary_table(data: dict[str, dict], fixed_steps: list[int], window: int) -> list[str]:
    summary = {name: summarize_run(s, window) for name, s in data.items()}
    lines = [
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
    return lines


def write_report(out_dir: Path, data: dict[str, dict[str, dict[int, float]]], fixed_steps: list[int], window: int = 5,
                 extra_sections: str = "", seeds: list[int] | None = None) -> Path:  # fmt: skip
    """``out_dir/report.md`` and ``out_dir/plots/*.png`` from the runs' scalars (:func:`read_scalars`)."""
    by_run = {name: list(per_seed.values()) for name, per_seed in group_by_run(data, seeds).items()}
    plots = out_dir / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    plot_curves(plots, by_run)
    plot_layer_drift(plots, by_run)
    lines = ["# moe-rl compare report", "",
             "Generated from each run's TensorBoard events (`<run>/tensorboard`); column headers name the tag.",
             *summary_table(data, fixed_steps, window)]  # fmt: skip
    if seeds and len(seeds) > 1:
        lines += [""] + seed_table({name: summarize_run(s, window) for name, s in data.items()}, seeds)
    lines += [""] + eval_table(data) + expert_bias_table(data) + cost_table(by_run)
    lines += ["Plots: " + ", ".join(f"[{p.stem}](plots/{p.name})" for p in sorted(plots.glob("*.png"))), ""]
    if extra_sections:
        lines += [extra_sections, ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
