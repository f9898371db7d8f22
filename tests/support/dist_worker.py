"""Multi-process checks of the megatron backend, started N times by ``spawn_local``.

For each layout given, it builds the model from one HF checkpoint and saves, from the
ranks that own them: log-probs of a fixed batch (forward only), full gradients in HF
names of a fixed loss (data split over data-parallel ranks), and the loss over a few
optimizer steps. The pytest side compares them with the single-process run.

    python tests/support/dist_worker.py HF_DIR OUT_DIR tp,pp,ep,etp [tp,pp,ep,etp ...] \
        [--family DIR ...] [--family-layouts tp,pp,ep,etp ...] [--checkpoints DIR]

With ``--checkpoints`` the one- and two-process runs also check the optimizer's checkpoint
formats across data-parallel sizes (:func:`checkpoint_checks`).

Each ``--family`` checkpoint (another MoE architecture) gets, on each of the
``--family-layouts`` among those run, the log-probs and entropies of the fixed batch and
the replay checks of :func:`family_checks`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from moe_rl.models.architectures import load_hf_config, model_dims
from moe_rl.models.builder import build_model, make_transformer_config
from moe_rl.models.forward import MicroBatch, run_microbatches
from moe_rl.models.hf_weights import export_hf_weights, gather_hf_tensors, load_hf_weights
from parallel.distributed import init_distributed
from parallel.layout import ParallelLayout
from parallel.optim import OptimSettings, build_optimizer, train_step, wrap_ddp

SEQ, NUM_SEQS, TRAIN_STEPS = 12, 4, 3


@dataclass(kw_only=True)
class WeightedBatch(MicroBatch):
    w: torch.Tensor  # [b, s-1] per-token loss weights


def fixed_batch(vocab: int) -> list[WeightedBatch]:
    gen = torch.Generator().manual_seed(123)
    ids = torch.randint(0, vocab, (NUM_SEQS, SEQ), generator=gen)
    weights = torch.rand(NUM_SEQS, SEQ - 1, generator=gen)
    return [WeightedBatch(input_ids=ids[i : i + 1], w=weights[i : i + 1]) for i in range(NUM_SEQS)]


def loss_fn(logp_entropy: torch.Tensor, mb: WeightedBatch) -> tuple[torch.Tensor, dict]:
    # log-probs and entropy both carry gradient (the entropy through the vocab-parallel path)
    per_token = logp_entropy[..., 0] * mb.w + 0.1 * logp_entropy[..., 1]
    loss = -per_token.sum() / (NUM_SEQS * (SEQ - 1))
    return loss, {"loss": loss.detach()}


def r3_maxdiff(hf_dir: str, model, replay, batches: list[MicroBatch], plain: list[dict]) -> float:
    """R3 with transformers' own routing of ``batches`` (in SGLang's layout): the largest
    log-prob difference from megatron's unreplayed pass ``plain``."""
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from moe_rl.models.architectures import architecture_of
    from moe_rl.routing.hf_routing import transformers_routing
    from moe_rl.routing.replay import engine_routing_to_replay

    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, local_files_only=True).eval()
    per_mb = []
    for mb in batches:
        indices, _ = transformers_routing(hf_model, mb.input_ids)
        seqs = [indices[j, :-1] for j in range(indices.shape[0])]  # SGLang: length - 1 positions
        per_mb.append(
            engine_routing_to_replay(
                seqs,
                mb.input_ids.shape[1],
                replay.layer_numbers,
                replay.top_k,
                num_experts=architecture_of(hf_model.config).num_experts(hf_model.config),
                tp_rank=ps.get_tensor_model_parallel_rank(),
                tp_size=ps.get_tensor_model_parallel_world_size(),
                sequence_parallel=model.config.sequence_parallel,
            )
        )
    replay.start_replay(per_mb, forward_only=True)
    r3 = run_microbatches(model, batches, hooks=[replay])
    replay.finish()
    return max(((a["logprobs"] - b["logprobs"]).abs().max().item() for a, b in zip(plain, r3)), default=0.0)


def sampled_probe_in_recompute(model, config, vocab: int) -> bool:
    """A probe observing half of each micro-batch's tokens (the drift metrics'
    ``routing.metrics_sample_frac=0.5``) through a training pass with activation recompute,
    micro-batches growing in tokens (6, 24, 16): under pipeline parallelism the first
    stage's backward recomputes micro-batch i after micro-batch i+1's forward. The sampled
    routing must equal a full probe's at those tokens."""
    from moe_rl.routing.probe import RouterProbe

    gen = torch.Generator().manual_seed(7)
    shapes = [(1, 6), (2, 12), (2, 8)]
    batches = [MicroBatch(torch.randint(0, vocab, shape, generator=gen)) for shape in shapes]
    split = config.tensor_model_parallel_size if config.sequence_parallel else 1
    tokens = [torch.randperm(b * s // split, generator=gen)[: b * s // split // 2].sort().values for b, s in shapes]
    full, sampled = RouterProbe(model), RouterProbe(model)
    full.start(with_probs=False)
    sampled.start(with_probs=False, tokens=tokens)
    run_microbatches(
        model, batches, loss_fn=lambda le, mb: (le[..., 0].sum() * 1e-3, {}), forward_only=False, hooks=[full, sampled]
    )
    every, some = full.stop(), sampled.stop()
    full.remove()
    sampled.remove()
    return len(some) == len(every) and all(
        torch.equal(s.natural, f.natural[t]) and torch.equal(s.used, f.used[t]) for s, f, t in zip(some, every, tokens)
    )


def replay_checks(hf_dir: str, hf_config, layout: ParallelLayout, batches: list[MicroBatch], out: Path) -> None:
    import json

    from megatron.core import parallel_state as ps

    from moe_rl.routing.probe import RouterProbe
    from moe_rl.models.architectures import architecture_of
    from moe_rl.routing.replay import RoutingReplay, moe_layers, replay_config_overrides
    from moe_rl.routing.stats import RoutingStats

    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    config = make_transformer_config(hf_config, layout, **replay_config_overrides("r2"), **recompute)
    model = build_model(hf_config, config)
    load_hf_weights(model, hf_config, hf_dir)
    replay, probe = RoutingReplay(model, recompute=True), RouterProbe(model)
    result: dict = {"layers": replay.layer_numbers}

    # r2: record in the old-policy pass, replay before any update: identical log-probs
    replay.start_record()
    probe.start()
    old = run_microbatches(model, batches, hooks=[replay, probe])
    recorded, old_probe = replay.recorded(), probe.stop()
    replay.start_replay(recorded, forward_only=True)
    again = run_microbatches(model, batches, hooks=[replay])
    replay.finish()
    result["replay_identical"] = all(torch.equal(a["logprobs"], b["logprobs"]) for a, b in zip(old, again))

    # change the routers (the same on every layout), then train through the replay
    with torch.no_grad():
        for layer, router in zip(replay.layer_numbers, [r for _, r in moe_layers(model)]):
            gen = torch.Generator().manual_seed(1000 + layer)
            router.weight.add_(0.5 * torch.randn(router.weight.shape, generator=gen))
    probe.start()
    replay.start_replay(recorded)
    run_microbatches(model, batches, loss_fn=loss_fn, forward_only=False, hooks=[replay, probe])
    replay.finish()
    new_probe = probe.stop()
    same = lambda x, y: torch.equal(x.sort(-1).values, y.sort(-1).values)  # noqa: E731
    result["used_equals_recorded"] = all(
        same(new_probe[i].used[:, l], recorded[i][l])
        for i in range(len(batches))
        for l in range(len(replay.layer_numbers))
    )
    result["natural_changed_tokens"] = sum(
        int((new_probe[i].natural.sort(-1).values != torch.stack(recorded[i], 1).sort(-1).values).any(-1).any(-1).sum())
        for i in range(len(batches))
    )
    grads = [r.weight.grad for _, r in moe_layers(model)]
    result["router_grad_min"] = min(float(g.norm()) for g in grads) if grads else None
    result["sampled_probe_in_recompute"] = sampled_probe_in_recompute(model, config, hf_config.vocab_size)

    # the drift the router change causes, reduced over ranks
    stats = RoutingStats(hf_config.num_hidden_layers, architecture_of(hf_config).num_experts(hf_config))
    for i in range(len(batches)):
        mask = torch.ones(new_probe[i].natural.shape[0])
        stats.add_drift(
            replay.layer_numbers,
            old_probe[i].natural,
            new_probe[i].natural,
            mask,
            old_probe[i].probs,
            new_probe[i].probs,
        )
        stats.add_load(replay.layer_numbers, new_probe[i].natural, mask)
    metrics = stats.reduce(pipeline_group=ps.get_pipeline_model_parallel_group())
    result["drift"] = {k: v.tolist() for k, v in metrics.items()}

    # r3: replaying transformers' own routing reproduces megatron's own log-probs
    load_hf_weights(model, hf_config, hf_dir)
    plain = run_microbatches(model, batches)
    result["r3_maxdiff"] = r3_maxdiff(hf_dir, model, replay, batches, plain)
    probe.remove()
    with open(out / f"replay_rank{dist.get_rank()}.json", "w") as f:
        json.dump(result, f)


def bf16_export_keeps_fp32_biases(model, hf_config, biases: torch.Tensor) -> dict:
    """A bf16 export and a bf16 weight sync send everything in bf16 but the expert biases,
    which keep their fp32 values exactly (collective)."""
    from moe_rl.models.weight_buckets import HFWeights

    def check(tensors: dict) -> bool | None:  # None: this rank holds no bias to check
        bias = sorted(k for k in tensors if k.endswith("e_score_correction_bias"))
        if not bias:
            return None
        others = {t.dtype for k, t in tensors.items() if k not in bias}
        exported = torch.stack([tensors[k] for k in bias])
        return exported.dtype == torch.float32 and torch.equal(exported, biases) and others <= {torch.bfloat16}

    exported = gather_hf_tensors(model, hf_config, dtype=torch.bfloat16)
    synced: dict = {}
    HFWeights(model, hf_config).send_buckets(1 << 12, torch.bfloat16, synced.update)  # to rank 0
    return {"bf16_export_keeps_fp32_biases": check(exported), "bf16_sync_keeps_fp32_biases": check(synced)}


def expert_bias_update_checks(model, config, hf_config, batch: list[MicroBatch]) -> dict:
    """megatron-core's aux-loss-free rule through our ``train_step``: an update skipped for
    NaN gradients leaves the expert biases as they were; a normal one moves every bias
    element by exactly the rate (or 0 where its expert's load is exactly average)."""
    settings = OptimSettings(lr=1e-3)
    ddp = wrap_ddp(model, config, settings)
    optimizer = build_optimizer([ddp], settings)
    biases = lambda: torch.stack(
        [b.clone() for n, b in model.named_buffers() if n.endswith("router.expert_bias")] or [torch.zeros(0)]
    )  # noqa: E731
    nan_loss = lambda out, mb: (out[..., 0].sum() * float("nan"), {})  # noqa: E731
    before = biases()
    skipped = train_step([ddp], optimizer, lambda: run_microbatches([ddp], batch, loss_fn=nan_loss, forward_only=False))
    after_skip = biases()
    train_step([ddp], optimizer, lambda: run_microbatches([ddp], batch, loss_fn=loss_fn, forward_only=False))
    moved = (biases() - after_skip).abs()
    rate = config.moe_router_bias_update_rate
    return {
        **bf16_export_keeps_fp32_biases(model, hf_config, biases()),
        "expert_load_counts_only_real_tokens": padding_left_out_of_expert_load(ddp, model, config, batch),
        "nan_update_skipped": not skipped.updated,
        "bias_kept_on_skip": torch.equal(before, after_skip),
        "bias_moved_by_rate": bool((((moved - rate).abs() < 1e-7) | (moved == 0)).all()) and bool((moved > 0).any()),
    }


def padding_left_out_of_expert_load(ddp, model, config, batch: list[MicroBatch]) -> bool:
    """A right-padded micro-batch (rows of SEQ and SEQ // 2 tokens): each router's load
    for the bias update counts top-k experts of the real tokens only."""
    routers = [m for m in model.modules() if getattr(m, "local_tokens_per_expert", None) is not None]
    for router in routers:
        router.local_tokens_per_expert.zero_()
    ids = torch.cat([mb.input_ids for mb in batch[:2]])
    padded = WeightedBatch(input_ids=ids, lengths=torch.tensor([SEQ, SEQ // 2]), w=torch.zeros(2, SEQ - 1))
    run_microbatches([ddp], [padded], loss_fn=loss_fn, forward_only=False)
    counts = [int(r.local_tokens_per_expert.sum()) for r in routers]
    for router in routers:
        router.local_tokens_per_expert.zero_()
    return bool(routers) and counts == [(SEQ + SEQ // 2) * config.moe_router_topk] * len(routers)


# layouts where GLM-4.5 also runs expert_bias_update_checks (one process; EP2 x DP2)
BIAS_CHECKS = {"1,1,1,1", "1,1,2,1"}
GRAD_CHECKS = {"1,1,1,1", "1,2,1,1"}  # layouts where Kimi-K2 (3 layers: PP2 splits them 2 + 1) also saves gradients


def fixed_loss_gradients(model, hf_config, batch: list[MicroBatch], out: Path) -> None:
    """The fixed loss over the whole batch (``out/loss.pt``, by the last stage) and its
    gradients in HF names (``out/grads_rank*.pt``, by the ranks that write them). For
    layouts without tensor or data parallelism (each stage's gradients are then whole)."""
    model.zero_grad()
    results = run_microbatches(model, batch, loss_fn=loss_fn, forward_only=False)
    grads = gather_hf_tensors(
        model, hf_config, source=lambda name, p: torch.zeros_like(p) if p.grad is None else p.grad
    )
    if grads:
        torch.save(grads, out / f"grads_rank{dist.get_rank()}.pt")
    if results:
        torch.save(torch.tensor(sum(float(r["loss"]) for r in results)), out / "loss.pt")


def family_checks(
    hf_dir: str,
    layout: ParallelLayout,
    batch: list[MicroBatch],
    out: Path,
    bias_checks: bool = False,
    grad_checks: bool = False,
) -> None:
    """Another architecture under ``layout``: forward-only log-probs and entropies of the
    whole batch (saved by the reporting rank), R2 replay before any update reproducing
    them bit for bit, R3 replay of transformers' own routing reproducing them, an export
    of the loaded weights (``out/export``) and with ``grad_checks`` a fixed loss's gradients."""
    import json

    from megatron.core import parallel_state as ps

    from moe_rl.routing.replay import RoutingReplay, replay_config_overrides

    hf_config = load_hf_config(hf_dir)
    config = make_transformer_config(hf_config, layout, **replay_config_overrides("r2"))
    model = build_model(hf_config, config)
    load_hf_weights(model, hf_config, hf_dir)
    replay = RoutingReplay(model)
    replay.start_record()
    plain = run_microbatches(model, batch, hooks=[replay])
    recorded = replay.recorded()
    replay.start_replay(recorded, forward_only=True)
    again = run_microbatches(model, batch, hooks=[replay])
    replay.finish()
    result = {"replay_identical": all(torch.equal(a["logprobs"], b["logprobs"]) for a, b in zip(plain, again))}
    result["r3_maxdiff"] = r3_maxdiff(hf_dir, model, replay, batch, plain)
    out.mkdir(parents=True, exist_ok=True)
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        torch.save(torch.cat([r["logprobs"] for r in plain]), out / "logp.pt")
        torch.save(torch.cat([r["entropy"] for r in plain]), out / "entropy.pt")
    export_hf_weights(model, hf_config, out / "export")
    if grad_checks:
        fixed_loss_gradients(model, hf_config, batch, out)
    if bias_checks and config.moe_router_enable_expert_bias:  # (the same on every rank: the checks are collective)
        result.update(expert_bias_update_checks(model, config, hf_config, batch))
    (out / f"replay_rank{dist.get_rank()}.json").write_text(json.dumps(result))
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()


SYNC_LAYOUTS = ("1,1,1,1", "1,1,2,1")  # tensor_sync_checks: one process, and EP 2 on two


def tensor_sync_checks(model, hf_config, out: Path) -> None:
    """The colocated tensor sync's request body (``/update_weights_from_tensor``), captured on
    the first rank from :class:`SGLangEngine` (its HTTP posts replaced) for one server of TP 2
    whose TP ranks run on GPUs "1" and "0" (named as the trainer's two ranks' "0" and "1"):
    per bucket, its entries, the pid of the process whose shared memory each maps (the rank
    that serialized it), and the tensors entry i maps. One process: both entries its own."""
    import contextlib
    import json
    import re

    from moe_rl.models.weight_buckets import HFWeights
    from moe_rl.rollout.sglang.engine import SGLangEngine
    from moe_rl.rollout.weight_sync.cuda_ipc import deserialize_sglang_payload
    from moe_rl.rollout.weight_sync.tensor import TensorSync

    class Capturing(SGLangEngine):
        def __init__(self) -> None:
            super().__init__(["http://tp2-stand-in:1"])
            self._server_ranks, self.bodies = [2], []

        @contextlib.contextmanager
        def weight_update(self, weight_version: str):
            yield

        def supports_flattened_buckets(self) -> bool:
            return True

        def _post_each(self, path, payloads, while_waiting=None, **kwargs):
            import base64

            for body in payloads:  # mapped now, while every producer keeps its copy
                entries = body["serialized_named_tensors"]
                pids = [sorted(set(re.findall(rb"/torch_(\d+)_", base64.b64decode(e)))) for e in entries]
                tensors = []
                for e in entries:
                    bucket = deserialize_sglang_payload(e)
                    flat = bucket["flattened_tensor"]
                    tensors.append(
                        {
                            m.name: flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape).clone()
                            for m in bucket["metadata"]
                        }
                    )
                self.bodies.append(
                    {
                        "path": path,
                        "entries": len(entries),
                        "pids": [[int(p) for p in x] for x in pids],
                        "tensors": tensors,
                    }
                )

    engine = Capturing() if dist.get_rank() == 0 else None
    two = dist.get_world_size() == 2
    sync = TensorSync(
        engine,
        bucket_bytes=64 << 10,
        dtype=torch.float32,
        server_gpus=[["1", "0"]],
        trainer_gpus=["0", "1"] if two else ["0"],
    )
    sync.push(HFWeights(model, hf_config), "1")
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    if engine is not None:
        merged = {}
        for body in engine.bodies:
            for tensors in body["tensors"]:
                for name, t in tensors.items():
                    merged.setdefault(name, []).append(t)
        torch.save({k: torch.stack(v) for k, v in merged.items()}, out / "tensor_sync.pt")
        summary = {
            "rank_pids": pids,
            "producers": sync.producers,
            "bodies": [{k: b[k] for k in ("path", "entries", "pids")} for b in engine.bodies],
        }
        (out / "tensor_sync.json").write_text(json.dumps(summary))
    dist.barrier()


CKPT_STEPS = 2  # optimizer steps before the checkpoint (then one more from it)


def training_tensors(model, optimizer) -> dict[str, torch.Tensor]:
    """This rank's weights and optimizer state (each part's master weights and Adam state)."""
    out = {f"model.{k}": v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    for i, part in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        for g, group in enumerate(part.optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                out[f"optimizer.{i}.{g}.{j}.param"] = p.detach()
                for k, v in part.optimizer.state[p].items():
                    out[f"optimizer.{i}.{g}.{j}.{k}"] = v
    return out


def checkpoint_checks(hf_dir: str, hf_config, root: Path, out: Path) -> None:
    """The distributed optimizer's checkpoint formats across data-parallel sizes, on one layout
    (tp = pp = ep = 1, so DP = the world size). One process: CKPT_STEPS steps, a ``dp_reshardable``
    and a ``fully_reshardable`` checkpoint, one more step (the reference weights). Two processes
    (DP 2): each checkpoint loaded into a fresh model and optimizer, the same step on the batch
    split over the DP ranks (the weights after it, rank 0's); the ``dp_reshardable`` one refused
    under EP 2 (the message)."""
    from megatron.core import parallel_state as ps

    from moe_rl.checkpoint.catalog import CheckpointMismatch, read_meta, select_checkpoint
    from moe_rl.checkpoint.store import Checkpointer, TrainingState, load_checkpoint

    batch = fixed_batch(hf_config.vocab_size)

    def fresh(layout: ParallelLayout, init: bool = True):
        if init:
            init_distributed(layout, model_dims(hf_config), seed=0)
        config = make_transformer_config(hf_config, layout)
        model = build_model(hf_config, config)
        load_hf_weights(model, hf_config, hf_dir)
        settings = OptimSettings(lr=3e-3, use_distributed_optimizer=True)
        ddp = wrap_ddp(model, config, settings)
        return model, ddp, build_optimizer([ddp], settings), settings

    def step(ddp, optimizer) -> None:
        mine = batch[ps.get_data_parallel_rank() :: ps.get_data_parallel_world_size()]
        train_step([ddp], optimizer, lambda: run_microbatches([ddp], mine, loss_fn=loss_fn, forward_only=False))

    def done(model, name: str) -> None:
        weights = gather_hf_tensors(model, hf_config)
        if dist.get_rank() == 0:
            torch.save(weights, out / f"{name}.pt")
        dist.barrier()
        ps.destroy_model_parallel()

    def compare_loads(layout: ParallelLayout, names: tuple[str, ...], run: str) -> None:
        """megatron's fully parallel load (load_checkpoint's default) against each rank reading
        its own: every rank's weights and optimizer state, per checkpoint."""
        differ = {}
        for name in names:
            path, meta = select_checkpoint(root / name)
            states = []
            for parallel in (False, True, None):  # (None: not loaded)
                model, ddp, optimizer, settings = fresh(layout, init=not states)
                if parallel is not None:
                    load_checkpoint(path, meta, TrainingState(model, optimizer, settings), layout, parallel=parallel)
                states.append(training_tensors(model, optimizer))
            serial, parallel, unloaded = states
            assert serial.keys() == parallel.keys()  # (a fresh optimizer has no Adam state yet)
            differ[name] = {
                "parallel_vs_serial": sorted(k for k in serial if not torch.equal(serial[k], parallel[k])),
                "unloaded_vs_serial": sum(not torch.equal(serial[k], unloaded[k]) for k in unloaded),
                "tensors": len(serial),
            }
            dist.barrier()
            ps.destroy_model_parallel()
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, differ)
        if dist.get_rank() == 0:
            import json

            (out / f"ckpt_parallel_load_{run}.json").write_text(json.dumps(every))

    layout = ParallelLayout()
    # 4 processes: EP 2 x DP 4 (expert DP 2); TP 2 x DP 2 (expert TP 2 x expert DP 2); TP 2 x EP 2 x DP 2
    if int(os.environ["WORLD_SIZE"]) == 4:
        compare_loads(ParallelLayout(ep=2), ("full",), "ep2dp4")
        compare_loads(ParallelLayout(tp=2), ("full",), "tp2dp2")  # linear_fc1's halves: strided shards exchanged
        return compare_loads(ParallelLayout(tp=2, ep=2), ("full",), "tp2ep2dp2")
    if int(os.environ["WORLD_SIZE"]) == 1:
        model, ddp, optimizer, settings = fresh(layout)
        for _ in range(CKPT_STEPS):
            step(ddp, optimizer)
        for name, reshardable in (("dpr", False), ("full", True)):
            saver = Checkpointer(root / name, 1, layout, (hf_config, None), async_save=False, reshardable=reshardable)
            saver.save(CKPT_STEPS, TrainingState(model, optimizer, settings), {})
            saver.wait()
        step(ddp, optimizer)
        return done(model, "ckpt_reference")
    for name in ("dpr", "full"):
        model, ddp, optimizer, settings = fresh(layout)
        path, meta = select_checkpoint(root / name)  # (its manifest verified)
        load_checkpoint(path, meta, TrainingState(model, optimizer, settings), layout)
        step(ddp, optimizer)
        done(model, f"ckpt_{name}_dp2")
    compare_loads(ParallelLayout(), ("dpr", "full"), "dp2")
    ep2 = ParallelLayout(ep=2)
    model, ddp, optimizer, settings = fresh(ep2)
    path = root / "dpr" / "checkpoints" / f"step_{CKPT_STEPS:06d}"
    try:
        load_checkpoint(path, read_meta(path), TrainingState(model, optimizer, settings), ep2)
        refusal = "loaded"
    except CheckpointMismatch as e:
        refusal = str(e)
    if dist.get_rank() == 0:
        (out / "ckpt_dpr_ep2_refusal.txt").write_text(refusal)
    dist.barrier()
    ps.destroy_model_parallel()


def main() -> None:
    args, family_layouts, checkpoints = sys.argv[1:], [], None
    if "--checkpoints" in args:  # a folder the one- and two-process runs share
        at = args.index("--checkpoints")
        checkpoints, args = Path(args[at + 1]), args[:at] + args[at + 2 :]
    if "--family-layouts" in args:
        at = args.index("--family-layouts")
        args, family_layouts = args[:at], args[at + 1 :]
    families = [args[i + 1] for i, a in enumerate(args) if a == "--family"]
    hf_dir, out_dir, *layouts = [
        a for i, a in enumerate(args) if a != "--family" and (i == 0 or args[i - 1] != "--family")
    ]
    hf_config = load_hf_config(hf_dir)
    batch = fixed_batch(hf_config.vocab_size)
    for spec in layouts:
        tp, pp, ep, etp = (int(x) for x in spec.split(","))
        layout = ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp)
        init_distributed(layout, model_dims(hf_config), seed=0)
        from megatron.core import parallel_state as ps

        rank = dist.get_rank()
        out = Path(out_dir) / spec.replace(",", "-")
        out.mkdir(parents=True, exist_ok=True)
        reporter = (
            ps.is_pipeline_last_stage()
            and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank() == 0
        )
        dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        my_batches = batch[dp_rank::dp_size]

        def fresh(distributed_optimizer: bool):
            config = make_transformer_config(hf_config, layout)
            model = build_model(hf_config, config)
            load_hf_weights(model, hf_config, hf_dir)
            if hasattr(model, "logprob_config") and dist.get_world_size() > 1:
                model.logprob_config.chunk_size = 5  # several sequence chunks (reference: one)
            settings = OptimSettings(lr=3e-3, use_distributed_optimizer=distributed_optimizer)
            ddp = wrap_ddp(model, config, settings)
            return ddp, settings

        # 1. log-probs, forward only, whole batch on every rank
        ddp, settings = fresh(False)
        results = run_microbatches([ddp], batch, forward_only=True)
        if reporter:
            torch.save(torch.cat([r["logprobs"] for r in results]), out / "logp.pt")
            torch.save(torch.cat([r["entropy"] for r in results]), out / "entropy.pt")

        # 2. gradients of the fixed loss, data split over data-parallel ranks
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        ddp.zero_grad_buffer()
        run_microbatches([ddp], my_batches, loss_fn=loss_fn, forward_only=False)
        finalize_model_grads([ddp])
        grads = gather_hf_tensors(ddp.module, hf_config, source=lambda name, p: p.main_grad)
        if grads:
            torch.save(grads, out / f"grads_rank{rank}.pt")

        # 2b. the colocated tensor sync's payloads, one per server TP rank (the weights as loaded)
        if spec in SYNC_LAYOUTS:
            tensor_sync_checks(ddp.module, hf_config, out)

        # 3. a few optimizer steps with the distributed optimizer
        ddp, settings = fresh(True)
        optimizer = build_optimizer([ddp], settings)
        losses = []
        for _ in range(TRAIN_STEPS):
            result = train_step(
                [ddp], optimizer, lambda: run_microbatches([ddp], my_batches, loss_fn=loss_fn, forward_only=False)
            )
            local = torch.tensor(sum(float(r["loss"]) for r in result.outputs))
            if ps.is_pipeline_last_stage():
                dist.all_reduce(local, group=ps.get_data_parallel_group())
            losses.append(float(local))
        if reporter:
            torch.save(torch.tensor(losses), out / "losses.pt")

        # 4. routing replay (r2 with activation recompute, r3 from transformers' routing), a sampled probe
        replay_checks(hf_dir, hf_config, layout, my_batches, out)

        # 5. other architectures: log-probs and replay
        for family in families if spec in family_layouts else []:
            bias_checks = spec in BIAS_CHECKS and Path(family).name == "glm4_moe"
            grad_checks = spec in GRAD_CHECKS and Path(family).name == "kimi_k2"
            family_batch = fixed_batch(load_hf_config(family).vocab_size)
            family_checks(family, layout, family_batch, out / Path(family).name, bias_checks, grad_checks)
        dist.barrier()
        ps.destroy_model_parallel()
    if checkpoints is not None:
        checkpoint_checks(hf_dir, hf_config, checkpoints, Path(out_dir))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
