"""The built-in default model: a tiny random Qwen3-MoE (or any of
``DEMO_ARCHITECTURES``) with the demo tokenizer, given a short supervised warm start on
generated solutions so that RL has a policy to improve, and cached (keyed by the settings
that shape it). It is handed only those settings (:class:`DemoModelSettings`) and the
layout the warm start runs under."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

import torch

from moe_rl.data.tasks import ArithmeticTask
from moe_rl.data.tokenizer import REVISION as TOKENIZER_REVISION
from moe_rl.data.tokenizer import demo_tokenizer, vocab_size
from moe_rl.models.settings import DemoModelSettings, ModelConfig
from moe_rl.models.tiny import save_tiny_checkpoint, tiny_config
from parallel.collectives import barrier, broadcast_object, data_parallel_share, is_first_rank
from parallel.layout import ParallelLayout


def demo_model_dir(demo: DemoModelSettings) -> Path:
    """Where the built-in model of ``demo`` is cached, under a key of the settings that
    shape it (unchanged since models were first cached)."""
    # not the parallel layout: every layout trains the same model (the warm start itself runs
    # under whichever layout asks first; layouts differ only by float error)
    key = json.dumps(
        {
            "model": demo.model.__dict__,
            "max_operand": demo.max_operand,
            # (only when set: the models cached before it existed keep their keys)
            **({"held_out": demo.held_out} if demo.held_out else {}),
            "warm": demo.warm_start.__dict__,
            "tokenizer": TOKENIZER_REVISION,
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return Path(os.path.expanduser(demo.warm_start.cache_dir)) / f"demo-{demo.model.architecture}-{digest}"


def demo_model_dims(model: ModelConfig):
    """The built-in model's sizes, to validate a parallel layout before anything runs."""
    from moe_rl.models.architectures import model_dims

    return model_dims(tiny_config(model.architecture, **_demo_settings(model)))


def _demo_settings(m: ModelConfig) -> dict:
    """The HF config settings of the built-in model (its family's on top of the common ones)."""
    common = dict(
        vocab_size=vocab_size(),
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=m.top_k,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
        max_position_embeddings=256,
    )
    return {**common, **_family_settings(m)}


def _family_settings(m: ModelConfig) -> dict:
    """The HF config settings of the built-in model's family (every layer MoE, one
    shared expert of the experts' size where the family has them, ungrouped routing)."""
    h, e = m.hidden_size, m.num_experts
    families: dict[str, dict] = {
        "qwen3_moe": dict(
            num_experts=e, moe_intermediate_size=h, intermediate_size=2 * h, head_dim=h // 4, norm_topk_prob=True
        ),
        "mixtral": dict(num_local_experts=e, intermediate_size=h),
        "qwen2_moe": dict(
            num_experts=e,
            moe_intermediate_size=h,
            intermediate_size=2 * h,
            shared_expert_intermediate_size=h,
            norm_topk_prob=True,
        ),
        "olmoe": dict(num_experts=e, intermediate_size=h, norm_topk_prob=True),
        "glm4_moe": dict(
            n_routed_experts=e,
            moe_intermediate_size=h,
            intermediate_size=2 * h,
            n_shared_experts=1,
            first_k_dense_replace=0,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            norm_topk_prob=True,
            head_dim=h // 4,
            partial_rotary_factor=0.5,
            use_qk_norm=True,
            attention_bias=True,
        ),
        "deepseek_v3": dict(
            n_routed_experts=e,
            moe_intermediate_size=h,
            intermediate_size=2 * h,
            n_shared_experts=1,
            first_k_dense_replace=0,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            norm_topk_prob=True,
            num_key_value_heads=4,
            q_lora_rank=h // 2,
            kv_lora_rank=h // 2,
            qk_rope_head_dim=max(2, h // 8),
            qk_nope_head_dim=h // 4,
            v_head_dim=h // 4,
        ),
    }
    return families[m.architecture]


# The built-in model's first weights, whatever the run's train.seed: it stands for a pretrained
# checkpoint, and its cache key has no seed (a run with another seed reused whichever model was
# cached first). 1, train.seed's default, keeps every model cached so far.
FIRST_WEIGHTS_SEED = 1


def _raw_checkpoint(demo: DemoModelSettings, path: Path) -> None:
    save_tiny_checkpoint(path, demo.model.architecture, seed=FIRST_WEIGHTS_SEED, **_demo_settings(demo.model))
    demo_tokenizer().save_pretrained(path)


def ensure_demo_model(
    demo: DemoModelSettings, layout: ParallelLayout, use_distributed_optimizer: bool | None = None
) -> Path:
    """The warm-started demo model directory (collective: every rank calls it; a missing
    one is warm-started under ``layout``, with the distributed optimizer as
    ``use_distributed_optimizer`` says). The directory appears complete (weights, config,
    tokenizer) in one rename; concurrent first runs queue on a lock file, and the first
    rank's view decides for the whole job."""
    target = demo_model_dir(demo)
    with _creation_lock(target) if is_first_rank() else contextlib.nullcontext():
        if broadcast_object((target / "config.json").is_file() if is_first_rank() else None):
            return target
        raw = target.with_name(target.name + ".raw")
        if is_first_rank():
            shutil.rmtree(raw, ignore_errors=True)
            raw.parent.mkdir(parents=True, exist_ok=True)
            _raw_checkpoint(demo, raw)
        barrier()
        _supervised_warm_start(demo, layout, use_distributed_optimizer, raw, target)
        if is_first_rank():
            shutil.rmtree(raw, ignore_errors=True)
        barrier()
    return target


@contextlib.contextmanager
def _creation_lock(target: Path) -> Iterator[None]:
    import fcntl

    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _supervised_warm_start(
    demo: DemoModelSettings, layout: ParallelLayout, use_distributed_optimizer: bool | None, raw: Path, target: Path
) -> None:
    from moe_rl.models.architectures import load_hf_config
    from moe_rl.models.builder import build_model, make_transformer_config
    from moe_rl.models.forward import MicroBatch, run_microbatches
    from moe_rl.models.hf_weights import export_hf_weights, load_hf_weights
    from parallel.optim import OptimSettings, build_optimizer, train_step, wrap_ddp

    hf_config = load_hf_config(str(raw))
    config = make_transformer_config(hf_config, layout)
    model = build_model(hf_config, config)
    load_hf_weights(model, hf_config, raw)
    settings = OptimSettings(lr=demo.warm_start.lr, use_distributed_optimizer=use_distributed_optimizer)
    ddp = wrap_ddp(model, config, settings)
    optimizer = build_optimizer([ddp], settings)
    tokenizer = demo_tokenizer()
    task = ArithmeticTask(demo.max_operand, demo.held_out)  # never the held-out problems
    multiple = layout.seq_len_multiple
    for step in range(demo.warm_start.steps):
        problems = task.problems(seed=424242, step=step, count=demo.warm_start.batch_size)
        seqs, masks = [], []
        for pr in problems:
            prompt = tokenizer(pr.prompt)["input_ids"]
            answer = tokenizer(task.solution(pr))["input_ids"] + [tokenizer.eos_token_id]
            seqs.append(prompt + answer)
            masks.append((len(prompt), len(answer)))
        s = -(-max(map(len, seqs)) // multiple) * multiple
        ids = torch.zeros(len(seqs), s, dtype=torch.long)
        mask = torch.zeros(len(seqs), s - 1)
        for i, (seq, (p, a)) in enumerate(zip(seqs, masks)):
            ids[i, : len(seq)] = torch.tensor(seq)
            mask[i, p - 1 : p - 1 + a] = 1
        total = mask.sum()
        mine, _ = data_parallel_share(len(seqs))
        batches = [MicroBatch(ids[mine])]

        def loss_fn(le, mb, total=total, mask=mask[mine]):
            # the batch is built on CPU, log-probs on the rank's device
            loss = -(le[..., 0] * mask.to(le.device)).sum() / total
            return loss, {"nll": loss.detach()}

        train_step([ddp], optimizer, lambda: run_microbatches([ddp], batches, loss_fn=loss_fn, forward_only=False))
    export_hf_weights(model, hf_config, target, dtype=torch.float32, copy_files_from=raw)  # tokenizer included
