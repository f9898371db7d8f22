"""Parallel layout validation: one clear message naming the bad value."""

from __future__ import annotations

import pytest

from parallel.layout import LayoutError, ModelDims, ParallelLayout

MODEL = ModelDims(
    num_layers=4, num_attention_heads=8, num_query_groups=4, num_experts=8, vocab_size=64, ffn_hidden_size=32
)


@pytest.mark.parametrize(
    "layout, world, message",
    [
        (ParallelLayout(tp=2, pp=2), 6, "world size 6 is not divisible by tp\\*pp = 2\\*2 = 4"),
        (ParallelLayout(ep=4, etp=2), 4, "not divisible by ep\\*etp = 4\\*2 = 8"),
        (ParallelLayout(ep=3), 3, "model.num_experts=8 is not divisible by parallel.ep=3"),
        (ParallelLayout(pp=8), 8, "model.num_layers=4 is fewer than parallel.pp=8 pipeline stages"),
        (
            ParallelLayout(pp=3, first_stage_layers=1),
            3,
            "first_stage_layers=1 leave 3 of model.num_layers=4 layers for the other 2 pipeline",
        ),
        (
            ParallelLayout(pp=2, first_stage_layers=1, last_stage_layers=2),
            2,
            "add up to 3 on pp=2, but model.num_layers=4",
        ),
        (ParallelLayout(last_stage_layers=4), 1, "need parallel.pp > 1"),
        (ParallelLayout(pp=2, first_stage_layers=0), 2, "parallel.first_stage_layers=0 must be a positive integer"),
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


@pytest.mark.parametrize(
    "layers, layout, stages",
    [
        (4, ParallelLayout(pp=2), (2, 2)),  # divides: megatron's even split
        (3, ParallelLayout(pp=2), (2, 1)),  # a dense first layer + 2 MoE layers
        (61, ParallelLayout(pp=8), (7, 8, 8, 8, 8, 8, 8, 6)),  # DeepSeek-V3 / Kimi-K2
        (61, ParallelLayout(pp=4), (15, 16, 16, 14)),
        (92, ParallelLayout(pp=8), (10, 12, 12, 12, 12, 12, 12, 10)),  # GLM-4.5
        (29, ParallelLayout(pp=16), (8, *[1] * 14, 7)),  # middle stages of 2 would leave an end empty
        (10, ParallelLayout(pp=4, first_stage_layers=1), (1, 3, 3, 3)),  # set: the others share the rest
        (10, ParallelLayout(pp=4, first_stage_layers=2, last_stage_layers=4), (2, 2, 2, 4)),
        (3, ParallelLayout(pp=2, last_stage_layers=2), (1, 2)),
    ],
)
def test_stage_layers_are_megatrons_own_split(layers: int, layout: ParallelLayout, stages: tuple[int, ...]) -> None:
    """The split chosen (by hand above) is the one megatron-core builds from the config we
    give it: each stage's layer count and offset as megatron computes them per pipeline rank."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from moe_rl.models.builder import make_transformer_config
    from moe_rl.models.tiny import tiny_config

    assert layout.stage_layers(layers) == stages
    layout.validate(layout.pp, ModelDims(layers, 4, 2, 8, 64))
    config = make_transformer_config(tiny_config("mixtral", num_hidden_layers=layers), layout)
    assert tuple(get_num_layers_to_build(config, pp_rank=r) for r in range(layout.pp)) == stages
    assert [get_transformer_layer_offset(config, pp_rank=r) for r in range(layout.pp)] == [
        sum(stages[:r]) for r in range(layout.pp)
    ]


def test_commands_take_the_stage_layers() -> None:
    """parity / export / drift --engine: --first-stage-layers and --last-stage-layers reach the layout."""
    import argparse

    from moe_rl.commands._distributed import add_layout_args, layout_from

    parser = argparse.ArgumentParser()
    add_layout_args(parser)
    assert layout_from(parser.parse_args(["--pp", "3", "--last-stage-layers", "1"])).stage_layers(7) == (3, 3, 1)
    assert layout_from(parser.parse_args(["--pp", "2"])).stage_layers(3) == (2, 1)
