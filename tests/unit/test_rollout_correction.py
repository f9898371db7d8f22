"""Rollout corrections (TIS / MIS / IcePop / rejection), their off-policy diagnostics and
SAPO against hand formulas: weights, kept masks, the normaliser without dropped tokens
(and with IcePop's zero-weighted ones), one extreme token, gradients, micro-batch and
data-parallel invariance, config errors."""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from moe_rl.algorithms import AGG_MODES, policy_loss
from moe_rl.algorithms.rollout_correction import (
    ROLLOUT_CORRECTIONS,
    mismatch_metrics,
    mismatch_sums,
    rollout_correction,
)

B, T = 5, 4
LENGTHS = [4, 2, 3, 1, 0]


def batch(seed: int = 0, spread: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).double()
    rollout = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 2 * mask
    old = (rollout + spread * torch.randn(B, T, generator=gen, dtype=torch.float64)) * mask
    return old, rollout, mask


def hand(name: str, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, **p) -> tuple[list, list]:
    """(weights, keep) per token by loops over the module docstring's formulas."""
    weights, keep = [[0.0] * T for _ in range(B)], [[0.0] * T for _ in range(B)]
    for i in range(B):
        toks = [t for t in range(T) if mask[i, t] > 0]
        logs = [float(old[i, t] - rollout[i, t]) for t in toks]
        seq_log = (sum(logs) / max(len(logs), 1)) if p.get("seq_ratio") == "mean" else sum(logs)
        k3 = [math.exp(x) - 1 - x for x in logs]
        lo, hi = p.get("lower", 0.5), p.get("upper", 2.0)
        for t, x in zip(toks, logs):
            r, R = math.exp(x), math.exp(seq_log)
            w, k = {
                "token_tis": (min(r, hi), 1.0),
                "seq_tis": (min(R, hi), 1.0),
                "token_mis": (r, 1.0) if lo <= r <= hi else (0.0, 0.0),
                "icepop": (r, 1.0) if lo <= r <= hi else (0.0, 1.0),
                "token_band_reject": (1.0, 1.0) if lo <= r <= hi else (0.0, 0.0),
                "seq_mis": (R, 1.0) if lo <= R <= hi else (0.0, 0.0),
                "reject": (1.0, 1.0) if max(k3) <= p.get("threshold", 0.01) else (0.0, 0.0),
            }[name]
            weights[i][t], keep[i][t] = w, k
    return weights, keep


CASES = [
    ("token_tis", {}),
    ("token_tis", {"upper": 1.2}),
    ("seq_tis", {}),
    ("seq_tis", {"seq_ratio": "mean", "upper": 1.1}),
    ("token_mis", {}),
    ("icepop", {}),
    ("icepop", {"lower": 0.8, "upper": 1.5}),
    ("token_band_reject", {}),
    ("seq_mis", {}),
    ("reject", {"threshold": 0.05}),
]


@pytest.mark.parametrize("name, params", CASES)
def test_weights_and_kept_tokens_equal_the_formulas(name: str, params: dict) -> None:
    old, rollout, mask = batch()
    c = rollout_correction(name, old, rollout, mask, **params)
    weights, keep = hand(name, old, rollout, mask, **params)
    torch.testing.assert_close(c.weights, torch.tensor(weights, dtype=torch.float64))
    torch.testing.assert_close(c.keep, torch.tensor(keep, dtype=torch.float64))
    assert not c.weights.requires_grad
    kept = c.keep.sum() / mask.sum()
    assert 0 < kept <= 1 and (kept < 1) == (
        name in ("token_mis", "token_band_reject", "seq_mis", "reject")
    )  # the batch has outliers (IcePop zero-weights them but keeps every token)


def test_every_registered_correction_is_tested() -> None:
    assert {name for name, _ in CASES} == set(ROLLOUT_CORRECTIONS.names())


def hand_grpo_tis_loss(logp, old, adv, weights, keep):
    """Σ over kept tokens of w * PPO's clipped term, over the kept-token count."""
    total, count = 0.0, 0
    for i in range(B):
        for t in range(T):
            if keep[i][t] > 0:
                rho = math.exp(float(logp[i, t] - old[i, t]))
                total += weights[i][t] * max(-adv[i] * rho, -adv[i] * min(max(rho, 0.8), 1.2))
                count += 1
    return total / count


@pytest.mark.parametrize("name", ["token_tis", "token_mis"])
def test_weighted_loss_value_gradient_and_normaliser(name: str) -> None:
    """GRPO under the correction: the hand value with dropped tokens out of the mean, and
    the gradient w * A * rho / N on unclipped kept tokens (0 on dropped ones)."""
    old, rollout, mask = batch(seed=1)
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3], dtype=torch.float64)
    logp = (
        old + 0.05 * torch.randn(B, T, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ).requires_grad_(True)
    c = rollout_correction(name, old, rollout, mask)
    kept = mask * c.keep
    loss, _ = policy_loss("grpo", logp, old, adv, kept, token_weights=c.weights, num_tokens=kept.sum())
    weights, keep = hand(name, old, rollout, mask)
    assert loss.item() == pytest.approx(hand_grpo_tis_loss(logp.detach(), old, adv.tolist(), weights, keep), rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    rho = (logp - old).exp().detach()
    unclipped = ((rho - 1).abs() < 0.2).double()
    torch.testing.assert_close(grad * unclipped, -(c.weights * adv[:, None] * rho) * kept * unclipped / kept.sum())
    assert (grad[c.keep == 0] == 0).all()


@pytest.mark.parametrize("loss_name", ["grpo", "gspo", "gmpo", "sapo"])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_micro_batches_sum_to_the_full_batch_with_a_correction(loss_name: str, agg: str) -> None:
    old, rollout, mask = batch(seed=3)
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3], dtype=torch.float64)
    logp = (
        old + 0.01 * torch.randn(B, T, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    ).requires_grad_(True)
    c = rollout_correction("seq_mis", old, rollout, mask)
    kept = mask * c.keep
    counts = dict(num_tokens=kept.sum(), num_seqs=(kept.sum(-1) > 0).sum())
    full, _ = policy_loss(loss_name, logp, old, adv, kept, agg=agg, token_weights=c.weights, **counts)
    parts = sum(
        policy_loss(loss_name, logp[s], old[s], adv[s], kept[s], agg=agg, token_weights=c.weights[s], **counts)[0]
        for s in (slice(0, 2), slice(2, 5))
    )
    assert parts.item() == pytest.approx(full.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(torch.autograd.grad(parts, logp)[0], torch.autograd.grad(full, logp)[0])


def icepop_step(agg: str):
    """The policy objective over two micro-batches under ``icepop`` (kept counts as the
    trainer takes them): its summed loss, the gradient, and the inputs."""
    from types import SimpleNamespace

    from moe_rl.config import AlgorithmConfig
    from moe_rl.trainer.objective import PolicyObjective, kept_counts

    old, rollout, mask = batch(seed=1)
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3], dtype=torch.float64)
    logp = (
        old + 0.05 * torch.randn(B, T, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ).requires_grad_(True)
    rows = (slice(0, 2), slice(2, 5))
    mbs = [
        SimpleNamespace(
            mask=mask[r],
            advantages=adv[r],
            old_logp=old[r],
            rollout_logp=rollout[r],
            ref_logp=None,
            correction=rollout_correction("icepop", old[r], rollout[r], mask[r]),
        )
        for r in rows
    ]
    tokens, seqs = kept_counts(SimpleNamespace(micro_batches=mbs, num_tokens=None, num_seqs=None), corrected=True)
    objective = PolicyObjective(AlgorithmConfig(rollout_correction="icepop", loss_params={"agg": agg}), tokens, seqs)
    loss = sum(objective(torch.stack([logp[r], torch.zeros_like(logp[r])], -1), mb)[0] for r, mb in zip(rows, mbs))
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, grad, (tokens, seqs), (logp.detach(), old, rollout, mask, adv)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_icepop_loss_counts_every_token_in_the_normaliser(agg: str) -> None:
    """IcePop's objective end to end (rollout_correction -> kept_counts -> PolicyObjective):
    ``sum_t M(k_t) * PPO_t`` over every response token (``M(k) = k`` in [0.5, 2], else 0),
    over all tokens (token-mean) or per sequence over all its tokens (the paper's
    seq-mean-token-mean); out-of-band tokens get no gradient."""
    loss, grad, (tokens, seqs), (logp, old, rollout, mask, adv) = icepop_step(agg)
    assert (tokens, seqs) == (float(mask.sum()), 4.0)
    per_seq, masked = [], 0
    for i in range(B):
        terms = []
        for t in range(LENGTHS[i]):
            k = math.exp(float(old[i, t] - rollout[i, t]))
            rho = math.exp(float(logp[i, t] - old[i, t]))
            ppo = max(-float(adv[i]) * rho, -float(adv[i]) * min(max(rho, 0.8), 1.2))
            terms.append(k * ppo if 0.5 <= k <= 2.0 else 0.0)
            masked += not 0.5 <= k <= 2.0
        per_seq.append(terms)
    assert 0 < masked < tokens  # the batch has tokens on both sides of the band
    if agg == "token-mean":
        expected = sum(sum(terms) for terms in per_seq) / sum(LENGTHS)
    else:
        expected = sum(sum(terms) / len(terms) for terms in per_seq if terms) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    k, rho = (old - rollout).exp(), (logp - old).exp()
    assert ((rho - 1).abs() < 0.2).all()  # no clip active: the gradient is -M(k) A rho / normaliser
    band = ((k >= 0.5) & (k <= 2.0)).double() * mask
    per_token = mask.sum() if agg == "token-mean" else 4 * mask.sum(-1, keepdim=True).clamp(min=1)
    torch.testing.assert_close(grad, -k * band * adv[:, None] * rho / per_token)


def test_icepop_diagnostics_count_zero_weighted_tokens_as_dropped() -> None:
    old, rollout, mask = batch(seed=1)
    c = rollout_correction("icepop", old, rollout, mask)
    m = mismatch_metrics({k: float(v) for k, v in mismatch_sums(old, rollout, mask, c).items()})
    ratio = (old - rollout).exp()[mask.bool()]
    band = (ratio >= 0.5) & (ratio <= 2.0)
    assert 0 < m["dropped_token_frac"] == pytest.approx(float((~band).double().mean()))
    assert m["is_weight_mean"] == pytest.approx(float(ratio[band].mean()))
    assert 0.5 <= m["is_weight_min"] == pytest.approx(float(ratio[band].min()))
    assert m["is_ess"] == pytest.approx(float(ratio[band].sum() ** 2 / (band.sum() * (ratio[band] ** 2).sum())))
    in_band_rows = [(ratio_row >= 0.5) & (ratio_row <= 2.0) for ratio_row in (old - rollout).exp()]
    empty = sum(1 for i in range(B) if LENGTHS[i] and not in_band_rows[i][: LENGTHS[i]].any())
    assert m["rejected_seq_frac"] == pytest.approx(empty / 4)


def test_one_extreme_token_moves_only_the_clamped_sequence_sum() -> None:
    """Log-ratios beyond +-20 on single tokens: a sequence's weight is ``exp`` of the clamp
    of the *sum* (25 - 24.5 + 0.1 = 0.6, not 20 - 20 + 0.1); k1 adds the log-ratios as
    they are; k3 takes ``log r`` capped at 20 (exact below: ~23.5 and ~29 for -24.5 and -30),
    so an engine log-prob of -inf rejects its sequence instead of giving NaN."""
    log_r = torch.tensor([[25.0, -24.5, 0.1, 0.0], [-30.0, 29.8, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    rollout = -0.5 * mask
    old = rollout + log_r
    seq_sum = [0.6, -0.2]
    tis = rollout_correction("seq_tis", old, rollout, mask, upper=5.0)
    torch.testing.assert_close(tis.weights[:, 0], torch.tensor([math.exp(s) for s in seq_sum], dtype=torch.float64))
    mis = rollout_correction("seq_mis", old, rollout, mask, seq_ratio="mean", lower=0.9, upper=1.5)
    torch.testing.assert_close(mis.weights[0, :3], torch.full((3,), math.exp(0.2), dtype=torch.float64))
    assert mis.keep[1].sum() == 2  # exp(-0.1) is in [0.9, 1.5]
    # k1 summed over the sequence: -0.6 (kept) and 0.2 > 0.1 (dropped); a per-token clamp would give 0 for the second
    rej = rollout_correction("reject", old, rollout, mask, estimator="k1", seq_agg="sum", threshold=0.1)
    assert rej.keep.sum(-1).tolist() == [3.0, 0.0]
    sums = mismatch_sums(old, rollout, mask)
    tokens = [x for row, n in zip(log_r.tolist(), (3, 2)) for x in row[:n]]
    assert float(sums["k1"]) == pytest.approx(-sum(tokens), abs=1e-12)
    assert float(sums["k3"]) == pytest.approx(sum(math.expm1(min(x, 20.0)) - min(x, 20.0) for x in tokens), rel=1e-12)
    assert float(sums["chi2_seq"]) == pytest.approx(sum(math.expm1(s) ** 2 for s in seq_sum), rel=1e-12)
    wide = torch.tensor([[30.0, -1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    capped = rollout_correction("seq_tis", rollout + wide, rollout, mask, upper=1e12)
    assert capped.weights[0, 0].item() == pytest.approx(math.exp(20.0))  # the sum 29 clamped to 20
    impossible = rollout.clone()
    impossible[1, 0] = -math.inf
    rej = rollout_correction("reject", old, impossible, mask, estimator="k3", seq_agg="max", threshold=1.0)
    assert rej.keep.sum(-1).tolist() == [0.0, 0.0]  # k3 of log r = 25 (row 0) and of +inf (row 1)
    assert math.isfinite(float(mismatch_sums(old, impossible, mask)["k3"]))  # not NaN


@pytest.mark.parametrize("name", ROLLOUT_CORRECTIONS.names())
def test_non_finite_log_probs_at_padding_change_no_correction_nor_diagnostic(name) -> None:
    old, rollout, mask = batch(seed=6, spread=0.3)
    dirty_old, dirty_rollout = old.clone(), rollout.clone()
    dirty_old[mask == 0], dirty_rollout[mask == 0] = float("nan"), float("-inf")
    clean, dirty = (rollout_correction(name, o, r, mask) for o, r in ((old, rollout), (dirty_old, dirty_rollout)))
    for field in ("weights", "keep", "truncated"):
        torch.testing.assert_close(getattr(dirty, field), getattr(clean, field))
    sums, dirty_sums = mismatch_sums(old, rollout, mask, clean), mismatch_sums(dirty_old, dirty_rollout, mask, dirty)
    for key, value in sums.items():
        torch.testing.assert_close(dirty_sums[key], value, msg=key)


def test_diagnostics_equal_their_formulas() -> None:
    old, rollout, mask = batch(seed=5)
    c = rollout_correction("token_tis", old, rollout, mask, upper=1.5)
    m = mismatch_metrics({k: float(v) for k, v in mismatch_sums(old, rollout, mask, c).items()})
    lr = (old - rollout)[mask.bool()]
    n = lr.numel()
    assert m["kl_k1"] == pytest.approx(float(-lr.mean()))
    assert m["kl_k3"] == pytest.approx(float((lr.exp() - 1 - lr).mean()))
    assert m["chi2_token"] == pytest.approx(float(((lr.exp() - 1) ** 2).mean()))
    seq = torch.tensor([float((old - rollout)[i, : LENGTHS[i]].sum()) for i in range(B) if LENGTHS[i]])
    assert m["chi2_seq"] == pytest.approx(float(((seq.exp() - 1) ** 2).mean()))
    assert m["ppl_train"] == pytest.approx(math.exp(float(-old[mask.bool()].mean())))
    w = lr.exp().clamp(max=1.5)
    assert m["is_weight_mean"] == pytest.approx(float(w.mean())) and m["is_weight_max"] == pytest.approx(float(w.max()))
    assert m["is_ess"] == pytest.approx(float(w.sum() ** 2 / (n * (w**2).sum())))
    assert m["truncated_frac"] == pytest.approx(float((lr.exp() > 1.5).double().mean())) and m["truncated_frac"] > 0
    rejected = mismatch_metrics(
        {
            k: float(v)
            for k, v in mismatch_sums(
                old, rollout, mask, rollout_correction("reject", old, rollout, mask, threshold=0.05)
            ).items()
        }
    )
    assert 0 < rejected["rejected_seq_frac"] < 1 and rejected["dropped_token_frac"] > 0
    same = mismatch_metrics({k: float(v) for k, v in mismatch_sums(old, old, mask).items()})
    assert same["kl_k3"] == 0 and same["is_ess"] == pytest.approx(1.0) and same["log_ppl_ratio"] == 0


def test_sapo_value_and_gradient() -> None:
    """``-A (4/tau) sigmoid(tau (r - 1))`` per token (tau by the advantage's sign), and at
    r = 1 the gradient is the policy gradient's ``-A / N``."""
    old, _, mask = batch(seed=6)
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3], dtype=torch.float64)
    logp = (
        old + 0.3 * torch.randn(B, T, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    ).requires_grad_(True)
    loss, _ = policy_loss("sapo", logp, old, adv, mask, agg="token-mean")
    expected = 0.0
    for i in range(B):
        tau = 1.0 if adv[i] > 0 else 1.05
        for t in range(LENGTHS[i]):
            r = math.exp(float(logp[i, t] - old[i, t]))
            expected += -float(adv[i]) * 4 / tau / (1 + math.exp(-tau * (r - 1)))
    assert loss.item() == pytest.approx(expected / mask.sum().item(), rel=1e-12)
    on_policy = logp.detach().clone().requires_grad_(True)
    loss, metrics = policy_loss("sapo", on_policy, on_policy.detach(), adv, mask, agg="token-mean")
    torch.testing.assert_close(torch.autograd.grad(loss, on_policy)[0], -adv[:, None] * mask / mask.sum())
    assert metrics["clip_frac"] == 0


def _dp_worker(rank: int, port: int, out: dict) -> None:
    """Half the rows per rank: the correction, the kept counts all-reduced, the loss."""
    from types import SimpleNamespace

    from moe_rl.trainer.objective import kept_counts
    from parallel.distributed import destroy_distributed, init_distributed
    from parallel.layout import ParallelLayout

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    init_distributed(ParallelLayout())
    try:
        old, rollout, mask = batch(seed=8)
        rows = slice(0, 2) if rank == 0 else slice(2, 5)
        c = rollout_correction("token_mis", old[rows], rollout[rows], mask[rows])
        mb = SimpleNamespace(mask=mask[rows], correction=c)
        tokens, seqs = kept_counts(SimpleNamespace(micro_batches=[mb], num_tokens=None, num_seqs=None), corrected=True)
        adv = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3], dtype=torch.float64)[rows]
        logp = (old[rows] + 0.05).requires_grad_(True)
        loss, _ = policy_loss(
            "grpo", logp, old[rows], adv, mask[rows] * c.keep, token_weights=c.weights, num_tokens=tokens, num_seqs=seqs
        )
        out[rank] = (float(loss), torch.autograd.grad(loss, logp)[0], tokens)
    finally:
        destroy_distributed()


@pytest.mark.distributed
def test_two_data_parallel_ranks_equal_one_process() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_dp_worker, args=(port, out), nprocs=2, join=True)
        results = [out[0], out[1]]
    old, rollout, mask = batch(seed=8)
    c = rollout_correction("token_mis", old, rollout, mask)
    kept = mask * c.keep
    logp = (old + 0.05).requires_grad_(True)
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3], dtype=torch.float64)
    single, _ = policy_loss("grpo", logp, old, adv, kept, token_weights=c.weights)
    assert results[0][2] == results[1][2] == float(kept.sum()) < float(mask.sum())
    assert results[0][0] + results[1][0] == pytest.approx(single.item(), rel=1e-12)
    torch.testing.assert_close(torch.cat([results[0][1], results[1][1]]), torch.autograd.grad(single, logp)[0])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algorithm.rollout_correction=tis"], "algorithm.rollout_correction='tis' is not valid"),
        (
            ["algorithm.rollout_correction=token_tis", "algorithm.rollout_correction_params.lower=0.5"],
            "lower is not a parameter",
        ),
        (
            ["algorithm.rollout_correction=token_mis", "algorithm.rollout_correction_params.lower=3"],
            "lower=3 must be below upper",
        ),
        (
            ["algorithm.rollout_correction=reject", "algorithm.rollout_correction_params.estimator=k4"],
            "estimator='k4' is not valid",
        ),
        (["algorithm.rollout_correction=token_tis", "algorithm.old_logprobs=rollout"], "folded in"),
        (["algorithm.rollout_correction_params.upper=2"], "rollout_correction is none"),
        (["algorithm.loss=sapo", "algorithm.loss_params.tau_neg=0"], "tau_neg=0"),
    ],
)
def test_config_errors_name_the_setting(overrides: list[str], message: str) -> None:
    from moe_rl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_correction_configured_from_the_command_line() -> None:
    from moe_rl.config import load_config

    cfg = load_config(
        None,
        [
            "algorithm.rollout_correction=reject",
            "algorithm.rollout_correction_params.threshold=1e-3",
            "algorithm.rollout_correction_params.seq_agg=mean",
        ],
    )
    assert cfg.algorithm.rollout_correction_params == {"threshold": 1e-3, "seq_agg": "mean"}


@pytest.mark.parametrize("loss_name", ["gspo", "gspo_token", "gmpo", "gmpo_seqclip"])
def test_a_token_weighted_0_is_left_out_of_a_sequence_level_ratio(loss_name: str) -> None:
    """IcePop's masked token gets no gradient from a sequence-level loss, and its log-ratio
    does not set the sequence's ratio or clip: the loss is the same whatever it is."""
    gen = torch.Generator().manual_seed(5)
    logp = (-torch.rand(2, 5, generator=gen, dtype=torch.float64)).requires_grad_()
    old = logp.detach() + 0.01 * torch.randn(2, 5, generator=gen, dtype=torch.float64)
    adv, mask = torch.tensor([1.0, -0.5], dtype=torch.float64), torch.ones(2, 5, dtype=torch.float64)
    weights = torch.ones_like(mask)
    weights[0, 2] = 0.0  # as IcePop weights a token whose train/rollout ratio is out of its band
    counts = {"agg": "seq-mean-token-mean", "num_tokens": 10, "num_seqs": 2}
    losses = []
    for masked_log_ratio in (-3.0, 2.0):
        old[0, 2] = logp[0, 2].detach() - masked_log_ratio
        losses.append(policy_loss(loss_name, logp, old, adv, mask, token_weights=weights, **counts)[0])
    (grad,) = torch.autograd.grad(losses[0], logp)
    assert grad[0, 2] == 0 and grad[0].abs().sum() > 0
    assert losses[0].item() == losses[1].item()
