"""GroupedExperts: equal to megatron's SequentialMLP on the same weights (log-probs and
every HF-named gradient), with torch's grouped matmul and with its per-expert fallback;
StackedLinear against one matmul per expert, including experts that get no tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import run_check_script
from moe_rl.models.grouped_experts import StackedLinear
from moe_rl.models.tiny import save_tiny_checkpoint


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    hf_dir = save_tiny_checkpoint(tmp_path_factory.mktemp("grouped") / "hf", "qwen3_moe", seed=4)
    return run_check_script("grouped_experts_checks.py", hf_dir)


@pytest.mark.parametrize("variant", ["grouped", "fallback"])
def test_grouped_experts_equal_sequential_mlp(result, variant: str) -> None:
    r = result[variant]
    assert r["logp_max_diff"] < 1e-5
    assert r["grad_max_abs"] > 1e-3 and r["grad_max_diff"] < 1e-5 * max(1.0, r["grad_max_abs"])


def test_the_grouped_matmul_ran_on_cpu(result) -> None:
    assert result["grouped"]["grouped_matmuls"] > 0 and result["fallback"]["grouped_matmuls"] == 0


@pytest.mark.parametrize("grouped", [True, False])
def test_stacked_linear_is_one_matmul_per_expert(grouped: bool) -> None:
    config = SimpleNamespace(use_cpu_initialization=True, params_dtype=torch.float32)
    layer = StackedLinear(4, 8, 12, config, partition_dim=1)
    torch.nn.init.normal_(layer.weight)
    layer.grouped = layer.grouped and grouped
    counts = torch.tensor([3, 0, 5, 2])  # expert 1 gets no rows
    rows = torch.randn(10, 12, requires_grad=True)
    out = layer(rows, counts, counts.cumsum(0).to(torch.int32))
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    starts = [0, 3, 3, 8, 10]
    weight = layer.weight.detach().clone().requires_grad_()
    rows_ref = rows.detach().clone().requires_grad_()
    ref = torch.cat([rows_ref[starts[e] : starts[e + 1]] @ weight[e].T for e in range(4)])
    (ref * upstream).sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(rows.grad, rows_ref.grad)
    torch.testing.assert_close(layer.weight.grad, weight.grad)
    assert layer.weight.grad[1].abs().sum() == 0
