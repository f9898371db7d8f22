"""KL estimators and the entropy term against closed forms."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.algorithms import entropy_bonus, entropy_from_logits, kl_divergence, kl_penalty


def test_kl_estimators_match_formulas() -> None:
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 5, generator=gen, dtype=torch.float64) * 2
    ref = -torch.rand(4, 5, generator=gen, dtype=torch.float64) * 2
    for i, j in [(0, 0), (1, 3), (3, 4)]:
        a, b = logp[i, j].item(), ref[i, j].item()
        assert kl_divergence(logp, ref, "k1")[i, j].item() == pytest.approx(a - b)
        assert kl_divergence(logp, ref, "k2")[i, j].item() == pytest.approx(0.5 * (a - b) ** 2)
        assert kl_divergence(logp, ref, "k3")[i, j].item() == pytest.approx(math.exp(b - a) - (b - a) - 1)
    assert (kl_divergence(logp, ref, "k3") >= 0).all()
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_divergence(logp, ref, "k4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k3_keeps_its_digits_near_the_reference(dtype) -> None:
    """Policy and reference within 1e-2..1e-5 nats (a run's start): k3 against float64's
    ``exp(d) - d - 1`` of the same inputs, never negative, and k1/k2 in at least fp32."""
    gen = torch.Generator().manual_seed(1)
    for spread in (1e-2, 1e-3, 1e-4, 1e-5):
        logp = (-torch.rand(64, generator=gen) * 2).to(dtype)
        ref = (logp.double() + spread * torch.randn(64, generator=gen, dtype=torch.float64)).to(dtype)
        d = ref.double() - logp.double()
        exact = torch.expm1(d) - d
        k3 = kl_divergence(logp, ref, "k3")
        assert k3.dtype == torch.float32 and (k3 >= 0).all()
        # within 2 fp32 roundings of d (exp(d) - 1 - d: of 1, 1.2e-7 absolute: all of it at 1e-4)
        assert ((k3.double() - exact).abs() <= 2.5e-7 * d.abs()).all(), spread
        torch.testing.assert_close(kl_divergence(logp, ref, "k1").double(), -d)
        assert kl_divergence(logp, ref, "k2").dtype == torch.float32


def test_k3_is_unbiased_for_true_kl_on_samples() -> None:
    # KL(p || q) for two categoricals, estimated by k1 and k3 from samples of p
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    true_kl = (p * (p / q).log()).sum().item()
    idx = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(1))
    logp, logq = p.log()[idx][None], q.log()[idx][None]
    mask = torch.ones_like(logp)
    for kind in ("k1", "k3"):
        assert kl_penalty(logp, logq, mask, kind).item() == pytest.approx(true_kl, rel=0.03)


def test_kl_penalty_respects_mask_and_agg() -> None:
    logp = torch.tensor([[0.0, -1.0, -2.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.0, -1.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    assert kl_penalty(logp, ref, mask, "k1").item() == pytest.approx(0.5)
    assert kl_penalty(logp, ref, mask, "k1", agg="seq-mean-token-sum").item() == pytest.approx(1.0)


def test_entropy_matches_categorical() -> None:
    logits = torch.randn(3, 4, 11, generator=torch.Generator().manual_seed(2))
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits), expected)
    mask = torch.tensor([[1, 1, 0, 0]] * 3)
    ent = entropy_from_logits(logits)
    assert entropy_bonus(ent, mask).item() == pytest.approx(ent[:, :2].mean().item(), rel=1e-6)


def test_entropy_of_masked_out_logits_is_that_of_the_rest() -> None:
    """-inf logits (tokens masked out of the vocabulary) carry no mass: the entropy is that
    of the other logits, finite, and so is its gradient."""
    logits = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    masked = torch.cat([logits, torch.full((2, 5, 3), float("-inf"), dtype=torch.float64)], -1).requires_grad_(True)
    ent = entropy_from_logits(masked)
    torch.testing.assert_close(ent, torch.distributions.Categorical(logits=logits).entropy())
    ent.sum().backward()
    assert torch.isfinite(masked.grad).all() and (masked.grad[..., 7:] == 0).all()
