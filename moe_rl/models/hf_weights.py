"""Hugging Face safetensors <-> this rank's shards of a megatron-core GPTModel.

Loading: every rank reads only the checkpoint tensors its own parameters need (its
pipeline stage's layers, its experts) and keeps its tensor-parallel slice. Exporting:
tensor-parallel shards are gathered inside their group, and one rank per replica
(data-parallel rank 0; expert-data-parallel rank 0 for experts) writes its stage's and
experts' tensors; rank 0 writes the index, the config and the tokenizer files. The
directory is written under a temporary name and renamed when complete.

Layout facts (measured against transformers' Qwen3-MoE): megatron's fused QKV is interleaved per KV group (that
group's query heads, then its key, then its value head); ``linear_fc1`` is
``cat(gate_proj, up_proj)`` *per tensor-parallel shard*; ``pre_mlp_layernorm`` is HF's
``post_attention_layernorm``; ``router`` is the MoE block's ``gate``. Routed experts are
one stacked parameter per projection and layer (``[local experts, ...]``,
:class:`moe_rl.models.grouped_experts.GroupedExperts`) or one module each (``SequentialMLP``).
"""

from __future__ import annotations

import functools
import copy
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, cast

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import PretrainedConfig

from moe_rl.models.architectures import architecture_of, head_dim, hf_dtype
from moe_rl.models.builder import named_weights, padded_vocab_size
from moe_rl.models.export_dir import export_destination, export_destination_problem, write_marker
from parallel.collectives import all_gather_objects, barrier, broadcast_object

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)


@dataclass(frozen=True)
class Recipe:
    """How one megatron parameter is made of HF tensors.

    ``kind``: ``copy`` (one tensor), ``vocab`` (one tensor whose rows megatron pads to a
    multiple of TP), ``qkv`` (q, k, v interleaved per KV group) or ``glu`` (gate, up,
    concatenated per shard). ``shard_dim`` is the tensor-parallel
    split dimension (None: replicated); ``expert`` selects the expert-TP group.
    ``stacked``: the parameter stacks that many experts along a new first dimension, each
    made by this recipe from its share of ``hf_keys`` (expert-major; 0: not stacked).
    """

    hf_keys: tuple[str, ...]
    kind: str = "copy"
    shard_dim: int | None = None
    expert: bool = False
    stacked: int = 0

    def per_expert(self) -> tuple[Recipe, ...]:
        """The recipe of each stacked expert (``(self,)`` when not stacked)."""
        return _per_expert(self)


@functools.lru_cache(maxsize=None)  # a few per layer; asked at every weight sync
def _per_expert(recipe: Recipe) -> tuple[Recipe, ...]:
    if not recipe.stacked:
        return (recipe,)
    k = len(recipe.hf_keys) // recipe.stacked
    return tuple(replace(recipe, hf_keys=recipe.hf_keys[e * k : (e + 1) * k], stacked=0) for e in range(recipe.stacked))


class ParamMapper:
    """Maps this rank's megatron parameter names to :class:`Recipe` s."""

    _LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
    _MLA = {  # megatron MLA parameter -> (HF self_attn key, TP split dim); o_proj is linear_proj as usual
        "self_attention.linear_q_proj.weight": ("self_attn.q_proj.weight", 0),
        "self_attention.linear_q_down_proj.weight": ("self_attn.q_a_proj.weight", 0),
        "self_attention.linear_q_up_proj.weight": ("self_attn.q_b_proj.weight", 0),
        "self_attention.linear_kv_down_proj.weight": ("self_attn.kv_a_proj_with_mqa.weight", 0),
        "self_attention.linear_kv_up_proj.weight": ("self_attn.kv_b_proj.weight", 0),
        "self_attention.kv_layernorm.weight": ("self_attn.kv_a_layernorm.weight", None),
    }
    _SHARED = re.compile(r"mlp\.shared_experts\.(linear_fc1\.weight|linear_fc2\.weight|gate_weight)")
    _EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight")  # SequentialMLP
    _STACKED = re.compile(r"mlp\.experts\.(linear_fc[12])\.weight")  # GroupedExperts

    def __init__(self, hf_config: PretrainedConfig, model: GPTModel) -> None:
        self.cfg = hf_config
        self.arch = architecture_of(hf_config)
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.mla = bool(model.config.multi_latent_attention)
        self.layer_offset = get_transformer_layer_offset(model.config)
        num_experts = self.arch.num_experts(hf_config)
        self.local_experts = num_experts // model.config.expert_model_parallel_size
        self.expert_offset = ps.get_expert_model_parallel_rank() * self.local_experts

    def recipe(self, name: str) -> Recipe:
        if name == "embedding.word_embeddings.weight":
            return Recipe(("model.embed_tokens.weight",), "vocab", 0)
        if name == "output_layer.weight":
            return Recipe(("model.embed_tokens.weight" if self.tied else "lm_head.weight",), "vocab", 0)
        if name == "decoder.final_layernorm.weight":
            return Recipe(("model.norm.weight",))
        m = self._LAYER.fullmatch(name)
        if not m:
            raise KeyError(name)
        l = self.layer_offset + int(m.group(1))
        rest = m.group(2)
        p = f"model.layers.{l}."
        qk_norm_shard = 0 if self.arch.qk_norm(self.cfg) == "full" else None  # OLMoE: all heads' weights
        simple = {
            "input_layernorm.weight": Recipe((p + "input_layernorm.weight",)),
            "pre_mlp_layernorm.weight": Recipe((p + "post_attention_layernorm.weight",)),
            "self_attention.q_layernorm.weight": Recipe(
                (p + ("self_attn.q_a_layernorm.weight" if self.mla else "self_attn.q_norm.weight"),),
                shard_dim=qk_norm_shard,
            ),
            "self_attention.k_layernorm.weight": Recipe((p + "self_attn.k_norm.weight",), shard_dim=qk_norm_shard),
            "self_attention.linear_proj.weight": Recipe((p + "self_attn.o_proj.weight",), shard_dim=1),
            "mlp.router.weight": Recipe((self.arch.experts.router.format(l=l),)),
            "mlp.linear_fc1.weight": Recipe((p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), "glu", 0),
            "mlp.linear_fc2.weight": Recipe((p + "mlp.down_proj.weight",), shard_dim=1),
        }
        if rest in simple:
            return simple[rest]
        mla = self._MLA.get(rest)
        if mla:
            key, shard_dim = mla
            return Recipe((p + key,), shard_dim=shard_dim)
        if rest == "mlp.router.expert_bias" and self.arch.experts.expert_bias:
            return Recipe((self.arch.experts.expert_bias.format(l=l),))
        shared = self._SHARED.fullmatch(rest)
        if shared and self.arch.shared:
            keys, part = self.arch.shared, shared.group(1)
            if part == "linear_fc1.weight":
                return Recipe((keys.gate_proj.format(l=l), keys.up_proj.format(l=l)), "glu", 0)
            if part == "linear_fc2.weight":
                return Recipe((keys.down_proj.format(l=l),), shard_dim=1)
            if keys.gate:  # gate_weight: megatron builds it only when the family has the gate
                return Recipe((keys.gate.format(l=l),))
        if rest.startswith("self_attention.linear_qkv."):
            suffix = rest.rsplit(".", 1)[1]  # weight | bias
            return Recipe(tuple(f"{p}self_attn.{x}_proj.{suffix}" for x in "qkv"), "qkv", 0)
        e = self._EXPERT.fullmatch(rest)
        if e:
            return self._expert_recipe(l, self.expert_offset + int(e.group(1)), e.group(2))
        stacked = self._STACKED.fullmatch(rest)
        if stacked:
            experts = [
                self._expert_recipe(l, self.expert_offset + i, stacked.group(1)) for i in range(self.local_experts)
            ]
            every_key = tuple(key for recipe in experts for key in recipe.hf_keys)
            return replace(experts[0], hf_keys=every_key, stacked=self.local_experts)
        raise KeyError(name)

    def _expert_recipe(self, layer: int, expert: int, linear: str) -> Recipe:
        keys = self.arch.experts
        if linear == "linear_fc1":
            return Recipe(
                (keys.gate.format(l=layer, e=expert), keys.up.format(l=layer, e=expert)), "glu", 0, expert=True
            )
        return Recipe((keys.down.format(l=layer, e=expert),), shard_dim=1, expert=True)

    # -------------------------------------------------------------- full <-> shard

    def to_shard(self, recipe: Recipe, tensors: list[torch.Tensor]) -> torch.Tensor:
        """This rank's shard of the parameter ``recipe`` makes of ``tensors`` (``hf_keys`` order)."""
        if recipe.stacked:
            k = len(recipe.hf_keys) // recipe.stacked
            return torch.stack(
                [self.to_shard(r, tensors[e * k : (e + 1) * k]) for e, r in enumerate(recipe.per_expert())]
            )
        rank, size = self._tp(recipe)
        if recipe.kind == "vocab":
            full = tensors[0]
            padding = padded_vocab_size(full.shape[0], size) - full.shape[0]
            if padding:
                full = torch.cat([full, full.new_zeros(padding, *full.shape[1:])])
            return full.chunk(size, 0)[rank]
        if recipe.kind == "copy":
            full = tensors[0]
            return full if recipe.shard_dim is None else full.chunk(size, recipe.shard_dim)[rank]
        if recipe.kind == "glu":
            return torch.cat([t.chunk(size, 0)[rank] for t in tensors])
        return self._interleave_qkv(*tensors).chunk(size, 0)[rank]

    def to_full(self, recipe: Recipe, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """Inverse of :meth:`to_shard` given every TP rank's shard (in rank order)."""
        if recipe.stacked:
            return [full for e, r in enumerate(recipe.per_expert()) for full in self.to_full(r, [s[e] for s in shards])]
        # one shard (no tensor parallelism): views of it, not copies
        joined = shards[0] if len(shards) == 1 else None
        if recipe.kind == "vocab":
            return [(joined if joined is not None else torch.cat(shards, 0))[: self.cfg.vocab_size]]
        if recipe.kind == "copy":
            return [
                shards[0] if recipe.shard_dim is None or joined is not None else torch.cat(shards, recipe.shard_dim)
            ]
        if recipe.kind == "glu":
            halves = [s.chunk(2, 0) for s in shards]
            return (
                list(halves[0])
                if joined is not None
                else [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
            )
        return self._split_qkv(joined if joined is not None else torch.cat(shards, 0))

    def _tp(self, recipe: Recipe) -> tuple[int, int]:
        if recipe.shard_dim is None:
            return 0, 1
        if recipe.expert:
            return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
        return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()

    def _qkv_dims(self) -> tuple[int, int, int]:
        groups = self.cfg.num_key_value_heads
        return groups, self.cfg.num_attention_heads // groups, head_dim(self.cfg)

    def _interleave_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        groups, q_per_group, d = self._qkv_dims()
        tail = q.shape[1:]
        parts = [q.reshape(groups, q_per_group * d, *tail), k.reshape(groups, d, *tail), v.reshape(groups, d, *tail)]
        return torch.cat(parts, dim=1).reshape(-1, *tail)

    def _split_qkv(self, fused: torch.Tensor) -> list[torch.Tensor]:
        groups, q_per_group, d = self._qkv_dims()
        tail = fused.shape[1:]
        g = fused.reshape(groups, (q_per_group + 2) * d, *tail)
        q, k, v = g.split([q_per_group * d, d, d], dim=1)
        return [q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)]


class SafetensorsDir:
    """Lazy reader of a local HF checkpoint directory (single file or sharded index)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.path / "model.safetensors").exists():
            with safe_open(self.path / "model.safetensors", "pt") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {self.path}")
        self.weight_map: dict[str, str] = weight_map
        self._handles: dict[str, Any] = {}  # safetensors' open files

    def keys(self) -> set[str]:
        return set(self.weight_map)

    def get(self, key: str) -> torch.Tensor:
        if key not in self.weight_map:
            raise KeyError(f"{key!r} is not in the checkpoint {self.path}")
        file = self.weight_map[key]
        if file not in self._handles:
            self._handles[file] = safe_open(self.path / file, "pt")
        return self._handles[file].get_tensor(key)

    def dtype(self) -> torch.dtype:
        return self.get(next(iter(sorted(self.weight_map)))).dtype


@torch.no_grad()
def load_hf_weights(model: GPTModel, hf_config: PretrainedConfig, hf_dir: str | os.PathLike) -> None:
    """Fill this rank's parameters from the HF checkpoint in ``hf_dir``.

    Raises ``ValueError`` if a parameter's tensors are missing or have the wrong shape,
    and (after comparing all ranks) if the checkpoint holds weights no rank used.
    """
    reader = SafetensorsDir(hf_dir)
    mapper = ParamMapper(hf_config, model)
    used: set[str] = set()
    for name, param in named_weights(model):
        recipe = mapper.recipe(name)
        missing = [k for k in recipe.hf_keys if k not in reader.weight_map]
        if missing:
            raise ValueError(f"checkpoint {hf_dir} lacks {missing} (needed for megatron parameter {name})")
        shard = mapper.to_shard(recipe, [reader.get(k) for k in recipe.hf_keys])
        if shard.shape != param.shape:
            raise ValueError(f"{name}: checkpoint gives shape {tuple(shard.shape)}, model has {tuple(param.shape)}")
        param.copy_(shard.to(param.dtype))
        used.update(recipe.hf_keys)
    all_used = all_gather_objects(used)
    unused = reader.keys() - set().union(*all_used)
    if mapper.tied:
        unused.discard("lm_head.weight")
    unused -= multi_token_prediction_keys(unused, hf_config)
    if unused:
        raise ValueError(
            f"checkpoint {hf_dir} has {len(unused)} weights this model does not use, e.g. {sorted(unused)[:4]}: "
            f"is model_type={hf_config.model_type!r} right?"
        )


def multi_token_prediction_keys(keys: set[str], hf_config: PretrainedConfig) -> set[str]:
    """The multi-token-prediction layers' weights among ``keys`` (GLM-4.5, DeepSeek-V3 keep
    them as layers after the last one, ``num_nextn_predict_layers``): not trained, not
    exported (transformers does not use them either; SGLang's MTP draft loads its own)."""
    extra = getattr(hf_config, "num_nextn_predict_layers", 0) or 0
    first = hf_config.num_hidden_layers
    prefixes = tuple(f"model.layers.{first + i}." for i in range(extra))
    return {k for k in keys if k.startswith(prefixes)} if prefixes else set()


def served_dtype(name: str, own: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype megatron parameter/buffer ``name`` is exported and synced in: ``dtype`` (the
    served one; ``None``: its own), except the routers' expert biases, which keep their own
    fp32 (in bf16 their 1e-3 update steps vanish and a resume would not be exact; HF
    checkpoints and SGLang keep ``e_score_correction_bias`` in fp32 too)."""
    return own if dtype is None or name.endswith("router.expert_bias") else dtype


@torch.no_grad()
def gather_hf_tensors(
    model: GPTModel,
    hf_config: PretrainedConfig,
    *,
    dtype: torch.dtype | None = None,
    source: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """Full HF-named tensors of the parameters this rank writes (others get ``{}``).

    ``source(name, param)`` picks what to gather (default: the parameter itself; e.g.
    ``lambda n, p: p.main_grad`` gathers gradients, of parameters only: the routers'
    expert biases are buffers). ``device``: where each full tensor goes as soon as it is
    gathered (e.g. the host, for an export: the accelerator then never holds more than
    one gathered parameter, not the writer's whole share). Collective over TP groups."""
    mapper = ParamMapper(hf_config, model)
    weights = named_weights(model) if source is None else list(model.named_parameters())
    source = source or (lambda name, param: param)
    tensors: dict[str, torch.Tensor] = {}
    for name, param in weights:
        if name == "output_layer.weight" and mapper.tied:
            continue
        recipe = mapper.recipe(name)
        shards = gather_shards(source(name, param).detach(), recipe, mapper)
        if is_writer(recipe):
            for key, full in zip(recipe.hf_keys, mapper.to_full(recipe, shards)):
                tensors[key] = full.to(device=device, dtype=served_dtype(name, full.dtype, dtype)).contiguous()
    return tensors


@torch.no_grad()
def export_hf_weights(
    model: GPTModel,
    hf_config: PretrainedConfig,
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    copy_files_from: str | os.PathLike | None = None,
) -> Path:
    """Write the model as a HF directory (safetensors shards, index, config) that
    ``transformers`` and SGLang load. Collective: every rank must call it."""
    dtype = dtype or hf_dtype(hf_config)
    rank = dist.get_rank() if dist.is_initialized() else 0
    problem = broadcast_object(export_destination_problem(out_dir) if rank == 0 else None)
    if problem:
        raise ValueError(problem)
    out = export_destination(out_dir)
    tmp = Path(cast(str, broadcast_object(_fresh_temporary(out) if rank == 0 else None)))  # the first rank's
    try:
        _write_export(model, hf_config, tmp, dtype, copy_files_from, rank)
        barrier()
        if rank == 0:
            _readable_as_umask_allows(tmp)
            if problem := export_destination_problem(out):  # something else wrote there meanwhile
                raise ValueError(problem)
            _replace_dir(tmp, out)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written left behind
        raise
    barrier()
    return out


def _write_export(
    model: GPTModel,
    hf_config: PretrainedConfig,
    tmp: Path,
    dtype: torch.dtype,
    copy_files_from: str | os.PathLike | None,
    rank: int,
) -> None:
    """This rank's safetensors shards into ``tmp``; the first rank's also the index, the
    config and tokenizer files and the export's marker."""
    tensors = gather_hf_tensors(model, hf_config, dtype=dtype, device="cpu")
    writers = all_gather_objects(sorted(tensors))
    files = [i for i, keys in enumerate(writers) if keys]
    weight_map: dict[str, str] = {}
    for n, writer in enumerate(files):
        file = f"model-{n + 1:05d}-of-{len(files):05d}.safetensors"
        weight_map.update({k: file for k in writers[writer]})
        if writer == rank:
            save_file(tensors, tmp / file, metadata={"format": "pt"})
    if rank == 0:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size_of_rank0_tensors": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        exported = copy.deepcopy(hf_config)  # the caller's (the trainer's, for its every save) stays as it is
        exported.dtype = dtype
        write_config_files(exported, tmp, copy_files_from)
        write_marker(tmp, dtype=str(dtype).removeprefix("torch."))


def write_config_files(hf_config: PretrainedConfig, out: Path, copy_files_from: str | os.PathLike | None) -> None:
    """``config.json`` into ``out``, and the tokenizer's files found in ``copy_files_from``."""
    hf_config.save_pretrained(out)
    if copy_files_from is not None:
        for name in _TOKENIZER_FILES:
            src = Path(copy_files_from) / name
            if src.exists():  # the bytes only: the copy's mode comes from the umask, not the source's
                shutil.copyfile(src, out / name)


def _readable_as_umask_allows(directory: Path) -> None:
    """The permissions any tool gives what it writes (0777/0666 less the umask): the
    temporary directory was made private (0700) and some writers make their files 0600,
    which a server running as another user could not read."""
    mask = os.umask(0)
    os.umask(mask)
    directory.chmod(0o777 & ~mask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~mask)


def _fresh_temporary(out: Path) -> str:
    """A new directory beside ``out`` to write the export into, after removing those a
    killed export left there (named after ``out``: only an export makes them)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for pattern in (f".{out.name}.tmp-*", f".{out.name}.old-*"):
        for stale in out.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent)


def _replace_dir(new: Path, out: Path) -> None:
    """``new`` becomes ``out``; an earlier ``out`` is moved aside first and removed last."""
    if not out.exists():
        os.replace(new, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.replace(out, old / out.name)
    os.replace(new, out)
    shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------ collectives


def gather_shards(param: torch.Tensor, recipe: Recipe, mapper: ParamMapper) -> list[torch.Tensor]:
    """Every tensor-parallel rank's shard of ``param`` (in rank order). Collective over the
    parameter's (expert-)tensor-parallel group."""
    _, size = mapper._tp(recipe)
    if size == 1:
        return [param]
    group = ps.get_expert_tensor_parallel_group() if recipe.expert else ps.get_tensor_model_parallel_group()
    shards = [torch.empty_like(param) for _ in range(size)]
    dist.all_gather(shards, param.contiguous(), group=group)
    return shards


def is_writer(recipe: Recipe) -> bool:
    """Whether this rank writes the full tensors of parameters made by ``recipe``: one rank
    per pipeline stage (per expert-parallel rank for experts)."""
    if recipe.expert:
        return ps.get_expert_data_parallel_rank() == 0 and ps.get_expert_tensor_parallel_rank() == 0
    return ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
