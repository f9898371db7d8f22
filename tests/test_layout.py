"""Parallel layout validation: one clear message naming the bad value."""

from __future__ import annotations

import pytest

from parallel.layout import LayoutError, ModelDims, ParallelLayout

MODEL = ModelDims(num_layers=4, num_attention_heads=8, num_query_groups=4, num_experts=8, vocab_size=64, ffn_hidden_size=32)


@pytest.mark.parametrize(
    "layout, world, message",
    [
        (ParallelLayout(tp=2, pp=2), 6, "world size 6 is not divisible by tp\\*pp = 2\\*2 = 4"),
        (ParallelLayout(ep=4, etp=2), 4, "not divisible by ep\\*etp = 4\\*2 = 8"),
        (ParallelLayout(ep=3), 3, "model.num_experts=8 is not divisible by parallel.ep=3"),
        (ParallelLayout(pp=3), 3, "model.num_layers=4 is not divisible by parallel.pp=3"),
        (ParallelLayout(tp=8), 8, "model.num_query_groups \\(key/value heads\\)=4 is not divisible by parallel.tp=8"),
        (ParallelLayout(tp=0), 1, "parallel.tp=0 must be a positive integer"),
        (ParallelLayout(sequence_parallel=True), 1, "sequence_parallel=True needs tp > 1"),
        (ParallelLayout(tp=2, sequence_parallel=False), 2, "MoE needs it on"),
    ],
)
def test_bad_layouts(layout: ParallelLayout, world: int, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        layout.validate(world, MODEL)


def test_good_layouts_and_derived_sizes() -> None:
    layout = ParallelLayout(tp=2, pp=2, ep=4, etp=1)
    layout.validate(16, MODEL)
    assert layout.dp(16) == 4 and layout.expert_dp(16) == 2 and layout.use_sequence_parallel
    assert ParallelLayout(tp=2).expert_tp == 2 and not ParallelLayout().use_sequence_parallel
    dense = ModelDims(num_layers=2, num_attention_heads=4, num_query_groups=4, num_experts=None, vocab_size=8)
    with pytest.raises(LayoutError, match="has no experts"):
        ParallelLayout(ep=2).validate(2, dense)
