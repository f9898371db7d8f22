"""The papers' claims, tested at small scale from the runs' own TensorBoard logs.

A claim is one or more comparisons of a figure (computed from named tags) between two
runs, or between two figures of one run. Each comparison is paired: by seed when the
runs were repeated over seeds (``moe-rl compare --seeds``), else by step. The effect is
the mean paired difference in the claimed direction, its noise the standard error of
that mean; a comparison agrees only when the effect exceeds twice its standard error
(strict claims), or, for "as well as" claims, when it is not worse by more than that.
Nothing is written by hand per run: everything is computed from the logs.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable

from moe_rl import tags
from moe_rl.report import group_by_run, sig

Scalars = dict[str, dict[int, float]]  # tag -> step -> value, of one run (one seed)
Series = Callable[[Scalars], dict[int, float]]  # a per-step figure of one run
Z = 2.0  # standard errors an effect must exceed
OFFPOLICY_KL = tags.train("offpolicy/kl_k3")
# learning is judged on held-out problems (a reward can be gamed): pass@1 after training
# starts (the step-0 evaluation is the same model in every run)
IS_WEIGHT_MAX = tags.train("offpolicy/is_weight_max")
DROPPED = tags.train("offpolicy/dropped_token_frac")
TRUNCATED = tags.train("offpolicy/truncated_frac")
EXTREME = tags.train("offpolicy/extreme_token_frac")


def tag(name: str) -> Series:
    return lambda s: s.get(name, {})


def ratio_spread(s: Scalars) -> dict[int, float]:
    """Per step: the 99th minus the 1st percentile of the token log-ratios."""
    lo, hi = s.get(tags.TRAIN_LOG_RATIO_P01, {}), s.get(tags.TRAIN_LOG_RATIO_P99, {})
    return {step: hi[step] - lo[step] for step in lo if step in hi}


def after_start(series: Series) -> Series:
    """The figure without its first logged step (e.g. the evaluation before training)."""

    def cut(s: Scalars) -> dict[int, float]:
        values = series(s)
        return {st: v for st, v in values.items() if st != min(values)} if values else {}

    return cut


def second_half(series: Series) -> Series:
    """The figure over the second half of the run's steps (where learning shows)."""

    def cut(s: Scalars) -> dict[int, float]:
        values = series(s)
        steps = sorted(values)
        return {st: values[st] for st in steps[len(steps) // 2 :]}

    return cut


def peak(series: Series) -> Series:
    """The figure's largest value over the run (one point, under step 0 so that runs pair):
    spikes, not means."""

    def top(s: Scalars) -> dict[int, float]:
        values = series(s)
        return {0: max(values.values())} if values else {}

    return top


HELD_OUT = after_start(tag(tags.eval_pass_at(1)))


@dataclass(frozen=True)
class Side:
    run: str  # base run name (without the seed suffix)
    series: Series
    label: str  # the tag(s) it reads


@dataclass(frozen=True)
class Comparison:
    """``a`` is claimed larger than ``b`` (``at_least``: not smaller beyond the noise)."""

    a: Side
    b: Side
    at_least: bool = False


@dataclass(frozen=True)
class Claim:
    statement: str
    paper: str  # the paper's own figure
    comparisons: tuple[Comparison, ...]
    caveat: str = ""


@dataclass
class Outcome:
    mean_a: float
    mean_b: float
    spread_a: float  # std over seeds (or steps)
    spread_b: float
    effect: float  # mean paired difference a - b
    stderr: float
    pairs: int
    agrees: bool


CLAIMS = (
    Claim(
        "Tokens whose routing changed since the old policy carry larger importance ratios (GRPO, no replay)",
        "the mechanism behind GSPO, R2 and R3: routing changes make token ratios volatile",
        (
            Comparison(
                Side("grpo", tag(tags.train_by_routing("log_ratio_abs", True)), "mean abs log-ratio, routing changed"),
                Side("grpo", tag(tags.train_by_routing("log_ratio_abs", False)), "mean abs log-ratio, routing same"),
            ),
        ),
    ),
    Claim(
        "R2 removes the routing change inside the update",
        "R3 paper: replaying the old policy's experts keeps the update on the routing that generated the ratios",
        (
            Comparison(
                Side("grpo", tag(tags.ROUTING_REPLAYED_CHANGED), tags.ROUTING_REPLAYED_CHANGED),
                Side("grpo_r2", tag(tags.ROUTING_REPLAYED_CHANGED), tags.ROUTING_REPLAYED_CHANGED),
            ),
            Comparison(
                Side("grpo", tag(tags.train_by_routing("tokens", True)), "tokens with changed routing per update"),
                Side("grpo_r2", tag(tags.train_by_routing("tokens", True)), "the same under R2"),
            ),
        ),
    ),
    Claim(
        "GSPO clips a far larger share of tokens than GRPO, yet learns as well",
        "GSPO paper: ~15% of tokens clipped vs ~0.13% for GRPO, with better training efficiency",
        (
            Comparison(
                Side("gspo", tag(tags.TRAIN_CLIP_FRAC), tags.TRAIN_CLIP_FRAC),
                Side("grpo", tag(tags.TRAIN_CLIP_FRAC), tags.TRAIN_CLIP_FRAC),
            ),
            Comparison(
                Side("gspo", HELD_OUT, tags.eval_pass_at(1)),
                Side("grpo", HELD_OUT, tags.eval_pass_at(1)),
                at_least=True,
            ),
        ),
    ),
    Claim(
        "GMPO keeps token log-ratios in a narrower range than GRPO",
        "GMPO paper: a more stable importance-sampling range (and +4.1% Pass@1 on math at 7B, not measurable here)",
        (
            Comparison(
                Side("grpo", ratio_spread, "log-ratio p99 - p01"), Side("gmpo", ratio_spread, "log-ratio p99 - p01")
            ),
        ),
    ),
    Claim(
        "The engine's numerics change routing; R3 removes that disagreement and lowers the log-prob mismatch",
        "R3 paper, Qwen3-30B-A3B: ~10% of router choices differ between inference and training",
        (
            Comparison(
                Side("grpo", tag(tags.ROUTING_TRAIN_VS_ROLLOUT_CHANGED), tags.ROUTING_TRAIN_VS_ROLLOUT_CHANGED),
                Side("grpo_r3", tag(tags.ROUTING_TRAIN_VS_ROLLOUT_CHANGED), tags.ROUTING_TRAIN_VS_ROLLOUT_CHANGED),
            ),
            Comparison(
                Side("grpo", tag(tags.TRAIN_LOGP_MISMATCH_MEAN), tags.TRAIN_LOGP_MISMATCH_MEAN),
                Side("grpo_r3", tag(tags.TRAIN_LOGP_MISMATCH_MEAN), tags.TRAIN_LOGP_MISMATCH_MEAN),
            ),
        ),
        caveat="the rollout engine rounds its weights to bf16 (rollout.precision=bf16) in both runs; the trainer computes in fp32",
    ),
    Claim(
        "GDPO keeps reward combinations apart that GRPO's weighted sum collapses",
        "GDPO paper: with several binary rewards, group-normalising their sum maps distinct combinations to one advantage",
        (
            Comparison(
                Side("gdpo", tag(tags.ADVANTAGE_DISTINCT_PER_GROUP), tags.ADVANTAGE_DISTINCT_PER_GROUP),
                Side(
                    "gdpo",
                    tag(tags.REWARD_DISTINCT_TOTALS_PER_GROUP),
                    f"{tags.REWARD_DISTINCT_TOTALS_PER_GROUP} (what GRPO separates)",
                ),
            ),
        ),
        caveat="compared on the same samples (GRPO's advantage is a function of the weighted total); needs rewards whose "
        "weighted sum collides, e.g. equal weights on two binary rewards",
    ),
    Claim(
        "GSPO and GMPO without replay learn as well as GRPO with R2",
        "GSPO and GMPO papers: sequence-level (geometric) ratios make routing replay unnecessary",
        (
            Comparison(
                Side("gspo", HELD_OUT, tags.eval_pass_at(1)),
                Side("grpo_r2", HELD_OUT, tags.eval_pass_at(1)),
                at_least=True,
            ),
            Comparison(
                Side("gmpo", HELD_OUT, tags.eval_pass_at(1)),
                Side("grpo_r2", HELD_OUT, tags.eval_pass_at(1)),
                at_least=True,
            ),
        ),
        caveat="the contrast the papers draw (GRPO collapsing without replay) needs a model large enough to collapse",
    ),
    Claim(
        "R3 lowers the train-inference KL more than TIS does; TIS changes no routing",
        "R3 paper: replay removes the routing part of the mismatch, importance weights only reweigh its tokens",
        (
            Comparison(
                Side("grpo_tis", tag(OFFPOLICY_KL), OFFPOLICY_KL), Side("grpo_r3", tag(OFFPOLICY_KL), OFFPOLICY_KL)
            ),
            Comparison(
                Side("grpo_tis", tag(tags.ROUTING_TRAIN_VS_ROLLOUT_CHANGED), tags.ROUTING_TRAIN_VS_ROLLOUT_CHANGED),
                Side("grpo", tag(tags.ROUTING_TRAIN_VS_ROLLOUT_CHANGED), tags.ROUTING_TRAIN_VS_ROLLOUT_CHANGED),
                at_least=True,
            ),
            Comparison(
                Side("grpo", tag(tags.ROUTING_TRAIN_VS_ROLLOUT_CHANGED), tags.ROUTING_TRAIN_VS_ROLLOUT_CHANGED),
                Side("grpo_tis", tag(tags.ROUTING_TRAIN_VS_ROLLOUT_CHANGED), tags.ROUTING_TRAIN_VS_ROLLOUT_CHANGED),
                at_least=True,
            ),
        ),
        caveat="k3 estimate of KL(rollout || trainer) on the old pass. Here the mismatch is the engine's bf16 rounding of "
        "every weight (KL ~3e-6 per token) and the engine routes only ~0.1-0.2% of tokens differently, so removing the "
        "routing part cannot lower the KL measurably; at 30B scale the R3 paper measures ~10% of router choices differing",
    ),
    Claim(
        "Truncation bounds the importance weights; a masked correction drops the tokens outside its band",
        "TIS / MIS (IcePop) papers: the correction caps the weights' variance at the cost of some tokens' signal",
        (
            Comparison(
                Side("grpo", tag(IS_WEIGHT_MAX), f"{IS_WEIGHT_MAX} (uncorrected ratio)"),
                Side("grpo_tis", tag(IS_WEIGHT_MAX), IS_WEIGHT_MAX),
                at_least=True,
            ),
            Comparison(Side("grpo_icepop", tag(DROPPED), DROPPED), Side("grpo", tag(DROPPED), DROPPED), at_least=True),
        ),
        caveat="at the default band [0.5, 2] a token ratio must be off by 2x to be cut: at this scale the mismatch is ~1e-3, "
        "so the bound holds trivially and few tokens, if any, are dropped",
    ),
    Claim(
        "GSPO trains on the engine's own log-probs (no recompute pass) as well as on recomputed ones; token-level GRPO loses accuracy there",
        "GSPO review §4: a sequence-level ratio tolerates the engine/trainer precision gap that token-level GRPO does not",
        (
            Comparison(
                Side("gspo_rollout_logp", HELD_OUT, tags.eval_pass_at(1)),
                Side("gspo", HELD_OUT, tags.eval_pass_at(1)),
                at_least=True,
            ),
            Comparison(
                Side("grpo", HELD_OUT, tags.eval_pass_at(1)), Side("grpo_rollout_logp", HELD_OUT, tags.eval_pass_at(1))
            ),
        ),
        caveat="held-out pass@1 of the evaluations after step 0; the engine rounds its weights to bf16",
    ),
    Claim(
        "SAPO learns as well as GRPO on held-out problems",
        "SAPO paper: a soft gate instead of a hard clip, stable on MoE models",
        (
            Comparison(
                Side("sapo", HELD_OUT, tags.eval_pass_at(1)),
                Side("grpo", HELD_OUT, tags.eval_pass_at(1)),
                at_least=True,
            ),
        ),
    ),
)

# In a simulated 30B-scale train-inference mismatch (configs/compare/scale_regime.yaml:
# rollout.simulate_mismatch.router_flip_frac=0.1, ~10% of tokens routed differently per
# layer, and ~10% expert change per update): the papers' claims about replay and corrections.
_TVR = (tags.ROUTING_TRAIN_VS_ROLLOUT_CHANGED, "train-vs-rollout routing changed")
SCALE_REGIME_CLAIMS = (
    Claim(
        "R3 removes the engine's routing disagreement and lowers the train-inference KL and extreme-ratio tokens",
        "R3 paper (Qwen3-30B-A3B, SGLang vs Megatron): ~10% of router choices differ per layer; replaying them lowers "
        "the training-inference KL and the share of tokens with extreme ratios",
        (
            Comparison(Side("grpo", tag(_TVR[0]), _TVR[0]), Side("grpo_r3", tag(_TVR[0]), _TVR[0])),
            Comparison(Side("grpo", tag(OFFPOLICY_KL), OFFPOLICY_KL), Side("grpo_r3", tag(OFFPOLICY_KL), OFFPOLICY_KL)),
            Comparison(Side("grpo", tag(EXTREME), EXTREME), Side("grpo_r3", tag(EXTREME), EXTREME)),
        ),
        caveat="KL(rollout || trainer) by k3 on the old pass; a token is extreme when its ratio is outside [1/2, 2]",
    ),
    Claim(
        "R3 lowers the train-inference KL more than TIS does",
        "R3 paper: replay removes the routing part of the mismatch; importance weights only reweigh its tokens",
        (
            Comparison(
                Side("grpo_tis", tag(OFFPOLICY_KL), OFFPOLICY_KL), Side("grpo_r3", tag(OFFPOLICY_KL), OFFPOLICY_KL)
            ),
        ),
    ),
    Claim(
        "TIS and IcePop act in this regime: TIS truncates tokens, IcePop zeroes tokens outside its band",
        "TIS / IcePop (Ring-1T) papers: the correction caps the weights' variance at the cost of some tokens' signal",
        (
            Comparison(
                Side("grpo_tis", tag(TRUNCATED), TRUNCATED),
                Side("grpo", tag(TRUNCATED), f"{TRUNCATED} (no correction: 0)"),
            ),
            Comparison(
                Side("grpo_icepop", tag(DROPPED), DROPPED), Side("grpo", tag(DROPPED), f"{DROPPED} (no correction: 0)")
            ),
        ),
    ),
    Claim(
        "The mismatch hurts GRPO: without it GRPO learns more on held-out problems",
        "R3 paper: the train-inference routing mismatch, not the update itself, is what degrades MoE RL",
        (
            Comparison(
                Side("grpo_no_mismatch", HELD_OUT, tags.eval_pass_at(1)), Side("grpo", HELD_OUT, tags.eval_pass_at(1))
            ),
        ),
        caveat="held-out pass@1 of the evaluations after step 0; grpo_no_mismatch: the same run without the simulation",
    ),
    Claim(
        "GRPO without replay learns less on held-out problems than GRPO+R3",
        "R3 paper: GRPO without replay degrades or collapses on MoE models where GRPO+R3 keeps improving",
        (Comparison(Side("grpo_r3", HELD_OUT, tags.eval_pass_at(1)), Side("grpo", HELD_OUT, tags.eval_pass_at(1))),),
        caveat="held-out pass@1 of the evaluations after step 0",
    ),
    Claim(
        "GRPO without replay is less stable than GRPO+R3 (larger gradient-norm peaks)",
        "R3 paper: the mismatch shows as gradient-norm spikes before a collapse",
        (
            Comparison(
                Side("grpo", peak(tag(tags.TRAIN_GRAD_NORM)), f"peak {tags.TRAIN_GRAD_NORM}"),
                Side("grpo_r3", peak(tag(tags.TRAIN_GRAD_NORM)), f"peak {tags.TRAIN_GRAD_NORM}"),
            ),
        ),
    ),
    Claim(
        "GSPO and GMPO without replay learn as well as GRPO+R3",
        "GSPO and GMPO papers: sequence-level (geometric) ratios make routing replay unnecessary",
        (
            Comparison(
                Side("gspo", HELD_OUT, tags.eval_pass_at(1)),
                Side("grpo_r3", HELD_OUT, tags.eval_pass_at(1)),
                at_least=True,
            ),
            Comparison(
                Side("gmpo", HELD_OUT, tags.eval_pass_at(1)),
                Side("grpo_r3", HELD_OUT, tags.eval_pass_at(1)),
                at_least=True,
            ),
        ),
        caveat='"as well as" is judged within 2 standard errors over the seeds: with 3 seeds a small loss can pass',
    ),
    Claim(
        "R2 removes the routing change inside the update",
        "GSPO paper: ~10% of activated experts change after each update (48-layer Qwen3-30B-A3B); R2 replays the old "
        "policy's experts so the update keeps the routing that generated the ratios",
        (
            Comparison(
                Side("grpo", tag(tags.ROUTING_REPLAYED_CHANGED), tags.ROUTING_REPLAYED_CHANGED),
                Side("grpo_r2", tag(tags.ROUTING_REPLAYED_CHANGED), tags.ROUTING_REPLAYED_CHANGED),
            ),
        ),
    ),
    Claim(
        "SAPO without replay learns as well as GRPO+R3",
        "SAPO paper: a soft gate instead of a hard clip, stable on MoE models",
        (
            Comparison(
                Side("sapo", HELD_OUT, tags.eval_pass_at(1)),
                Side("grpo_r3", HELD_OUT, tags.eval_pass_at(1)),
                at_least=True,
            ),
        ),
    ),
)
CLAIM_SETS = {"papers": CLAIMS, "scale_regime": SCALE_REGIME_CLAIMS}  # a compare config's `claims:`


def compare(c: Comparison, data: dict[str, dict[str, Scalars]]) -> Outcome | None:
    """The paired comparison over the seeds both runs have (several), or over the steps
    both logged (one seed); ``None`` when a run or figure is missing."""
    seeds = sorted(set(data.get(c.a.run, {})) & set(data.get(c.b.run, {})))
    if not seeds:
        return None
    series_a = [c.a.series(data[c.a.run][seed]) for seed in seeds]
    series_b = [c.b.series(data[c.b.run][seed]) for seed in seeds]
    if len(seeds) > 1:  # one pair per seed: the run's mean figure
        if not all(series_a) or not all(series_b):
            return None
        a, b = [statistics.fmean(s.values()) for s in series_a], [statistics.fmean(s.values()) for s in series_b]
    else:  # one seed: one pair per step both runs logged
        steps = sorted(set(series_a[0]) & set(series_b[0]))
        a, b = [series_a[0][st] for st in steps], [series_b[0][st] for st in steps]
    if not a:
        return None
    diffs = [x - y for x, y in zip(a, b)]
    effect = statistics.fmean(diffs)
    stderr = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.inf
    agrees = effect >= -Z * stderr if c.at_least else effect > Z * stderr and effect > 0
    return Outcome(statistics.fmean(a), statistics.fmean(b), _sd(a), _sd(b), effect, stderr, len(diffs), agrees)


def _sd(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


@dataclass
class ClaimResult:
    claim: Claim
    outcomes: list[Outcome | None]  # one per comparison; None: its runs or tags are missing

    @property
    def checkable(self) -> bool:
        return all(o is not None for o in self.outcomes)

    @property
    def agrees(self) -> bool:
        return self.checkable and all(o.agrees for o in self.outcomes)


def evaluate_claims(
    runs: dict[str, Scalars],
    seeds: list[int] | None = None,
    compared: set[str] | None = None,
    claims: tuple[Claim, ...] = CLAIMS,
) -> list[ClaimResult]:
    """The comparisons of every claim (of ``claims``: one of ``CLAIM_SETS``) whose runs are
    all among ``compared`` (the base run names the comparison configured; default: those in
    ``runs``), on the runs' scalars (:func:`moe_rl.report.read_scalars`; run names
    ``<base>_s<seed>`` with seeds). A run that failed leaves its claims "cannot be checked"."""
    data = group_by_run(runs, seeds)
    names = set(data) if compared is None else compared
    return [
        ClaimResult(claim, [compare(c, data) for c in claim.comparisons])
        for claim in claims
        if _runs_of(claim) <= names
    ]


def _runs_of(claim: Claim) -> set[str]:
    """The runs a claim compares: a comparison without them leaves the claim out."""
    return {side.run for c in claim.comparisons for side in (c.a, c.b)}


def claims_section(results: list[ClaimResult], seeds: list[int] | None = None) -> str:
    """The report's claims table: each comparison's figures, effect ± SE and verdict."""
    paired_by = f"{len(seeds)} seeds ({', '.join(map(str, seeds))})" if seeds and len(seeds) > 1 else "steps (one seed)"
    lines = [
        "## The papers' claims at small scale",
        "",
        f"Each row compares a figure of run A with run B, paired by {paired_by}: A and B as mean ± std over the "
        f"{'seeds' if seeds and len(seeds) > 1 else 'steps'}, the effect as "
        f"the mean paired difference A − B ± its standard error. A row agrees when the effect is in the claimed direction "
        f'by more than {Z:g} standard errors ("≥" rows: when A is not below B by more than that). A claim agrees when '
        "all its rows do.",
        "",
        "| claim | figure (tag) | A | B | A − B ± SE | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for i, result in enumerate(results, 1):
        lines += [_row(i, c, o) for c, o in zip(result.claim.comparisons, result.outcomes)]
    lines += ["", f"**{summary_line(results)}**", ""]
    lines += [
        f"{i}. {r.claim.statement}: **{'agrees' if r.agrees else 'does not agree' if r.checkable else 'cannot be checked'}**. "
        f"Paper: {r.claim.paper}." + (f" Caveat: {r.claim.caveat}." if r.claim.caveat else "")
        for i, r in enumerate(results, 1)
    ]
    return "\n".join(lines)


def claims_lead(results: list[ClaimResult]) -> list[str]:
    """The claims' verdict for the report's conclusions: how many agree, and for those that
    do not, why they may not at this scale (their caveats)."""
    if not results:
        return []
    lines = [f"The papers' claims: {summary_line(results)} (table below)."]
    for i, r in enumerate(results, 1):
        if r.checkable and not r.agrees:
            lines.append(
                f"Claim {i} does not agree here ({r.claim.statement})"
                + (f": {r.claim.caveat}." if r.claim.caveat else ".")
            )
    return lines


def summary_line(results: list[ClaimResult]) -> str:
    checkable = [r for r in results if r.checkable]
    missing = len(results) - len(checkable)
    return f"{sum(r.agrees for r in checkable)} of {len(checkable)} checkable claims agree" + (
        f" ({missing} lack a run or figure)" if missing else ""
    )


def _row(i: int, c: Comparison, o: Outcome | None) -> str:
    """One comparison: "A > B" naming both sides (their runs, and their figures when one
    run is compared with itself), A and B, the effect and the verdict, in 3 significant figures."""
    relation = "≥" if c.at_least else ">"
    if c.a.run == c.b.run:
        head, figure = f"{i}. {c.a.run}: A {relation} B", f"A: {c.a.label}; B: {c.b.label}"
    else:
        head = f"{i}. {c.a.run} (A) {relation} {c.b.run} (B)"
        figure = c.a.label if c.a.label == c.b.label else f"A: {c.a.label}; B: {c.b.label}"
    if o is None:
        return f"| {head} | {figure} | — | — | — | cannot be checked (run or tag missing) |"
    verdict = "agrees" if o.agrees else "does not agree"
    se = "n/a" if math.isinf(o.stderr) else sig(o.stderr, 2)
    return f"| {head} | {figure} | {sig(o.mean_a)} ± {sig(o.spread_a, 2)} | {sig(o.mean_b)} ± {sig(o.spread_b, 2)} | {sig(o.effect, sign=True)} ± {se} | {verdict} |"
