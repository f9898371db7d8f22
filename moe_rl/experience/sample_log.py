"""What the model sampled, where a user can read it: a few prompts with their responses,
rewards and advantages per step in ``samples.jsonl`` and TensorBoard's text tab (a
multi-turn transcript as its turns, each marked policy or environment; a failed one with
its reason), and a warning when the rewards have told the policy nothing for several steps
in a row."""

from __future__ import annotations

import html
import itertools
import logging
from dataclasses import dataclass

from moe_rl.experience.types import Experience
from moe_rl.rollout.types import Sample, SampleStatus

log = logging.getLogger("moe_rl.train")
SAMPLES_TAG = "samples"  # TensorBoard text tag


@dataclass(frozen=True)
class SampleRecord:
    """One sample as text (a line of ``samples.jsonl``)."""

    step: int
    index: int  # in the step's batch (group members are contiguous)
    prompt: str
    response: str
    rewards: dict[str, float]
    advantage: float
    finish_reason: str
    # a multi-turn transcript: its turns in order, {"role": "policy" | "environment", "text": ...}
    turns: list[dict] | None = None
    failed: str | None = None  # why its generate function failed (nothing of it trained)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None or k not in ("turns", "failed")}


def sample_records(
    exp: Experience, tokenizer, step: int, count: int, group_size: int, keep_special_tokens: bool = False
) -> list[SampleRecord]:
    """The first sample of each of the first ``count`` groups (different prompts): its
    prompt decoded with special tokens kept (what the model saw), its response as the
    rewards scored it (special tokens skipped unless ``keep_special_tokens``)."""
    indices = list(range(0, len(exp.samples), group_size))[:count]
    records = []
    for i in indices:
        s = exp.sample(i)
        records.append(
            SampleRecord(
                step=step,
                index=i,
                prompt=tokenizer.decode(s.prompt_ids),
                response=tokenizer.decode(s.output_ids, skip_special_tokens=not keep_special_tokens),
                rewards={name: round(float(v), 6) for name, v in zip(exp.reward_names, exp.rewards[i].tolist())},
                advantage=round(float(exp.advantages[i]), 6),
                finish_reason=s.finish_reason,
                turns=transcript_turns(s, tokenizer),
                failed=s.failure,
            )
        )
    return records


def transcript_turns(sample: Sample, tokenizer) -> list[dict] | None:
    """A multi-turn sample's output as its stretches of policy and environment tokens
    (``None`` for a single-turn sample and a failed one: nothing of it is the policy's)."""
    if sample.loss_mask is None or sample.status is SampleStatus.FAILED:
        return None
    pairs = zip(sample.output_ids, sample.loss_mask)
    return [
        {"role": "policy" if trained else "environment", "text": tokenizer.decode([t for t, _ in run])}
        for trained, run in itertools.groupby(pairs, key=lambda pair: bool(pair[1]))
    ]


def samples_markdown(records: list[SampleRecord]) -> str:
    """A Markdown table for TensorBoard's text tab."""
    if not records:
        return ""
    names = list(records[0].rewards)
    head = "| prompt | response | " + " | ".join(names) + " | advantage |\n|" + "---|" * (len(names) + 3) + "\n"
    cell = lambda text: html.escape(text).replace("|", "\\|").replace("\n", "<br>") or " "  # noqa: E731
    rows = [
        f"| {cell(r.prompt)} | {_response_cell(r, cell)} | "
        + " | ".join(f"{r.rewards[n]:.3g}" for n in names)
        + f" | {r.advantage:+.3g} |"
        for r in records
    ]
    return head + "\n".join(rows)


def _response_cell(record: SampleRecord, cell) -> str:
    """The response, or a transcript's turns one per line (``**policy 1:** ...``,
    ``**environment:** ...``); a failed one's reason first."""
    failed = f"**failed (not trained):** {cell(record.failed)}<br>" if record.failed else ""
    if not record.turns:
        return failed + cell(record.response)
    policy = itertools.count(1)
    lines = [
        f"**{'policy ' + str(next(policy)) if t['role'] == 'policy' else 'environment'}:** {cell(t['text'])}"
        for t in record.turns
    ]
    return failed + "<br>".join(lines)


class FlatRewardWatch:
    """Warns once when every sample of ``patience`` consecutive steps got the same rewards
    (all 0, or all equal): the policy then gets no signal, and the cause is rarely the
    algorithm."""

    def __init__(self, patience: int) -> None:
        self.patience = patience
        self.in_a_row = 0
        self.warned = False

    def observe(self, step: int, rewards: list[list[float]], max_new_tokens: int) -> bool:
        """Whether step ``step``'s rewards (one row per sample) make the warning fire (once per run)."""
        flat = len({tuple(round(v, 9) for v in row) for row in rewards}) <= 1
        self.in_a_row = self.in_a_row + 1 if flat else 0
        if self.warned or not self.patience or self.in_a_row < self.patience:
            return False
        self.warned = True
        value = ", ".join(f"{v:g}" for v in rewards[0]) if rewards else "0"
        log.warning(
            "steps %d-%d: every sample got the rewards (%s): the policy learns nothing from equal rewards. Likely causes: the prompt "
            "format (does the model answer this data.prompt_template / chat template?), rollout.max_new_tokens=%d "
            "(long enough for an answer?), the reward functions (do they parse this answer format? data.answer_key?). "
            "Read what it sampled in samples.jsonl or TensorBoard's text tab.",
            step - self.in_a_row + 1,
            step,
            value,
            max_new_tokens,
        )
        return True
