"""Policy losses against independent per-token / per-sequence formulas, values and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.algorithms import AGG_MODES, POLICY_LOSSES, loss_defaults, policy_loss

B, T = 6, 9


def make_batch(seed: int = 0, scale: float = 0.3, per_token_adv: bool = False):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    logp = (old + scale * torch.randn(B, T, generator=gen, dtype=torch.float64)).requires_grad_(True)
    lengths = torch.tensor([9, 5, 1, 7, 3, 8])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    if per_token_adv:
        adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    else:
        adv = torch.tensor([1.2, -0.7, 0.4, -1.5, 0.9, -0.2], dtype=torch.float64)
    return logp, old, adv, mask


def grad_of(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, x)
    return g


def seq_reduce(per_token_vals, mask, agg):
    """Independent loop implementation of the three aggregation modes."""
    total, count = 0.0, 0
    n_tok = sum(int(mask[i].sum()) for i in range(mask.shape[0]))
    for i in range(mask.shape[0]):
        toks = [per_token_vals[i][t] for t in range(mask.shape[1]) if mask[i, t] > 0]
        if not toks:
            continue
        count += 1
        if agg == "token-mean":
            total += sum(toks) / n_tok
        elif agg == "seq-mean-token-mean":
            total += sum(toks) / len(toks)
        else:
            total += sum(toks)
    return total if agg == "token-mean" else total / count


# ------------------------------------------------------------------ GRPO / DAPO


def ref_grpo_token(lp, ol, a, eps_low, eps_high, dual_clip=None):
    rho = math.exp(lp - ol)
    val = max(-a * rho, -a * min(max(rho, 1 - eps_low), 1 + eps_high))
    if dual_clip is not None and a < 0:
        val = min(val, -a * dual_clip)
    return val


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("eps_low, eps_high, dual_clip", [(0.2, 0.2, None), (0.2, 0.28, None), (0.2, 0.28, 3.0)])
def test_grpo_value_matches_reference(agg, eps_low, eps_high, dual_clip) -> None:
    logp, old, adv, mask = make_batch(seed=1, scale=0.5)
    loss, _ = policy_loss(
        "grpo", logp, old, adv, mask, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip, agg=agg
    )
    vals = [
        [
            ref_grpo_token(logp[i, t].item(), old[i, t].item(), adv[i].item(), eps_low, eps_high, dual_clip)
            for t in range(T)
        ]
        for i in range(B)
    ]
    assert loss.item() == pytest.approx(seq_reduce(vals, mask, agg), rel=1e-12, abs=1e-12)


def test_grpo_gradient_weight_is_rho_on_unclipped_tokens() -> None:
    logp, old, adv, mask = make_batch(seed=2, scale=0.4)
    loss, metrics = policy_loss("grpo", logp, old, adv, mask)
    g = grad_of(loss, logp)
    rho = torch.exp(logp.detach() - old)
    a = adv[:, None].expand_as(rho)
    clipped = ((a > 0) & (rho > 1.2)) | ((a < 0) & (rho < 0.8))
    expected = torch.where(clipped, 0.0, -a * rho) * mask / mask.sum()
    torch.testing.assert_close(g, expected, rtol=1e-12, atol=1e-14)
    assert clipped[mask.bool()].any() and (~clipped[mask.bool()]).any()
    frac = (clipped.double() * mask).sum() / mask.sum()
    assert metrics["clip_frac"].item() == pytest.approx(frac.item())


def test_dapo_clip_higher_and_dual_clip() -> None:
    one = torch.ones(1, 1, dtype=torch.float64)
    lp = torch.log(torch.tensor([[1.25]], dtype=torch.float64)).requires_grad_(True)
    zero = torch.zeros(1, 1, dtype=torch.float64)
    pos = torch.tensor([1.0], dtype=torch.float64)
    # ratio 1.25, A > 0: clipped at 1.2 by GRPO, not by DAPO's 1.28
    grpo, m1 = policy_loss("grpo", lp, zero, pos, one)
    dapo, m2 = policy_loss("grpo", lp, zero, pos, one, eps_high=0.28)
    assert grpo.item() == pytest.approx(-1.2) and m1["clip_frac"] == 1
    assert dapo.item() == pytest.approx(-1.25) and m2["clip_frac"] == 0
    # ratio 5, A < 0: PPO loss 5, dual clip caps it at 3 and stops the gradient
    lp5 = torch.log(torch.tensor([[5.0]], dtype=torch.float64)).requires_grad_(True)
    neg = torch.tensor([-1.0], dtype=torch.float64)
    plain, _ = policy_loss("grpo", lp5, zero, neg, one)
    dual, m3 = policy_loss("grpo", lp5, zero, neg, one, dual_clip=3.0)
    assert plain.item() == pytest.approx(5.0) and dual.item() == pytest.approx(3.0)
    assert grad_of(dual, lp5).item() == 0.0 and m3["dual_clip_frac"] == 1


# ------------------------------------------------------------------ GSPO family


def ref_gspo_per_seq(logp, old, adv, mask, eps_low, eps_high):
    out = []
    for i in range(B):
        toks = [t for t in range(T) if mask[i, t] > 0]
        s = math.exp(sum(logp[i, t].item() - old[i, t].item() for t in toks) / len(toks))
        a = adv[i].item()
        out.append(max(-a * s, -a * min(max(s, 1 - eps_low), 1 + eps_high)))
    return out


@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.05, 0.05)])
def test_gspo_value_matches_reference(eps) -> None:
    logp, old, adv, mask = make_batch(seed=3, scale=0.05)
    loss, metrics = policy_loss("gspo", logp, old, adv, mask, eps_low=eps[0], eps_high=eps[1])
    ref = ref_gspo_per_seq(logp, old, adv, mask, *eps)
    assert loss.item() == pytest.approx(sum(ref) / B, rel=1e-12)
    seq_ratio = [math.exp(((logp[i] - old[i]) * mask[i]).sum().item() / mask[i].sum().item()) for i in range(B)]
    assert metrics["ratio_max"].item() == pytest.approx(max(seq_ratio))
    assert metrics["ratio_min"].item() == pytest.approx(min(seq_ratio))


def test_gspo_gradient_weights_tokens_equally_within_a_sequence() -> None:
    logp, old, adv, mask = make_batch(seed=4, scale=1e-5)  # ratios ~1: nothing clipped
    g = grad_of(policy_loss("gspo", logp, old, adv, mask)[0], logp)
    s = torch.exp(((logp.detach() - old) * mask).sum(1) / mask.sum(1))
    expected = (-adv * s / mask.sum(1) / B)[:, None] * mask
    torch.testing.assert_close(g, expected, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("scale", [1e-5, 0.05])
def test_gspo_token_equals_gspo_for_sequence_advantages(agg, scale) -> None:
    logp, old, adv, mask = make_batch(seed=5, scale=scale)
    l1, _ = policy_loss("gspo", logp, old, adv, mask, agg=agg)
    l2, _ = policy_loss("gspo_token", logp, old, adv, mask, agg=agg)
    assert l1.item() == pytest.approx(l2.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grad_of(l1, logp), grad_of(l2, logp), rtol=1e-10, atol=1e-15)
    # also with [B, T] advantages that are constant per sequence
    l3, _ = policy_loss("gspo_token", logp, old, adv[:, None].expand(B, T), mask, agg=agg)
    assert l3.item() == pytest.approx(l1.item(), rel=1e-12, abs=1e-15)


def test_gspo_token_accepts_token_advantages_and_gspo_refuses_them() -> None:
    logp, old, adv, mask = make_batch(seed=6, scale=1e-5, per_token_adv=True)
    loss, _ = policy_loss("gspo_token", logp, old, adv, mask)
    s = torch.exp(((logp.detach() - old) * mask).sum(1) / mask.sum(1))
    expected = (-(adv * s[:, None]) * mask).sum(1) / mask.sum(1)
    assert loss.item() == pytest.approx(expected.mean().item(), rel=1e-10)
    with pytest.raises(ValueError, match="one advantage per sequence"):
        policy_loss("gspo", logp, old, adv, mask)


# ------------------------------------------------------------------ GMPO


def ref_gmpo_objective(logp, old, adv, mask, d):
    """GMPO's product formula, computed literally (not in log space)."""
    total = 0.0
    for i in range(B):
        a = adv[i].item()
        toks = [t for t in range(T) if mask[i, t] > 0]
        prod = 1.0
        for t in toks:
            rho = math.exp(logp[i, t].item() - old[i, t].item())
            prod *= abs(min(rho * a, min(max(rho, math.exp(-d)), math.exp(d)) * a))
        total += prod ** (1 / len(toks)) * (1 if a > 0 else -1)
    return total / B


@pytest.mark.parametrize("d", [0.4, 0.1])
def test_gmpo_value_matches_product_formula(d) -> None:
    logp, old, adv, mask = make_batch(seed=7, scale=0.3)
    loss, metrics = policy_loss("gmpo", logp, old, adv, mask, log_clip=d)
    assert loss.item() == pytest.approx(-ref_gmpo_objective(logp, old, adv, mask, d), rel=1e-12)
    assert 0 < metrics["clip_frac"].item() < 1


def test_gmpo_token_gradient_weight_is_the_geometric_mean_ratio() -> None:
    logp, old, adv, mask = make_batch(seed=8, scale=0.3)
    d = 0.4
    g = grad_of(policy_loss("gmpo", logp, old, adv, mask, log_clip=d)[0], logp)
    logr = logp.detach() - old
    sign = torch.sign(adv)[:, None]
    clipped_logr = torch.where(sign * logr > d, sign * d, logr)
    geo = torch.exp((clipped_logr * mask).sum(1) / mask.sum(1))  # geometric mean of clipped ratios
    active = (sign * logr <= d).double() * mask
    expected = (-adv * geo / mask.sum(1) / B)[:, None] * active
    torch.testing.assert_close(g, expected, rtol=1e-10, atol=1e-14)
    # unlike GRPO: tokens of one sequence share one weight, whatever their own ratio
    i = 0
    w, own_rho = g[i][active[i].bool()], logr[i][active[i].bool()].exp()
    assert torch.allclose(w, w[0].expand_as(w)) and own_rho.std() > 0.1
    assert ((active == 0) & (mask > 0)).any()  # the clip branch is exercised too


def test_gmpo_seqclip_matches_reference() -> None:
    logp, old, adv, mask = make_batch(seed=9, scale=0.2)
    d = 0.4
    loss, _ = policy_loss("gmpo_seqclip", logp, old, adv, mask, log_clip=d)
    total = 0.0
    for i in range(B):
        a = adv[i].item()
        toks = [t for t in range(T) if mask[i, t] > 0]
        prod = math.exp(sum(logp[i, t].item() - old[i, t].item() for t in toks))
        clipped_product = abs(min(prod * a, min(max(prod, math.exp(-d)), math.exp(d)) * a)) / abs(a)
        total += a * clipped_product ** (1 / len(toks))
    assert loss.item() == pytest.approx(-total / B, rel=1e-12)


def test_cispo_matches_reference() -> None:
    logp, old, adv, mask = make_batch(seed=10, scale=0.4)
    loss, _ = policy_loss("cispo", logp, old, adv, mask, eps_high=0.2)
    rho = torch.exp(logp.detach() - old).clamp(max=1.2)
    expected = (-(rho * adv[:, None] * logp.detach()) * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    torch.testing.assert_close(grad_of(loss, logp), -(rho * adv[:, None]) * mask / mask.sum())


# ------------------------------------------------------------------ all losses


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
@pytest.mark.parametrize("agg", AGG_MODES)
def test_micro_batches_sum_to_full_batch(name, agg) -> None:
    logp, old, adv, mask = make_batch(seed=11, scale=0.2)
    full, _ = policy_loss(name, logp, old, adv, mask, agg=agg)
    g_full = grad_of(full, logp)
    n_tok, n_seq = mask.sum(), (mask.sum(1) > 0).sum()
    parts = [slice(0, 2), slice(2, 3), slice(3, 6)]
    total = sum(
        policy_loss(name, logp[s], old[s], adv[s], mask[s], agg=agg, num_tokens=n_tok, num_seqs=n_seq)[0] for s in parts
    )
    assert total.item() == pytest.approx(full.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grad_of(total, logp), g_full, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_mean_metrics_reduced_over_micro_batches_equal_the_full_batchs(name) -> None:
    """The trainer weighs each micro-batch's mean metrics by its response tokens: for every
    loss (the sequence-level ratios of GSPO and GMPO included) that gives the full batch's."""
    logp, old, adv, mask = make_batch(seed=13, scale=0.2)
    _, full = policy_loss(name, logp, old, adv, mask)
    parts = [policy_loss(name, logp[s], old[s], adv[s], mask[s])[1] for s in (slice(0, 1), slice(1, 4), slice(4, 6))]
    tokens = [float(mask[s].sum()) for s in (slice(0, 1), slice(1, 4), slice(4, 6))]
    for key in ("ratio_mean", "clip_frac", "approx_kl"):
        reduced = sum(float(p[key]) * t for p, t in zip(parts, tokens)) / sum(tokens)
        assert reduced == pytest.approx(float(full[key]), rel=1e-12), key


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_identical_policies_and_metrics(name) -> None:
    logp, _, adv, mask = make_batch(seed=12)
    loss, metrics = policy_loss(name, logp, logp.detach().clone(), adv, mask)
    for key in ("clip_frac", "ratio_mean", "ratio_min", "ratio_max", "approx_kl"):
        assert key in metrics and not metrics[key].requires_grad
    assert metrics["approx_kl"].item() == pytest.approx(0.0, abs=1e-15)
    assert metrics["ratio_mean"].item() == pytest.approx(1.0) and metrics["clip_frac"].item() == 0
    assert torch.isfinite(loss)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_padding_rows_and_extreme_ratios_stay_finite(name) -> None:
    logp, old, adv, mask = make_batch(seed=13)
    mask[2] = 0  # a row with no response tokens
    with torch.no_grad():
        logp[0, 0] += 80.0  # exp(80) overflows float32 without the clamp
    loss, metrics = policy_loss(name, logp.float(), old.float(), adv.float(), mask.float())
    assert torch.isfinite(loss) and all(torch.isfinite(v).all() for v in metrics.values())
    empty, _ = policy_loss(name, logp, old, adv, torch.zeros_like(mask))
    assert empty.item() == 0.0


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_non_finite_log_probs_at_padding_change_no_loss_nor_gradient(name) -> None:
    """-inf / NaN log-probs at padding (a library caller's): every loss's value and
    gradient equal the clean batch's (a ``* mask`` would make NaN of them)."""
    logp, old, adv, mask = make_batch(seed=14, scale=0.2)
    mask[1, 2:] = 0
    dirty_logp, dirty_old = logp.detach().clone(), old.clone()
    dirty_logp[mask == 0], dirty_old[mask == 0] = float("-inf"), float("nan")
    dirty_logp.requires_grad_(True)
    clean, _ = policy_loss(name, logp, old, adv, mask)
    dirty, metrics = policy_loss(name, dirty_logp, dirty_old, adv, mask)
    assert dirty.item() == pytest.approx(clean.item(), rel=1e-12)
    assert all(torch.isfinite(v).all() for v in metrics.values())
    torch.testing.assert_close(grad_of(dirty, dirty_logp), grad_of(clean, logp))


def test_defaults_are_the_documented_ones() -> None:
    assert loss_defaults("grpo") == dict(
        eps_low=0.2, eps_high=0.2, dual_clip=None, agg="token-mean", num_tokens=None, num_seqs=None, token_weights=None
    )
    assert loss_defaults("sapo")["tau_pos"] == 1.0 and loss_defaults("sapo")["tau_neg"] == 1.05
    assert loss_defaults("gspo")["eps_low"] == 3e-4 and loss_defaults("gspo")["eps_high"] == 4e-4
    assert loss_defaults("gspo_token")["eps_high"] == 4e-4
    assert loss_defaults("gmpo")["log_clip"] == 0.4 and loss_defaults("gmpo_seqclip")["log_clip"] == 0.4
    assert {"grpo", "gspo", "gspo_token", "gmpo", "gmpo_seqclip"} <= set(POLICY_LOSSES.names())


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("grpo", dict(eps=0.2), "eps is not a parameter of loss 'grpo'"),
        ("gspo", dict(dual_clip=3.0), "dual_clip is not a parameter of loss 'gspo'"),
        ("grpo", dict(eps_low=1.5), "eps_low"),
        ("grpo", dict(eps_high=-0.1), "eps_high"),
        ("grpo", dict(dual_clip=0.5), "dual_clip"),
        ("gmpo", dict(log_clip=0.0), "log_clip"),
        ("grpo", dict(agg="mean"), "agg='mean' is not valid"),
        ("grpo", dict(eps_low="0.2"), "eps_low='0.2' must be a finite number"),
        ("gmpo", dict(log_clip=float("nan")), "log_clip=nan must be a finite number"),
        ("ppo2", dict(), "unknown policy loss"),
    ],
)
def test_bad_parameters_are_clear_errors(name, params, message) -> None:
    logp, old, adv, mask = make_batch()
    with pytest.raises(ValueError, match=message):
        policy_loss(name, logp, old, adv, mask, **params)


def test_shape_errors() -> None:
    logp, old, adv, mask = make_batch()
    with pytest.raises(ValueError, match="one \\[B, T\\] shape"):
        policy_loss("grpo", logp, old[:, :-1], adv, mask)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss("grpo", logp, old, adv[:-1], mask)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_bf16_inputs_compute_in_fp32(name) -> None:
    """bf16 log-probs (a GPU's) give the loss and gradient of the same values in fp32:
    near 1 bf16 steps by 2^-8, coarser than GSPO's 3e-4 clip band."""
    logp, old, adv, mask = make_batch(seed=13)
    low = logp.detach().to(torch.bfloat16).requires_grad_()
    loss, metrics = policy_loss(name, low, old.to(torch.bfloat16), adv, mask, num_tokens=50, num_seqs=4)
    same = low.detach().float().requires_grad_()
    ref, ref_metrics = policy_loss(name, same, old.to(torch.bfloat16).float(), adv, mask, num_tokens=50, num_seqs=4)
    assert loss.dtype == torch.float32 and loss.item() == ref.item()
    assert metrics["clip_frac"].item() == ref_metrics["clip_frac"].item()
    (grad,) = torch.autograd.grad(loss, low)
    (ref_grad,) = torch.autograd.grad(ref, same)
    assert grad.dtype == torch.bfloat16 and torch.equal(grad, ref_grad.to(torch.bfloat16))


@pytest.mark.parametrize("agg", AGG_MODES)
def test_aggregation_of_bf16_values_counts_in_fp32(agg: str) -> None:
    """bf16 per-token values over 257 tokens: the counts and sums are fp32 (bf16 holds 257
    as 256), so the result is the fp64 formula's on the same values."""
    from moe_rl.algorithms.aggregation import aggregate, masked_mean, sequence_mean

    values = torch.ones(2, 300, dtype=torch.bfloat16)
    values[0, 0] = 2.0
    mask = torch.zeros(2, 300)
    mask[0, :257], mask[1, :100] = 1, 1
    v, m = values.double(), mask.double()
    per_seq = (v * m).sum(-1)
    expected = {
        "token-mean": per_seq.sum() / m.sum(),
        "seq-mean-token-mean": (per_seq / m.sum(-1)).mean(),
        "seq-mean-token-sum": per_seq.mean(),
    }[agg]
    got = aggregate(values, mask, agg)
    assert got.dtype == torch.float32 and got.item() == pytest.approx(expected.item(), rel=1e-6)
    assert masked_mean(values, mask).item() == pytest.approx((per_seq.sum() / m.sum()).item(), rel=1e-6)
    torch.testing.assert_close(sequence_mean(values, mask).double(), per_seq / m.sum(-1))


@pytest.mark.parametrize("agg", AGG_MODES)
def test_non_finite_values_at_padding_are_left_out(agg: str) -> None:
    """A padding position holding -inf or NaN (a library caller's log-probs there) changes
    neither the aggregate nor the gradient of the real tokens."""
    from moe_rl.algorithms.aggregation import aggregate, masked_mean, sequence_mean

    gen = torch.Generator().manual_seed(4)
    clean = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float64)
    dirty = clean.clone()
    dirty[0, 3], dirty[0, 4], dirty[2, 1] = float("-inf"), float("nan"), float("inf")
    for fn in (
        lambda v: aggregate(v, mask, agg),
        lambda v: masked_mean(v, mask),
        lambda v: sequence_mean(v, mask).sum(),
    ):
        a, b = clean.clone().requires_grad_(True), dirty.clone().requires_grad_(True)
        fa, fb = fn(a), fn(b)
        assert fb.item() == pytest.approx(fa.item(), rel=1e-12)
        torch.testing.assert_close(torch.autograd.grad(fb, b)[0], torch.autograd.grad(fa, a)[0])
