"""TensorBoard tag names, defined once: the trainer writes them, the compare report and
its claims read them (and so can users' dashboards)."""

from __future__ import annotations

# ---------------------------------------------------------------- rollout side
REWARD_TOTAL = "reward/total"
ADVANTAGE_MEAN = "advantage/mean"
ADVANTAGE_STD = "advantage/std"
ADVANTAGE_DISTINCT_PER_GROUP = "advantage/distinct_per_group"
# what a sum-based advantage (GRPO) can tell apart
REWARD_DISTINCT_TOTALS_PER_GROUP = "reward/distinct_totals_per_group"
RESPONSE_LENGTH_MEAN = "response/length_mean"
RESPONSE_LENGTH_MAX = "response/length_max"
RESPONSE_FINISHED_FRAC = "response/finished_frac"
ROLLOUT_POLICY_LAG = "rollout/policy_lag"  # updates between the weights that sampled and the weights trained (async: 1)
# partial rollouts (rollout.partial): the trained samples whose tokens came from more than one weight
# version, carried responses started over (rollout.max_staleness), groups left for a later step
PARTIAL_SAMPLE_FRAC = "rollout/partial/sample_frac"
PARTIAL_RESTARTED = "rollout/partial/restarted"
PARTIAL_CARRIED_GROUPS = "rollout/partial/carried_groups"
PARTIAL_CARRIED_TOKENS = "rollout/partial/carried_tokens"
# how many weight versions the trained response tokens are behind the weights they train (mean, max)
TOKEN_STALENESS_MEAN = "rollout/staleness/token_mean"
TOKEN_STALENESS_MAX = "rollout/staleness/token_max"


def tokens_at_staleness(versions_behind: int) -> str:
    """``rollout/staleness/tokens_<k>``: the share of trained response tokens ``k`` versions behind."""
    return f"rollout/staleness/tokens_{versions_behind}"


DATA_TRUNCATED_PROMPTS = "data/truncated_prompts"
DATA_SKIPPED_LINES = "data/skipped_lines"
DATA_KEPT_GROUP_FRAC = "data/kept_group_frac"  # dynamic sampling: groups with unequal rewards / groups sampled
DATA_SAMPLING_ROUNDS = "data/sampling_rounds"  # dynamic sampling: generation rounds this step


def simulated_mismatch(metric: str, layer: int | None = None) -> str:
    """``rollout/simulated_mismatch/<metric>[/layer_<l>]``: the local engine's simulated
    train-inference mismatch (rollout.simulate_mismatch) as the engine measured it against
    the unperturbed model: ``flip_frac`` (tokens whose top-k set differs; ``/mean`` over MoE
    layers when ``layer`` is None), ``scale`` (its perturbation's relative norm)."""
    return f"rollout/simulated_mismatch/{metric}/" + ("mean" if layer is None else f"layer_{layer}")


SIMULATED_TARGET_FLIP_FRAC = "rollout/simulated_mismatch/target_flip_frac"
SIMULATED_ANY_LAYER_FLIPPED_FRAC = "rollout/simulated_mismatch/any_layer_flipped_frac"
SIMULATED_KL_K3 = "rollout/simulated_mismatch/kl_k3"  # KL(engine || unperturbed model), k3 on the drawn tokens
# the same KL exact over the vocabulary, and its parts: the routing's (engine routing, clean logits
# vs clean) and the logits' (engine vs engine routing with clean logits)
SIMULATED_KL = "rollout/simulated_mismatch/kl"
SIMULATED_ROUTING_KL = "rollout/simulated_mismatch/kl_routing"
SIMULATED_LOGIT_KL = "rollout/simulated_mismatch/kl_logits"
# drawn tokens whose ratio (clean / engine) leaves [1/2, 2]
SIMULATED_EXTREME_TOKEN_FRAC = "rollout/simulated_mismatch/extreme_token_frac"
SIMULATED_TARGET_ROUTING_KL = "rollout/simulated_mismatch/target_routing_kl"
SIMULATED_TARGET_LOGIT_KL = "rollout/simulated_mismatch/target_logit_kl"
SIMULATED_LOGIT_SCALE = "rollout/simulated_mismatch/logit_scale"  # the logit noise's standard deviation (nats)


def multi_turn(name: str) -> str:
    """A multi-turn rollout scalar (``turns_mean``, ``tool_failures``, ...; rollout.multi_turn.generate_fn runs)."""
    return f"rollout/multi_turn/{name}"


MULTI_TURN_FAILED_SAMPLES = multi_turn("failed_samples")  # samples whose generate function failed (scored 0)
MULTI_TURN_TRUNCATED_BY_CONTEXT_FRAC = multi_turn("truncated_by_context_frac")  # cut to the model's context
# environment tokens after a transcript's last policy turn, left out of the sample (per sample)
MULTI_TURN_DROPPED_ENVIRONMENT_TOKENS = multi_turn("dropped_environment_tokens_mean")


def reward(name: str) -> str:
    """One named reward's batch mean."""
    return f"reward/{name}"


def reward_failures(name: str) -> str:
    """How many samples a named reward failed to score (raised, timed out, NaN)."""
    return f"reward/failures/{name}"


# ---------------------------------------------------------------- evaluation (held-out problems)


def eval_pass_at(k: int) -> str:
    """pass@k over the held-out problems (k = 1 and k = data.eval_samples)."""
    return f"eval/pass@{k}"


def eval_reward(name: str) -> str:
    return f"eval/reward/{name}"


EVAL_REWARD_MEAN = "eval/reward_mean"  # the weighted total
EVAL_RESPONSE_LENGTH_MEAN = "eval/response_length_mean"
EVAL_PROMPTS = "eval/prompts"

# ---------------------------------------------------------------- policy update


def train(name: str) -> str:
    """``train/<name>`` for a loss metric (``loss``, ``clip_frac``, ``ratio_max``, ...)."""
    return f"train/{name}"


TRAIN_LOSS = train("loss")
TRAIN_CLIP_FRAC = train("clip_frac")
TRAIN_RATIO_MAX = train("ratio_max")
TRAIN_LOG_RATIO_P01 = train("log_ratio_p01")
TRAIN_LOG_RATIO_P99 = train("log_ratio_p99")
TRAIN_LOG_RATIO_HISTOGRAM = train("log_ratio")
TRAIN_LOGP_MISMATCH_MEAN = train("logp_mismatch_mean")
TRAIN_LOGP_MISMATCH_MAX = train("logp_mismatch_max")
TRAIN_GRAD_NORM = train("grad_norm")
TRAIN_LR = train("lr")
TRAIN_UPDATE_SKIPPED = train("update_skipped")


def train_by_routing(metric: str, routing_changed: bool) -> str:
    """``train/<metric>/routing_changed`` or ``.../routing_same``: the off-policy update
    passes' per-token figure (``log_ratio_abs``, ``clip_frac``; ``tokens``: counted over
    those passes) over tokens whose routing changed since the old policy (any MoE layer),
    or over the rest."""
    return f"train/{metric}/" + ("routing_changed" if routing_changed else "routing_same")


PERF_STEP_TIME = "perf/step_time_s"
PERF_ROLLOUT_TIME = "perf/rollout_time_s"
PERF_TRAIN_TIME = "perf/train_time_s"
PERF_TOKENS_PER_S = "perf/tokens_per_s"
PERF_PADDING_FRAC = "perf/padding_frac"  # padding tokens / micro-batch tokens (all ranks)
PERF_PEAK_MEMORY_MB = "perf/peak_memory_mb"  # the largest over ranks: CUDA allocated, or peak RSS on CPU

# ---------------------------------------------------------------- routing
# the RoutingMonitor's groups and where each is logged
ROUTING_PREFIXES = {
    "old_vs_new": "routing",  # old policy -> updated policy
    "train_vs_rollout": "routing/train_vs_rollout",  # rollout engine -> trainer
    "train_vs_rollout_environment": "routing/train_vs_rollout/environment_tokens",  # the same, tokens environments inserted
    "replayed": "routing/replayed",  # old policy -> the replayed update pass
    "load": "routing",  # expert load of the old-policy pass
    "expert_bias_effect": "routing/expert_bias_effect",  # the step's expert-bias change alone (updated routers)
}
ROUTING_HEATMAP = "routing/expert_load_heatmap"


def routing(metric: str, group: str = "old_vs_new", layer: int | None = None) -> str:
    """``routing[/<group>]/<metric>/layer_<l>`` or ``.../mean`` (``layer=None``)."""
    return f"{ROUTING_PREFIXES[group]}/{metric}/" + ("mean" if layer is None else f"layer_{layer}")


def routing_disagreement_heatmap(group: str) -> str:
    """Layers x experts image of the experts one side chose and the other did not."""
    return f"{ROUTING_PREFIXES[group]}/expert_disagreement_heatmap"


def routing_load_histogram(layer: int) -> str:
    return f"routing/expert_load/layer_{layer}"


ROUTING_EXPERT_CHANGE = routing("expert_change_frac")
ROUTING_ANY_LAYER_CHANGED = routing("any_layer_changed_frac")
ROUTING_REPLAYED_CHANGED = routing("changed_frac", "replayed")
ROUTING_TRAIN_VS_ROLLOUT_CHANGED = routing("changed_frac", "train_vs_rollout")
ROUTING_TRAIN_VS_ROLLOUT_ANY_LAYER = routing("any_layer_changed_frac", "train_vs_rollout")
ROUTING_TRAIN_VS_ROLLOUT_MISMATCH_CHANGED = routing("logp_mismatch_routing_changed", "train_vs_rollout")
ROUTING_TRAIN_VS_ROLLOUT_MISMATCH_SAME = routing("logp_mismatch_routing_same", "train_vs_rollout")


# TensorBoard's "Custom Scalars" tab: the routing drift of every layer in one chart per kind
# (regexes over the tags above), next to the rewards and the train-inference mismatch
CUSTOM_SCALARS_LAYOUT = {
    "routing drift per layer": {
        "old -> updated policy: experts changed (routing/changed_frac/layer_*)": [
            "Multiline",
            [r"^routing/changed_frac/layer_\d+$"],
        ],
        "rollout engine -> trainer (routing/train_vs_rollout/changed_frac/layer_*)": [
            "Multiline",
            [r"^routing/train_vs_rollout/changed_frac/layer_\d+$"],
        ],
        "replayed update passes (0 under R2/R3)": ["Multiline", [r"^routing/replayed/changed_frac/layer_\d+$"]],
        "router KL, old -> updated (routing/router_kl/layer_*)": ["Multiline", [r"^routing/router_kl/layer_\d+$"]],
        "expert load imbalance (routing/expert_load_cv/layer_*)": [
            "Multiline",
            [r"^routing/expert_load_cv/layer_\d+$"],
        ],
    },
    "learning": {
        "rewards": ["Multiline", [r"^reward/(total|[^/]+)$"]],
        "held-out pass@k": ["Multiline", [r"^eval/pass@\d+$"]],
        "train-inference log-prob mismatch": ["Multiline", [r"^train/logp_mismatch_(mean|max)$"]],
    },
}
