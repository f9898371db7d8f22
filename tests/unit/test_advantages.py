"""Advantage estimators against independent per-group formulas (statistics module)."""

from __future__ import annotations

import statistics

import pytest
import torch

from moe_rl.algorithms import ADVANTAGE_ESTIMATORS, compute_advantages, conditional_reward

EPS = 1e-6


def _groups(values: list[float], g: int) -> list[list[float]]:
    return [values[i : i + g] for i in range(0, len(values), g)]


def ref_grpo(values: list[float], g: int, scale: bool = True) -> list[float]:
    out = []
    for grp in _groups(values, g):
        mu = statistics.fmean(grp)
        sd = statistics.stdev(grp) if len(grp) > 1 else 0.0
        for x in grp:
            if max(grp) == min(grp):
                out.append(0.0)
            else:
                out.append((x - mu) / (sd + EPS) if scale else x - mu)
    return out


def ref_rloo(values: list[float], g: int) -> list[float]:
    out = []
    for grp in _groups(values, g):
        for i, x in enumerate(grp):
            others = grp[:i] + grp[i + 1 :]
            out.append(x - statistics.fmean(others) if others else 0.0)
    return out


def ref_gdpo(rows: list[list[float]], g: int, weights: list[float]) -> list[float]:
    n = len(rows[0])
    cols = [ref_grpo([r[k] for r in rows], g) for k in range(n)]
    summed = [sum(w * cols[k][i] for k, w in enumerate(weights)) for i in range(len(rows))]
    if max(summed) == min(summed):
        return [0.0] * len(summed)
    mu, sd = statistics.fmean(summed), statistics.stdev(summed)
    return [(s - mu) / (sd + EPS) for s in summed]


@pytest.mark.parametrize("group_size", [2, 4, 8])
def test_grpo_dr_grpo_rloo_match_reference(group_size: int) -> None:
    gen = torch.Generator().manual_seed(group_size)
    r = torch.randn(6 * group_size, generator=gen, dtype=torch.float64)
    values = r.tolist()
    for name, ref in (
        ("grpo", ref_grpo(values, group_size)),
        ("dr_grpo", ref_grpo(values, group_size, scale=False)),
        ("rloo", ref_rloo(values, group_size)),
    ):
        got = compute_advantages(name, r, group_size)
        assert got.shape == (r.shape[0],)
        torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float64), rtol=1e-10, atol=1e-10)


def test_weighted_reward_columns_are_summed_for_grpo() -> None:
    gen = torch.Generator().manual_seed(1)
    r = torch.randint(0, 2, (16, 3), generator=gen).double()
    w = [1.0, 0.5, -2.0]
    summed = (r * torch.tensor(w, dtype=torch.float64)).sum(1).tolist()
    got = compute_advantages("grpo", r, 4, weights=w)
    torch.testing.assert_close(got, torch.tensor(ref_grpo(summed, 4), dtype=torch.float64))


@pytest.mark.parametrize("group_size", [2, 4])
def test_gdpo_matches_reference(group_size: int) -> None:
    gen = torch.Generator().manual_seed(7)
    r = torch.randint(0, 3, (5 * group_size, 3), generator=gen).double()
    w = [1.0, 0.3, 2.0]
    got = compute_advantages("gdpo", r, group_size, weights=w)
    torch.testing.assert_close(got, torch.tensor(ref_gdpo(r.tolist(), group_size, w), dtype=torch.float64))


def test_gdpo_separates_what_grpo_collapses() -> None:
    # GDPO's motivating example: two binary rewards, G=2; summed rewards (0,1) and (0,2).
    r = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    grpo = compute_advantages("grpo", r, 2)
    gdpo = compute_advantages("gdpo", r, 2)
    torch.testing.assert_close(grpo[:2], grpo[2:])  # GRPO: identical advantages
    assert grpo[1] > 0
    assert gdpo[3] > gdpo[1] > 0 > gdpo[0] > gdpo[2]  # GDPO keeps the (0,2) group apart
    assert len(set(gdpo.tolist())) == 4


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_constant_groups_give_exact_zero(name: str) -> None:
    r = torch.tensor([[0.1, 2.0]] * 4 + [[0.3, 1.0]] * 4)
    a = compute_advantages(name, r, 4)
    assert torch.equal(a, torch.zeros(8))
    one = compute_advantages(name, torch.tensor([1.0, 2.0, 3.0]), 1)
    assert torch.equal(one, torch.zeros(3))  # groups of one sample: nothing to compare


def test_gdpo_constant_column_contributes_zero() -> None:
    r = torch.tensor([[0.0, 5.0], [1.0, 5.0], [1.0, 5.0], [0.0, 5.0]])
    torch.testing.assert_close(compute_advantages("gdpo", r, 2), compute_advantages("gdpo", r[:, :1], 2))


def test_integer_rewards_and_1d_input() -> None:
    a = compute_advantages("grpo", torch.tensor([0, 1, 1, 1]), 2)
    assert a.dtype == torch.float32 and a[0] < 0 < a[1] and a[2] == a[3] == 0


def masked_reference(name: str, values: torch.Tensor, g: int, weights: list[float], valid: list[bool]) -> torch.Tensor:
    """The advantages over the valid samples from the statistics-module formulas above: each
    group's valid samples a group of their own (GRPO / Dr.GRPO / RLOO on the weight-summed
    rewards; GDPO's columns per group, weight-summed, then normalised over every valid
    sample); 0 for the invalid ones."""
    rows = values.double().tolist()
    out = [0.0] * len(rows)
    groups = [[i for i in range(start, start + g) if valid[i]] for start in range(0, len(rows), g)]
    groups = [kept for kept in groups if kept]
    summed: dict[int, float] = {}
    for kept in groups:
        if name == "gdpo":
            columns = [ref_grpo([rows[i][k] for i in kept], len(kept)) for k in range(len(weights))]
            for j, i in enumerate(kept):
                summed[i] = sum(w * columns[k][j] for k, w in enumerate(weights))
            continue
        rewards = [sum(w * x for w, x in zip(weights, rows[i])) for i in kept]
        ref = ref_rloo(rewards, len(kept)) if name == "rloo" else ref_grpo(rewards, len(kept), scale=name == "grpo")
        for i, a in zip(kept, ref):
            out[i] = a
    if name == "gdpo" and len(summed) > 1 and max(summed.values()) != min(summed.values()):
        mu, sd = statistics.fmean(summed.values()), statistics.stdev(summed.values())
        for i, x in summed.items():
            out[i] = (x - mu) / (sd + EPS)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "gdpo"])
def test_advantages_over_a_validity_mask_equal_the_per_group_formula(name: str) -> None:
    """Groups of 4 left with 0, 1, 3 (G - f), 2 and 4 valid samples; the invalid ones get 0."""
    values = torch.rand(20, 2, generator=torch.Generator().manual_seed(59), dtype=torch.float64)
    valid = (
        [False] * 4 + [False, True, False, False] + [True, False, True, True] + [True, True, False, False] + [True] * 4
    )
    got = compute_advantages(name, values, 4, weights=[1.0, 0.5], valid=valid)
    torch.testing.assert_close(got, masked_reference(name, values, 4, [1.0, 0.5], valid), rtol=1e-10, atol=1e-10)
    assert got[[i for i, v in enumerate(valid) if not v]].eq(0).all()
    if name != "gdpo":  # a group of one compares with nothing (GDPO's batch normalisation then shifts it)
        assert got[5] == 0
    assert torch.equal(compute_advantages(name, values, 4, valid=[True] * 20), compute_advantages(name, values, 4))
    none = compute_advantages(name, values, 4, valid=[False] * 20)
    assert torch.equal(none, torch.zeros(20, dtype=torch.float64))


def test_bf16_rewards_get_fp32_group_statistics() -> None:
    """bf16 rewards (a library caller's) are promoted: the advantages are those of the same
    values in fp32, not of bf16 group means and deviations."""
    rewards = (torch.rand(64, generator=torch.Generator().manual_seed(3)) * 300).to(torch.bfloat16)
    got = compute_advantages("grpo", rewards, 8)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, compute_advantages("grpo", rewards.float(), 8))


def test_gdpo_over_a_mask_with_one_valid_sample_or_equal_sums_is_zero() -> None:
    values = torch.tensor([[1.0], [0.0], [0.5], [0.5]])
    assert torch.equal(compute_advantages("gdpo", values, 2, valid=[True, False, False, False]), torch.zeros(4))
    assert torch.equal(compute_advantages("gdpo", values, 2, valid=[False, False, True, True]), torch.zeros(4))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(name="nope", rewards=torch.zeros(4), group_size=2), "unknown advantage estimator"),
        (dict(name="grpo", rewards=torch.zeros(5), group_size=2), "whole number of groups"),
        (dict(name="grpo", rewards=torch.zeros(4), group_size=0), "group_size"),
        (dict(name="grpo", rewards=torch.tensor([1.0, float("nan")]), group_size=2), "NaN"),
        (dict(name="gdpo", rewards=torch.zeros(4, 2), group_size=2, weights=[1.0]), "weights"),
        (dict(name="grpo", rewards=torch.zeros(0), group_size=2), "B > 0"),
        (dict(name="grpo", rewards=torch.zeros(4), group_size=2, valid=[True] * 3), "3 validity flags for 4"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs: dict, message: str) -> None:
    name = kwargs.pop("name")
    rewards = kwargs.pop("rewards")
    group_size = kwargs.pop("group_size")
    with pytest.raises(ValueError, match=message):
        compute_advantages(name, rewards, group_size, **kwargs)


def test_conditional_reward() -> None:
    r = torch.tensor([[1.0, 0.7], [0.0, 0.9], [0.5, 0.2]])
    out = conditional_reward(r, target=1, condition=0, threshold=0.5)
    assert torch.equal(out, torch.tensor([[1.0, 0.7], [0.0, 0.0], [0.5, 0.2]]))
    assert torch.equal(r[1], torch.tensor([0.0, 0.9]))  # input untouched
    with pytest.raises(ValueError, match="out of range"):
        conditional_reward(r, target=2, condition=0, threshold=0.5)
