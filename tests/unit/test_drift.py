"""Routing-drift metrics against hand-computed examples."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.routing.drift import (
    any_layer_changed_frac,
    changed_frac,
    drift_metrics,
    expert_change_frac,
    expert_load,
    load_cv,
    load_entropy,
    router_kl,
    summarize,
)

# 3 tokens, 2 layers, k = 2
A = torch.tensor([[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[1, 2], [0, 3]]])
B = torch.tensor([[[1, 0], [2, 3]], [[0, 2], [2, 3]], [[3, 0], [1, 2]]])
# token 0: layer0 same set (order differs), layer1 same
# token 1: layer0 {0,1} vs {0,2}: 1 of 2 changed; layer1 same
# token 2: layer0 {1,2} vs {0,3}: both changed; layer1 {0,3} vs {1,2}: both changed


def test_changed_and_expert_change_fractions() -> None:
    torch.testing.assert_close(changed_frac(A, B), torch.tensor([2 / 3, 1 / 3], dtype=torch.float64))
    torch.testing.assert_close(
        expert_change_frac(A, B), torch.tensor([(0 + 0.5 + 1) / 3, (0 + 0 + 1) / 3], dtype=torch.float64)
    )
    assert any_layer_changed_frac(A, B).item() == pytest.approx(2 / 3)


def test_mask_selects_tokens() -> None:
    mask = torch.tensor([1, 1, 0])
    torch.testing.assert_close(changed_frac(A, B, mask), torch.tensor([0.5, 0.0], dtype=torch.float64))
    assert expert_change_frac(A, B, mask)[0].item() == pytest.approx(0.25)
    assert any_layer_changed_frac(A, B, mask).item() == pytest.approx(0.5)


def test_identical_routings_have_zero_drift() -> None:
    probs = torch.softmax(torch.randn(3, 2, 4), -1)
    metrics = drift_metrics(A, A.flip(-1), probs_a=probs, probs_b=probs)
    assert all(float(v.abs().max()) == 0.0 for v in metrics.values())


def test_router_kl() -> None:
    p = torch.tensor([[[0.5, 0.5]], [[0.9, 0.1]]])
    q = torch.tensor([[[0.25, 0.75]], [[0.9, 0.1]]])
    expected = (0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)) / 2
    assert router_kl(p, q).item() == pytest.approx(expected)


def test_expert_load_cv_entropy() -> None:
    load = expert_load(A, num_experts=4)
    torch.testing.assert_close(load, torch.tensor([[2.0, 3.0, 1.0, 0.0], [1.0, 0.0, 2.0, 3.0]], dtype=torch.float64))
    counts = torch.tensor([2.0, 3.0, 1.0, 0.0])
    assert load_cv(load)[0].item() == pytest.approx((counts.std(unbiased=False) / counts.mean()).item())
    p = counts / counts.sum()
    assert load_entropy(load)[0].item() == pytest.approx(-(p[p > 0] * p[p > 0].log()).sum().item())
    even = expert_load(torch.tensor([[[0, 1]], [[2, 3]]]), 4)
    assert load_cv(even).item() == 0.0 and load_entropy(even).item() == pytest.approx(math.log(4))
    masked = expert_load(A, 4, mask=torch.tensor([0, 0, 1]))
    assert masked.sum().item() == 4
    with pytest.raises(ValueError, match="out of range"):
        expert_load(A, num_experts=3)


def test_summary_is_json_ready() -> None:
    s = summarize(drift_metrics(A, B))
    assert s["changed_frac"]["layers"] == pytest.approx([2 / 3, 1 / 3])
    assert s["changed_frac"]["mean"] == pytest.approx(0.5)
    assert s["any_layer_changed_frac"] == {"mean": pytest.approx(2 / 3)}
    with pytest.raises(ValueError, match="\\[T, L, k\\]"):
        changed_frac(A, B[:2])
