"""The papers' claims, tested at small scale from the runs' own TensorBoard logs.

A claim is one or more comparisons of a figure (computed from named tags) between two
runs, or between two figures of one run. Each comparison is paired: by seed when the
runs were repeated over seeds (``moe-rl compare --seeds``; a run's figure is its per-step
values' mean, or for heavy-tailed figures the median of their logs), else by step. The
effect is the mean paired difference, its noise the standard error of that mean, and the
threshold Student's t for n - 1 degrees of freedom at one-sided 97.5% (n pairs: 4.30 for
3 seeds, not 2). A strict comparison agrees when the effect exceeds t standard errors in
the claimed direction; an "as well as" comparison when A is below B by no more than its stated
margin even at the low end (effect - t SE >= -margin): noise alone never passes it.
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
CONFIDENCE = 0.975  # one-sided: an effect must exceed Student's t at this quantile, in standard errors
PASS_AT_1_MARGIN = 0.05  # "as well as" on held-out pass@1: not more than 5 points lower
ROUTING_MARGIN = 0.001  # "the same routing change": within 0.1 points of the router choices
IS_WEIGHT_MARGIN = 0.01  # "no larger importance weight": within 0.01 of a ratio
LOG_FLOOR = 1e-12  # a figure logged is floored here first (a KL of 0 under exact replay)
OFFPOLICY_KL = tags.train("offpolicy/kl_k3")
# learning is judged on held-out problems (a reward can be gamed): pass@1 after training
# starts (the step-0 evaluation is the same model in every run)
IS_WEIGHT_MAX = tags.train("offpolicy/is_weight_max")
DROPPED = tags.train("offpolicy/dropped_token_frac")
TRUNCATED = tags.train("offpolicy/truncated_frac")
EXTREME = tags.train("offpolicy/extreme_token_frac")


def t_critical(dof: int, confidence: float = CONFIDENCE) -> float:
    """Student's t quantile: the ``t`` with ``P(T <= t) = confidence`` for ``dof`` degrees of
    freedom (bisection on the CDF, through the regularised incomplete beta function)."""
    if dof < 1:
        return math.inf
    lo, hi = 0.0, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, dof) < confidence else (lo, mid)
    return (lo + hi) / 2


def t_cdf(t: float, dof: int) -> float:
    """``P(T <= t)`` for Student's t with ``dof`` degrees of freedom."""
    tail = 0.5 * _incomplete_beta(dof / 2, 0.5, dof / (dof + t * t))
    return 1 - tail if t >= 0 else tail


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function ``I_x(a, b)`` (continued fraction, Lentz)."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast on this side
        return 1 - _incomplete_beta(b, a, 1 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny, c, d, f = 1e-300, 1.0, 0.0, 1.0
    for i in range(400):
        m = i // 2
        if i == 0:
            numerator = 1.0
        elif i % 2 == 0:
            numerator = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            numerator = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1 + numerator * d
        d = 1 / (d if abs(d) > tiny else tiny)
        c = 1 + numerator / c if abs(1 + numerator / c) > tiny else tiny
        f *= c * d
        if abs(1 - c * d) < 1e-15:
            break
    return front * (f - 1)


def tag(name: str) -> Series:
    return lambda s: s.get(name, {})


def logged(series: Series) -> Series:
    """The figure's natural log per step (floored at :data:`LOG_FLOOR`): for heavy-tailed
    figures (a per-step KL), whose log differences are ratios."""

    def log_of(s: Scalars) -> dict[int, float]:
        return {st: math.log(max(v, LOG_FLOOR)) for st, v in series(s).items()}

    return log_of


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
    per_run: Callable[[list[float]], float] = statistics.fmean  # a run's figure from its steps' values (by seed)
    log: bool = False  # the series is a log (:func:`logged`): shown as exp, effects are log ratios


def robust(run: str, name: str) -> Side:
    """A heavy-tailed per-step figure (a KL): a run's figure is the log of its median over steps."""
    return Side(run, logged(tag(name)), name, per_run=statistics.median, log=True)


@dataclass(frozen=True)
class Comparison:
    """``a`` is claimed larger than ``b``; ``at_least``: not smaller than ``b`` by more than
    ``margin`` (stated for every such claim), beyond the noise."""

    a: Side
    b: Side
    at_least: bool = False
    margin: float | None = None

    def __post_init__(self) -> None:
        if self.at_least and (self.margin is None or self.margin < 0):
            raise ValueError(f"an 'as well as' comparison of {self.a.run} and {self.b.run} needs a margin >= 0")


def as_well_on_held_out(a: str, b: str) -> Comparison:
    """Run ``a`` does as well as ``b`` on held-out pass@1 (after step 0), within :data:`PASS_AT_1_MARGIN`."""
    held_out = tags.eval_pass_at(1)
    return Comparison(Side(a, HELD_OUT, held_out), Side(b, HELD_OUT, held_out), at_least=True, margin=PASS_AT_1_MARGIN)


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
    threshold: float = math.inf  # Student's t for pairs - 1 degrees of freedom


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
            as_well_on_held_out("gspo", "grpo"),
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
            as_well_on_held_out("gspo", "grpo_r2"),
            as_well_on_held_out("gmpo", "grpo_r2"),
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
                margin=ROUTING_MARGIN,
            ),
            Comparison(
                Side("grpo", tag(tags.ROUTING_TRAIN_VS_ROLLOUT_CHANGED), tags.ROUTING_TRAIN_VS_ROLLOUT_CHANGED),
                Side("grpo_tis", tag(tags.ROUTING_TRAIN_VS_ROLLOUT_CHANGED), tags.ROUTING_TRAIN_VS_ROLLOUT_CHANGED),
                at_least=True,
                margin=ROUTING_MARGIN,
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
                margin=IS_WEIGHT_MARGIN,
            ),
            Comparison(
                Side("grpo_icepop", tag(DROPPED), DROPPED),
                Side("grpo", tag(DROPPED), DROPPED),
                at_least=True,
                margin=0.0,
            ),
        ),
        caveat="at the default band [0.5, 2] a token ratio must be off by 2x to be cut: at this scale the mismatch is ~1e-3, "
        "so the bound holds trivially and few tokens, if any, are dropped",
    ),
    Claim(
        "GSPO trains on the engine's own log-probs (no recompute pass) as well as on recomputed ones; token-level GRPO loses accuracy there",
        "GSPO review §4: a sequence-level ratio tolerates the engine/trainer precision gap that token-level GRPO does not",
        (
            as_well_on_held_out("gspo_rollout_logp", "gspo"),
            Comparison(
                Side("grpo", HELD_OUT, tags.eval_pass_at(1)), Side("grpo_rollout_logp", HELD_OUT, tags.eval_pass_at(1))
            ),
        ),
        caveat="held-out pass@1 of the evaluations after step 0; the engine rounds its weights to bf16",
    ),
    Claim(
        "SAPO learns as well as GRPO on held-out problems",
        "SAPO paper: a soft gate instead of a hard clip, stable on MoE models",
        (as_well_on_held_out("sapo", "grpo"),),
    ),
)

# In a simulated 30B-scale train-inference mismatch (configs/compare/scale_regime.yaml: the engine's
# routing perturbed, selection only, and its logits, calibrated to the R3 paper's KL figures; the
# routers learning fast on the update side): the papers' claims about replay and corrections.
_TVR = tags.ROUTING_TRAIN_VS_ROLLOUT_CHANGED


SCALE_REGIME_CLAIMS = (
    Claim(
        "R3 removes the engine's routing disagreement",
        "R3 paper (Qwen3-30B-A3B, SGLang vs Megatron): ~10% of router choices differ per layer between inference "
        "and training; R3 trains on the engine's",
        (Comparison(Side("grpo", tag(_TVR), _TVR), Side("grpo_r3", tag(_TVR), _TVR)),),
    ),
    Claim(
        "R3 lowers the train-inference KL and the share of extreme-ratio tokens",
        "R3 paper: k3 KL 1.535e-3 per token without replay, ~7.5e-4 with R3 (a dense Qwen3-8B: 6.4e-4); about an "
        "order of magnitude fewer tokens with a ratio outside [1/2, 2]",
        (
            Comparison(robust("grpo", OFFPOLICY_KL), robust("grpo_r3", OFFPOLICY_KL)),
            # (a rare event: most steps have none, so a median over steps is 0 either way)
            Comparison(Side("grpo", tag(EXTREME), EXTREME), Side("grpo_r3", tag(EXTREME), EXTREME)),
        ),
        caveat="KL(rollout || trainer) by k3 on the old pass; a token is extreme when its ratio leaves [1/2, 2]",
    ),
    Claim(
        "R3 lowers the train-inference KL more than TIS does",
        "R3 paper: replay removes the routing part of the mismatch; importance weights only reweigh its tokens",
        (Comparison(robust("grpo_tis", OFFPOLICY_KL), robust("grpo_r3", OFFPOLICY_KL)),),
    ),
    Claim(
        "TIS acts in this regime: it truncates tokens",
        "TIS: the correction caps the importance weights, at the cost of some tokens' signal",
        (
            Comparison(
                Side("grpo_tis", tag(TRUNCATED), TRUNCATED),
                Side("grpo", tag(TRUNCATED), f"{TRUNCATED} (no correction: 0)"),
            ),
        ),
    ),
    Claim(
        "The mismatch hurts GRPO: without it GRPO does better on held-out problems",
        "R3 paper: the train-inference routing mismatch, not the update itself, is what degrades MoE RL",
        (
            Comparison(
                Side("grpo_no_mismatch", HELD_OUT, tags.eval_pass_at(1)), Side("grpo", HELD_OUT, tags.eval_pass_at(1))
            ),
        ),
        caveat="held-out pass@1, mean of the evaluations after step 0; grpo_no_mismatch: the same run without the "
        "simulation",
    ),
    Claim(
        "GRPO+R3 does better on held-out problems than GRPO without replay",
        "R3 paper: GRPO without replay degrades or collapses on MoE models where GRPO+R3 keeps improving",
        (Comparison(Side("grpo_r3", HELD_OUT, tags.eval_pass_at(1)), Side("grpo", HELD_OUT, tags.eval_pass_at(1))),),
        caveat="held-out pass@1, mean of the evaluations after step 0",
    ),
    Claim(
        "GRPO+R3 does as well as GRPO without the mismatch: replay wins back what the mismatch costs",
        "R3 paper: with replay the train-inference gap falls to a dense model's and training is stable",
        (as_well_on_held_out("grpo_r3", "grpo_no_mismatch"),),
        caveat="R3 cannot remove the logit part of the mismatch (the part a dense model has too)",
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
        "GSPO and GMPO without replay do as well as GRPO+R3 on held-out problems",
        "GSPO and GMPO papers: sequence-level (geometric) ratios make routing replay unnecessary",
        (
            as_well_on_held_out("gspo", "grpo_r3"),
            as_well_on_held_out("gmpo", "grpo_r3"),
        ),
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
    if len(seeds) > 1:  # one pair per seed: each run's figure over the steps both logged
        common = [sorted(set(sa) & set(sb)) for sa, sb in zip(series_a, series_b)]
        if not all(common):
            return None
        a = [c.a.per_run([s[st] for st in steps]) for s, steps in zip(series_a, common)]
        b = [c.b.per_run([s[st] for st in steps]) for s, steps in zip(series_b, common)]
    else:  # one seed: one pair per step both runs logged
        steps = sorted(set(series_a[0]) & set(series_b[0]))
        a, b = [series_a[0][st] for st in steps], [series_b[0][st] for st in steps]
    if not a:
        return None
    diffs = [x - y for x, y in zip(a, b)]
    effect = statistics.fmean(diffs)
    stderr = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.inf
    t = t_critical(len(diffs) - 1)
    agrees = effect - t * stderr >= -(c.margin or 0.0) if c.at_least else effect > t * stderr and effect > 0
    return Outcome(statistics.fmean(a), statistics.fmean(b), _sd(a), _sd(b), effect, stderr, len(diffs), agrees, t)


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
        return all(o is not None and o.agrees for o in self.outcomes)


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
    paired_by = (
        f"seed ({', '.join(map(str, seeds))}, and any further seeds both runs have: n in t(n − 1))"
        if seeds and len(seeds) > 1
        else "steps (one seed)"
    )
    lines = [
        "## The papers' claims at small scale",
        "",
        f"Each row compares a figure of run A with run B, paired by {paired_by}: A and B as mean ± std over the "
        f"{'seeds' if seeds and len(seeds) > 1 else 'steps'}, the effect as the mean paired difference A − B ± its "
        'standard error (SE). t is Student\'s t for n − 1 degrees of freedom at one-sided 97.5% (n pairs). A ">" row '
        'agrees when the effect exceeds t·SE; a "≥" row ("as well as") when A − B − t·SE is at least −margin, the '
        "margin stated in the row: A is at most that much below B, noise included. The test column says what the "
        "effect had to exceed. Rows marked (log) compare the log of each run's median over steps (a heavy-tailed "
        "figure such as a per-step KL; with one seed: each step's log, paired by step): A and B are shown as exp of "
        "their mean log, with the std of the logs; the effect is a log ratio (+0.69: A is twice B). A claim agrees "
        "when all its rows do.",
        "",
        "| claim | figure (tag) | A | B | A − B ± SE | test | verdict |",
        "|---|---|---|---|---|---|---|",
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


def replay_answer(runs: dict[str, Scalars], seeds: list[int] | None = None) -> list[str]:
    """ "Do you need routing replay here?" in words, from the runs themselves: what R3 did to the
    train-inference KL (beside the R3 paper's figures) and to held-out pass@1, against GRPO
    without replay and without the mismatch; empty unless the runs simulate a mismatch and hold
    ``grpo`` and ``grpo_r3``."""
    from moe_rl.report import PAPER_KL, PAPER_KL_R3, SIMULATED_TARGETS

    data = group_by_run(runs, seeds)
    if not {"grpo", "grpo_r3"} <= set(data) or not any(
        t in s for s in data["grpo"].values() for t in SIMULATED_TARGETS
    ):
        return []
    kl = compare(Comparison(robust("grpo", OFFPOLICY_KL), robust("grpo_r3", OFFPOLICY_KL)), data)
    won = compare(Comparison(Side("grpo_r3", HELD_OUT, "p"), Side("grpo", HELD_OUT, "p")), data)
    if kl is None or won is None:
        return []
    held = lambda o: f"{o.effect:+.3f} ± {sig(o.stderr, 2)}, {o.pairs} pairs, needed > {sig(o.threshold * o.stderr, 2)}"  # noqa: E731
    typical = "median over steps" if seeds and len(seeds) > 1 else "geometric mean over steps"
    lines = [
        f"Do you need routing replay here? R3 took the train-inference KL ({typical}) from "
        f"{sig(math.exp(kl.mean_a), 2)} to {sig(math.exp(kl.mean_b), 2)} per token (R3 paper: {PAPER_KL:g} to "
        f"{PAPER_KL_R3:g}) and held-out pass@1 from {won.mean_b:.3f} (GRPO) to {won.mean_a:.3f} ({held(won)})."
    ]
    cost = compare(Comparison(Side("grpo_no_mismatch", HELD_OUT, "p"), Side("grpo", HELD_OUT, "p")), data)
    hurt = cost is not None and cost.agrees
    if cost is not None:
        lines.append(f"Without the mismatch GRPO reached {cost.mean_a:.3f} ({held(cost)} over GRPO with it).")
    lines.append(
        "Replay won back held-out accuracy the mismatch cost: here, yes."
        if won.agrees
        else "The mismatch cost held-out accuracy that replay did not win back."
        if hurt
        else "The mismatch cost no measurable held-out accuracy and replay won none back: here, no."
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
        return f"| {head} | {figure} | — | — | — | — | cannot be checked (run or tag missing) |"
    verdict = "agrees" if o.agrees else "does not agree"
    se = "n/a" if math.isinf(o.stderr) else sig(o.stderr, 2)
    log = c.a.log and c.b.log
    shown = (lambda x: sig(math.exp(x))) if log else sig  # noqa: E731
    figure += " (log)" if log else ""
    return (
        f"| {head} | {figure} | {shown(o.mean_a)} ± {sig(o.spread_a, 2)} | {shown(o.mean_b)} ± {sig(o.spread_b, 2)} "
        f"| {sig(o.effect, sign=True)} ± {se} | {_test(c, o)} | {verdict} |"
    )


def _test(c: Comparison, o: Outcome) -> str:
    """What the effect had to exceed: t·SE (minus the margin for "as well as")."""
    if math.isinf(o.threshold) or math.isinf(o.stderr):
        return "n/a (one pair)"
    bar = o.threshold * o.stderr - (c.margin or 0.0 if c.at_least else 0.0)
    margin = f", margin {c.margin:g}" if c.at_least else ""
    return f"t({o.pairs - 1}) = {o.threshold:.2f}{margin}: {'≥' if c.at_least else '>'} {sig(bar, 2)}"
