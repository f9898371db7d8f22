"""``report.md`` and PNG plots for a set of runs, generated from their TensorBoard logs
only (every figure names the tag it comes from)."""

from __future__ import annotations

import math
from collections.abc import Sequence
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


def read_scalars(run_dir: Path, up_to: int | None = None) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` from a run's ``tensorboard/`` events; ``up_to``: its steps
    up to that one only (a reused run that went on longer than this comparison's)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    return {
        tag: {e.step: e.value for e in acc.Scalars(tag) if up_to is None or e.step <= up_to}
        for tag in acc.Tags()["scalars"]
    }


def _mean(series: dict[int, float], steps) -> float | None:
    values = [series[s] for s in steps if s in series]
    return sum(values) / len(values) if values else None


def _fmt(x: float | None, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def summarize_run(scalars: dict[str, dict[int, float]], window: int = 5) -> dict:
    reward = scalars.get(TAGS["reward"], {})
    steps = sorted(reward)
    out: dict[str, float | None] = {"steps": len(steps)}
    if steps:
        out["first"] = _mean(reward, steps[:window])
        out["final"] = _mean(reward, steps[-window:])
    for key in (
        "expert_change",
        "any_layer",
        "replayed",
        "train_vs_rollout",
        "mismatch",
        "clip_frac",
        "step_time",
        "correct",
    ):
        series = scalars.get(TAGS[key], {})
        out[key] = _mean(series, sorted(series)) if series else None
    return out


def seed_table(summary: dict[str, dict], seeds: list[int]) -> list[str]:
    """Mean and spread (min..max) over seeds of each run's headline figures."""
    import statistics

    base_names = sorted(
        {name.rsplit("_s", 1)[0] for name in summary},
        key=lambda n: list(summary).index(f"{n}_s{seeds[0]}") if f"{n}_s{seeds[0]}" in summary else 0,
    )
    keys = [
        ("final", "final reward"),
        ("expert_change", "experts changed per step"),
        ("train_vs_rollout", "train-vs-rollout routing"),
        ("mismatch", "log-prob mismatch"),
        ("clip_frac", "clip frac"),
    ]
    lines = [
        f"### Over seeds {', '.join(map(str, seeds))}: mean ± std (min..max)",
        "",
        "| run | " + " | ".join(label for _, label in keys) + " |",
        "|" + "---|" * (len(keys) + 1),
    ]
    for base in base_names:
        cells = []
        for key, _ in keys:
            logged = [summary[f"{base}_s{sd}"].get(key) for sd in seeds if f"{base}_s{sd}" in summary]
            values = [v for v in logged if v is not None]
            if not values:
                cells.append("—")
                continue
            sd = statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append(f"{_sig(statistics.fmean(values))} ± {_sig(sd, 2)} ({_sig(min(values))}..{_sig(max(values))})")
        lines.append(f"| {base} | " + " | ".join(cells) + " |")
    return lines + [""]


def eval_table(data: dict[str, dict[str, dict[int, float]]]) -> list[str]:
    """Held-out evaluation (``eval/*``) of the runs that have one: before training and at
    the last evaluation; empty when no run evaluated."""
    evaluated = {name: s for name, s in data.items() if s.get(tags.eval_pass_at(1))}
    if not evaluated:
        return []
    pass_k = sorted(
        {tag for s in evaluated.values() for tag in s if tag.startswith("eval/pass@") and tag != tags.eval_pass_at(1)}
    )
    columns = [tags.eval_pass_at(1), *pass_k, tags.EVAL_REWARD_MEAN]
    lines = [
        "## Held-out evaluation",
        "",
        "At the first evaluation (step 0: before training) -> the last (its step).",
        "",
        "| run | " + " | ".join(f"`{c}`" for c in columns) + " | step |",
        "|" + "---|" * (len(columns) + 2),
    ]
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
    lines = [
        "## Expert bias (aux-loss-free balancing)",
        "",
        f"| run | bias moved per step (`{delta}`) | routing changed by the bias alone (`{effect}`) | all routing change (`{changed}`) |",
        "|---|---|---|---|",
    ]
    for name, s in biased.items():
        lines.append(
            f"| {name} | {_fmt(mean(s[delta]), 5)} | {_fmt(mean(s.get(effect)), 4)} | {_fmt(mean(s.get(changed)), 4)} |"
        )
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


STYLES = [
    dict(marker=m, linestyle=ls)
    for ls, m in zip(["-", "--", "-.", ":"] * 3, ["o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p"])
]


def _banded(
    ax, name: str, seed_series: list[dict[int, float]], smooth: bool, style: dict, points: bool = False
) -> None:
    """Mean over seeds (smoothed when asked) with a min..max band over seeds when there
    are several; ``points``: markers at the measured steps (evaluations), joined faintly."""
    steps = sorted(set().union(*seed_series))
    per_step = [[s[st] for s in seed_series if st in s] for st in steps]
    mean = [sum(v) / len(v) for v in per_step]
    every = max(1, len(steps) // 10)
    kwargs = dict(
        style, markevery=1 if points else every, markersize=6 if points else 4, linewidth=0.8 if points else 1.4
    )
    line = ax.plot(steps, ema(mean) if smooth else mean, label=name, **kwargs)[0]
    if len(seed_series) > 1:
        ax.fill_between(
            steps, [min(v) for v in per_step], [max(v) for v in per_step], color=line.get_color(), alpha=0.15
        )
    if smooth:
        ax.plot(steps, mean, color=line.get_color(), alpha=0.3, linewidth=0.8)


FIGURES = [  # file, tag, title, y-axis label, smoothed, evaluation points
    ("reward", TAGS["reward"], "training reward", "mean total reward", True, False),
    (
        "eval_reward",
        tags.EVAL_REWARD_MEAN,
        "held-out reward (fixed prompts and sampling seeds)",
        "mean total reward",
        False,
        True,
    ),
    ("eval_pass1", tags.eval_pass_at(1), "held-out pass@1", "pass@1", False, True),
    (
        "expert_change",
        TAGS["expert_change"],
        "activated experts changed per step (over its updates)",
        "share of (token, layer) top-k choices",
        False,
        False,
    ),
    (
        "mismatch",
        TAGS["mismatch"],
        "train-vs-rollout log-prob mismatch",
        "mean |trainer - engine| log-prob",
        False,
        False,
    ),
    ("clip_frac", TAGS["clip_frac"], "clip fraction", "share of response tokens clipped", False, False),
    (
        "kl",
        tags.train("offpolicy/kl_k3"),
        "train-inference KL (k3, old pass)",
        "KL per token (log scale)",
        False,
        False,
    ),
    (
        "extreme_tokens",
        tags.train("offpolicy/extreme_token_frac"),
        "tokens with a train-inference ratio outside [1/2, 2]",
        "share of response tokens",
        False,
        False,
    ),
    ("grad_norm", tags.TRAIN_GRAD_NORM, "gradient norm", "norm before clipping", False, False),
]
LOG_SCALE = {"kl"}  # figures plotted on a log y axis (heavy-tailed per step)


def plot_curves(plots: Path, by_run: dict[str, list[dict]]) -> None:
    """One PNG per figure: each run's mean over seeds (a band: min..max over seeds, when
    there are several), a marker and line style per run so that overlapping runs stay
    visible; training reward smoothed (EMA 0.3) with the raw mean faint behind it;
    evaluations as points."""
    several = any(len(seeds) > 1 for seeds in by_run.values())
    for key, tag, title, ylabel, smooth, points in FIGURES:
        if not any(s.get(tag) for seeds in by_run.values() for s in seeds):
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, (name, seeds) in enumerate(by_run.items()):
            series = [s[tag] for s in seeds if s.get(tag)]
            if series:
                _banded(ax, name, series, smooth, STYLES[i % len(STYLES)], points)
        if key in LOG_SCALE:
            ax.set_yscale("log")
        notes = ", ".join(n for n, on in (("EMA 0.3", smooth), ("band: seeds min..max", several)) if on)
        _finish(fig, ax, f"{title} ({tag})" + (f"; {notes}" if notes else ""), "step", ylabel, plots / f"{key}.png")


def plot_layer_drift(plots: Path, by_run: dict[str, list[dict]]) -> None:
    """Per MoE layer, grouped bars: the share of activated experts an update changed,
    mean over steps and seeds (``routing/expert_change_frac/layer_<l>``)."""
    per_run = {}
    for name, seeds in by_run.items():
        layers = sorted(
            {int(t.rsplit("_", 1)[1]) for s in seeds for t in s if t.startswith("routing/expert_change_frac/layer_")}
        )
        values = []
        for layer in layers:
            series = [v for s in seeds for v in s.get(tags.routing("expert_change_frac", layer=layer), {}).values()]
            values.append(sum(series) / len(series) if series else float("nan"))
        if layers:
            per_run[name] = (layers, values)
    if not per_run:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(per_run)
    hatches = ["", "//", "..", "xx", "\\\\", "--", "++", "oo"]
    for i, (name, (layers, values)) in enumerate(per_run.items()):
        ax.bar(
            [l + (i - (len(per_run) - 1) / 2) * width for l in layers],
            values,
            width,
            label=name,
            hatch=hatches[i % len(hatches)],
        )
    all_layers = sorted({l for layers, _ in per_run.values() for l in layers})
    ax.set_xticks(all_layers)
    tallest = max((v for _, values in per_run.values() for v in values if v == v), default=0.0)
    ax.set_ylim(0, tallest * 1.35 or 1.0)  # room for the legend above the bars
    _finish(
        fig,
        ax,
        "experts changed per step, per MoE layer (routing/expert_change_frac/layer_<l>)",
        "MoE layer",
        "share of top-k choices changed",
        plots / "layer_drift.png",
    )


def _finish(fig, ax, title: str, xlabel: str, ylabel: str, path: Path) -> None:
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel, fontsize=8)
    if ax.get_lines() or ax.patches:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def cost_table(by_run: dict[str, list[dict]], baseline: str = "grpo") -> list[str]:
    """Step time, train time and peak memory per run (means over steps and seeds), and
    their ratio to ``baseline``: what routing replay (R2, R3) costs."""
    keys = [(tags.PERF_STEP_TIME, "step s"), (tags.PERF_TRAIN_TIME, "train s"), (tags.PERF_PEAK_MEMORY_MB, "peak MB")]
    means: dict[str, dict[str, float | None]] = {}
    for name, seeds in by_run.items():
        means[name] = {}
        for tag, _ in keys:
            values = [v for s in seeds for v in s.get(tag, {}).values()]
            means[name][tag] = sum(values) / len(values) if values else None
    base = means.get(baseline, {})
    lines = [
        "## Cost",
        "",
        f"Means over steps and seeds; in brackets the ratio to `{baseline}` (same machine, same runs).",
        "",
        "| run | " + " | ".join(f"{label} (`{tag}`)" for tag, label in keys) + " |",
        "|" + "---|" * (len(keys) + 1),
    ]
    for name, m in means.items():
        cells = []
        for tag, _ in keys:
            value, reference = m[tag], base.get(tag)
            ratio = f" ({value / reference:.2f}x)" if value is not None and reference else ""
            cells.append(_fmt(value, 2) + ratio)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines + [""]


def sig(x: float, digits: int = 3, *, sign: bool = False) -> str:
    """``x`` to ``digits`` significant figures, trailing zeros kept (0.0120, 12.3, 1.00,
    1.23e-05)."""
    if x == 0 or not math.isfinite(x):
        return f"{x:+g}" if sign else f"{x:g}"
    return f"{x:{'+' if sign else ''}#.{digits}g}".rstrip(".")


def _sig(x: float | None, digits: int = 3) -> str:
    """3 significant figures (— for a missing figure)."""
    return "—" if x is None else sig(x, digits)


def _f3(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.2f}"


def _e(x: float | None) -> str:
    return "—" if x is None else f"{x:.2e}"


def _held_out(series: dict[str, dict[int, float]]) -> tuple[float, float, int] | None:
    """(pass@1 at the first evaluation, at the last, the last's step)."""
    p1 = series.get(tags.eval_pass_at(1), {})
    if len(p1) < 2:
        return None
    steps = sorted(p1)
    return p1[steps[0]], p1[steps[-1]], steps[-1]


def summary_table(data: dict[str, dict], fixed_steps: list[int], window: int) -> list[str]:
    """The runs side by side (3 significant figures), then the details."""
    summary = {name: summarize_run(s, window) for name, s in data.items()}
    lines = [
        "## Runs",
        "",
        f"Training reward: mean of the first and last {window} steps; held-out pass@1: first evaluation (step 0, "
        "before training) -> last; the routing columns are shares of the (token, MoE layer) top-k choices, means over "
        "all steps. Tags: "
        + ", ".join(
            f"`{TAGS[k]}`"
            for k in ("reward", "expert_change", "train_vs_rollout", "mismatch", "clip_frac", "step_time")
        )
        + f", `{tags.eval_pass_at(1)}`.",
        "",
        "| run | training reward | held-out pass@1 | experts changed per step (%) | train-vs-rollout routing changed (%) "
        "| log-prob mismatch (nats) | clip fraction (%) | step (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        held = _held_out(data[name])
        lines.append(
            f"| {name} | {_f3(s.get('first'))} -> {_f3(s.get('final'))} | "
            + (f"{_f3(held[0])} -> {_f3(held[1])}" if held else "—")
            + f" | {_pct(s['expert_change'])} | {_pct(s['train_vs_rollout'])} | {_e(s['mismatch'])} | {_pct(s['clip_frac'])} | {_f3(s['step_time'])} |"
        )
    lines += [
        "",
        "Details: training reward at fixed steps; tokens whose experts changed in any layer "
        f"(`{TAGS['any_layer']}`); routing change between the old pass and the update passes (`{TAGS['replayed']}`: 0 under R2/R3).",
        "",
        "| run | "
        + " | ".join(f"reward at step {st}" for st in fixed_steps)
        + " | tokens changed in any layer (%) | replayed-pass routing change (%) |",
        "|" + "---|" * (3 + len(fixed_steps)),
    ]
    for name, s in summary.items():
        reward = data[name].get(TAGS["reward"], {})
        lines.append(
            f"| {name} | "
            + "".join(f"{_f3(reward.get(st))} | " for st in fixed_steps)
            + f"{_pct(s['any_layer'])} | {_pct(s['replayed'])} |"
        )
    return lines + staleness_table(data)


def staleness_table(data: dict[str, dict[str, dict[int, float]]]) -> list[str]:
    """How stale the tokens each run trained on were (runs with partial or async rollouts;
    empty when none had stale tokens)."""
    stale = {
        name: s
        for name, s in data.items()
        if any(s.get(tags.TOKEN_STALENESS_MAX, {}).values()) or any(s.get(tags.ROLLOUT_POLICY_LAG, {}).values())
    }
    if not stale:
        return []
    lines = [
        "",
        "Staleness trained on: weight versions between the weights that drew a response token and the weights it "
        f"trained (`{tags.TOKEN_STALENESS_MEAN}`, `{tags.TOKEN_STALENESS_MAX}`; async rollouts without partial ones: "
        f"`{tags.ROLLOUT_POLICY_LAG}`), and the responses continued across versions (`{tags.PARTIAL_SAMPLE_FRAC}`).",
        "",
        "| run | token staleness (mean) | most | continued responses (%) |",
        "|---|---|---|---|",
    ]
    for name, s in stale.items():
        mean = s.get(tags.TOKEN_STALENESS_MEAN) or s.get(tags.ROLLOUT_POLICY_LAG, {})
        most = s.get(tags.TOKEN_STALENESS_MAX) or s.get(tags.ROLLOUT_POLICY_LAG, {})
        partial = s.get(tags.PARTIAL_SAMPLE_FRAC, {})
        lines.append(
            f"| {name} | {_f3(_mean(mean, sorted(mean)))} | {_f3(max(most.values()))} | "
            + (f"{_pct(_mean(partial, sorted(partial)))} |" if partial else "— |")
        )
    return lines


def conclusions(data: dict[str, dict[str, dict[int, float]]], window: int) -> list[str]:
    """What the runs say, in words: who learned on held-out problems (and who only on the
    training rewards), what replay changed, which runs coincide and why."""
    summary = {name: summarize_run(s, window) for name, s in data.items()}
    out = []
    held = {name: h for name, s in data.items() if (h := _held_out(s))}
    if held:
        up = [f"{n} ({_f3(a)} -> {_f3(b)})" for n, (a, b, _) in held.items() if b > a]
        down = [f"{n} ({_f3(a)} -> {_f3(b)})" for n, (a, b, _) in held.items() if b <= a]
        out.append(
            "Held-out pass@1 rose for "
            + (", ".join(up) if up else "no run")
            + (f"; it did not for {', '.join(down)}" if down else "")
            + "."
        )
        finals = {n: s["final"] for n, s in summary.items() if s.get("final") is not None}
        best = max(finals, key=lambda n: finals[n]) if finals else None
        if best in held and held[best][1] <= held[best][0]:
            out.append(
                f"{best} has the highest final training reward ({_f3(finals[best])}) but its held-out pass@1 did not rise: "
                "it learned what the training rewards pay for (e.g. the answer's form) more than the task."
            )
    replayed = {n: s["replayed"] for n, s in summary.items() if s.get("replayed") is not None}
    zero, moving = [n for n, v in replayed.items() if v == 0], {n: v for n, v in replayed.items() if v > 0}
    if zero and moving:
        out.append(
            f"Replay: the update passes of {', '.join(zero)} used exactly the old pass's routing; without replay "
            + ", ".join(f"{n} {_pct(v)}%" for n, v in moving.items())
            + " of router choices changed between the old pass and its updates."
        )
    engine = {n: s["train_vs_rollout"] for n, s in summary.items() if s.get("train_vs_rollout") is not None}
    if any(v == 0 for v in engine.values()) and any(v > 0 for v in engine.values()):
        out.append(
            "Train-inference routing: "
            + ", ".join(f"{n} {_pct(v)}%" for n, v in engine.items())
            + " of the trainer's router choices differed from the engine's (0 where the trainer replays the engine's routing, R3)."
        )
    out += _coinciding(data, summary)
    return out


def _coinciding(data: dict[str, dict[str, dict[int, float]]], summary: dict[str, dict]) -> list[str]:
    """Pairs of runs whose training reward is the same at (nearly) every step, explained."""
    names, out = list(data), []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            ra, rb = data[a].get(TAGS["reward"], {}), data[b].get(TAGS["reward"], {})
            steps = sorted(ra.keys() & rb.keys())
            same = sum(abs(ra[k] - rb[k]) <= 1e-9 * max(1.0, abs(ra[k])) for k in steps)
            if len(steps) < 3 or same < 0.8 * len(steps):
                continue
            why = "their settings made the same samples and updates"
            if summary[a].get("replayed") == 0 == summary[b].get("replayed"):
                why = (
                    "both replay routing, and what they replay (R2: the old policy's experts, R3: the engine's) differs only "
                    "on the few router choices where the engine and the trainer disagree (the train-vs-rollout column of "
                    "the run that replays the old policy's): the samples, rewards and updates are the same until one of "
                    "those choices changes a sampled token"
                )
            out.append(f"{a} and {b} have the same training reward at {same} of {len(steps)} steps: {why}.")
    return out


def write_report(
    out_dir: Path,
    data: dict[str, dict[str, dict[int, float]]],
    fixed_steps: list[int],
    window: int = 5,
    extra_sections: str = "",
    seeds: list[int] | None = None,
    lead: Sequence[str] = (),
) -> Path:
    """``out_dir/report.md`` and ``out_dir/plots/*.png`` from the runs' scalars
    (:func:`read_scalars`); ``lead``: more conclusions (the claims' verdict) for the top."""
    by_run = {name: list(per_seed.values()) for name, per_seed in group_by_run(data, seeds).items()}
    plots = out_dir / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    plot_curves(plots, by_run)
    plot_layer_drift(plots, by_run)
    said = conclusions(data, window) + list(lead)
    lines = ["# moe-rl compare report", "", "Generated from each run's TensorBoard events (`<run>/tensorboard`).", ""]
    if said:
        lines += ["## Conclusions", "", *[f"- {line}" for line in said], ""]
    lines += summary_table(data, fixed_steps, window)
    if seeds and len(seeds) > 1:
        lines += [""] + seed_table({name: summarize_run(s, window) for name, s in data.items()}, seeds)
    lines += [""] + eval_table(data) + expert_bias_table(data) + cost_table(by_run)
    lines += ["Plots: " + ", ".join(f"[{p.stem}](plots/{p.name})" for p in sorted(plots.glob("*.png"))), ""]
    if extra_sections:
        lines += [extra_sections, ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


REGIME_TOLERANCE = 0.2  # the flip fraction reached counts as the setting's within ±20%
# the R3 paper's figures (Qwen3-30B-A3B, SGLang vs Megatron; arXiv 2510.11370), beside ours
PAPER_KL, PAPER_KL_R3, PAPER_FLIP_FRAC, PAPER_ANY_LAYER = 1.535e-3, 7.5e-4, 0.1, 0.94


def _run_figure(
    data: dict[str, dict[str, dict[int, float]]], name: str, where=lambda s: True, per_run=None
) -> float | None:
    """The mean over the runs that pass ``where`` of each run's figure for tag ``name``: its
    mean over steps, or ``per_run`` of its steps' values (e.g. the median)."""
    import statistics

    per_run = per_run or statistics.fmean
    figures = [per_run(list(s[name].values())) for s in data.values() if s.get(name) and where(s)]
    return sum(figures) / len(figures) if figures else None


def _replays_engine(s: dict[str, dict[int, float]]) -> bool:
    """A run that trains on the engine's routing (R3): its trainer never disagreed with it."""
    changed = s.get(tags.ROUTING_TRAIN_VS_ROLLOUT_CHANGED)
    return changed is not None and bool(changed) and max(changed.values()) == 0


def _moves_routing(s: dict[str, dict[int, float]]) -> bool:
    """A run whose updates changed routing (no R2 / R3 replay in them)."""
    changed = s.get(tags.ROUTING_REPLAYED_CHANGED)
    return changed is not None and bool(changed) and max(changed.values()) > 0


SIMULATED_TARGETS = (tags.SIMULATED_TARGET_FLIP_FRAC, tags.SIMULATED_TARGET_LOGIT_KL)


def regime_section(data: dict[str, dict[str, dict[int, float]]], seeds: list[int] | None = None) -> str:
    """The simulated train-inference mismatch the runs met (``rollout.simulate_mismatch``), over
    the runs that simulate it (a control without it is left out, but for its KL): per MoE layer the
    flips the engine measured against its clean self and the trainer against the engine (runs
    without R3); then the KL and extreme-token share as the trainer measured them, without and with
    R3, beside the R3 paper's figures; the engine's split of the KL; the update-side change. Empty
    without a simulation."""
    import statistics

    simulated = {n: s for n, s in data.items() if any(t in s for t in SIMULATED_TARGETS)}
    if not simulated:
        return ""
    median = statistics.median
    prefix = tags.simulated_mismatch("flip_frac", 0).rsplit("_", 1)[0] + "_"
    layers = sorted({int(t[len(prefix) :]) for s in simulated.values() for t in s if t.startswith(prefix)})
    target = _run_figure(simulated, tags.SIMULATED_TARGET_FLIP_FRAC)
    routing_kl = _run_figure(simulated, tags.SIMULATED_TARGET_ROUTING_KL)
    logit_kl = _run_figure(simulated, tags.SIMULATED_TARGET_LOGIT_KL)
    plain = lambda s: not _replays_engine(s)  # noqa: E731
    how = (
        f"calibrated by the engine so that the flips alone cost a KL of {_sig(routing_kl)} per token (the flip "
        "fraction per layer is what that takes, in the table)"
        if routing_kl
        else f"calibrated by the engine to {_sig(target)} of tokens flipped per MoE layer"
    )
    lines = [
        "## The simulated mismatch regime",
        "",
        f"**A simulation** (`rollout.simulate_mismatch`): the local engine's routing was perturbed on the inference "
        f"side only, {how}"
        + (f"; its final logits were perturbed to a KL of {_sig(logit_kl)} per token" if logit_kl else "")
        + ". The trainer's forward is the model's own. Evaluation ran the engine's clean model.",
        "",
        "| MoE layer | flip target | engine vs its clean self (all runs) | trainer vs engine (runs without R3) |",
        "|---|---|---|---|",
    ]
    for l in layers:
        engine = _run_figure(simulated, tags.simulated_mismatch("flip_frac", l))
        trainer = _run_figure(simulated, tags.routing("changed_frac", "train_vs_rollout", l), plain)
        lines.append(f"| {l} | {_sig(target)} | {_sig(engine)} | {_sig(trainer)} |")
    kl, extreme = tags.train("offpolicy/kl_k3"), tags.train("offpolicy/extreme_token_frac")
    r3 = lambda s: _replays_engine(s)  # noqa: E731
    control = {n: s for n, s in data.items() if n not in simulated}
    row = lambda label, name, per_run, paper, paper_r3: (  # noqa: E731
        f"| {label} | {_sig(_run_figure(simulated, name, plain, per_run))} | "
        f"{_sig(_run_figure(simulated, name, r3, per_run))} | {_sig(_run_figure(control, name, per_run=per_run))} "
        f"| {paper} | {paper_r3} |"
    )
    lines += [
        "",
        "| figure | runs without R3 | runs with R3 | control (no simulation) | R3 paper, no replay | R3 paper, R3 |",
        "|---|---|---|---|---|---|",
        row(f"train-inference KL, k3 (`{kl}`), median over steps", kl, median, f"{PAPER_KL:g}", f"{PAPER_KL_R3:g}"),
        row("the same, mean over steps", kl, None, "", ""),
        row(f"extreme-ratio tokens (`{extreme}`), mean over steps", extreme, None, "", "~10x fewer"),
        row(
            "tokens flipped in >= 1 MoE layer (engine)",
            tags.SIMULATED_ANY_LAYER_FLIPPED_FRAC,
            None,
            "0.94 of 48 layers",
            "",
        ),
        row("engine: KL of the routing flips alone (exact), median", tags.SIMULATED_ROUTING_KL, median, "", ""),
        row("engine: KL of the logit perturbation (exact), median", tags.SIMULATED_LOGIT_KL, median, "", ""),
        "",
        f"Update side: {_sig(_run_figure(data, tags.ROUTING_REPLAYED_CHANGED, _moves_routing))} of tokens changed "
        f"their top-k set between the old pass and the update passes (`{tags.ROUTING_REPLAYED_CHANGED}`, runs without "
        f"replay); {_sig(_run_figure(data, tags.ROUTING_EXPERT_CHANGE))} of activated experts changed per step "
        f"(`{tags.ROUTING_EXPERT_CHANGE}`; GSPO paper: ~10% per update at 48 layers).",
    ]
    return "\n".join(lines)
