"""Which samples go into which micro-batch, on which data-parallel rank.

A *plan* is this rank's micro-batches as lists of sample indices (``None``: an empty row).
Every data-parallel rank gets a plan with the same number of micro-batches (the
expert-parallel all-to-all and the pipeline schedule run in lockstep). Each micro-batch is
padded only to its own longest sample (:func:`moe_rl.trainer.batch.build_train_batch`).

- :func:`fixed_plan`: ``micro_batch_size`` rows each, samples in order.
- :func:`token_budget_plan`: samples spread over ranks by tokens (longest first to the
  least loaded rank), then packed longest-first into micro-batches whose padded size
  ``rows x longest`` stays within ``max_tokens`` (a longer sample goes alone).
- :func:`derived_budget`: the default budget, ``micro_batch_size`` samples of the step's
  mean length (never more tokens a micro-batch than ``micro_batch_size`` rows of the
  step's longest sample, the fixed plan's size). Under it a step of samples of nearly one
  length takes rows instead (:class:`MicroBatchPlanner`): packing them by the budget
  leaves a few for a micro-batch of their own, and a micro-batch's fixed cost (a small
  model's whole cost) is then paid twice to save a few padding tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

Plan = list[list[int | None]]


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def fixed_plan(indices: Sequence[int], rows_per_rank: int, micro_batch_size: int) -> Plan:
    """``ceil(rows_per_rank / micro_batch_size)`` micro-batches of equal rows; a share
    shorter than ``rows_per_rank`` (the largest share of any rank) gets empty rows."""
    if len(indices) > rows_per_rank:
        raise ValueError(f"{len(indices)} samples on this rank exceed rows_per_rank={rows_per_rank}")
    count = -(-rows_per_rank // micro_batch_size)
    rows = -(-rows_per_rank // count)
    padded: list[int | None] = [*indices, *[None] * (count * rows - len(indices))]
    return [padded[start : start + rows] for start in range(0, len(padded), rows)]


def balance_by_tokens(lengths: Sequence[int], ranks: int) -> list[list[int]]:
    """Sample indices per rank: longest first, each to the rank with the fewest tokens so
    far (ties: the lower rank); each rank's list in sample order."""
    loads = [0] * ranks
    shares: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(ranks), key=lambda r: (loads[r], r))
        loads[r] += lengths[i]
        shares[r].append(i)
    return [sorted(s) for s in shares]


def pack_by_tokens(
    indices: Sequence[int], lengths: Sequence[int], max_tokens: int, max_rows: int, multiple: int
) -> list[list[int]]:
    """First-fit decreasing: each sample, longest first, joins the first micro-batch whose
    padded size ``(rows + 1) x round_up(longest, multiple)`` stays within ``max_tokens``
    and rows within ``max_rows``, else opens a new one."""
    bins: list[list[int]] = []
    longest: list[int] = []  # padded length of each bin (its first sample is its longest)
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        for b, members in enumerate(bins):
            if len(members) < max_rows and (len(members) + 1) * longest[b] <= max_tokens:
                members.append(i)
                break
        else:
            bins.append([i])
            longest.append(round_up(max(lengths[i], 2), multiple))
    return bins


def equalize(bins: list[list[int]], count: int) -> Plan:
    """``count`` micro-batches: the one with most rows split in two until there are
    enough; single rows cannot split, so empty micro-batches make up the rest."""
    plan: Plan = [list(b) for b in bins]
    while len(plan) < count:
        widest = max(range(len(plan)), key=lambda b: len(plan[b])) if plan else None
        if widest is None or len(plan[widest]) < 2:
            plan.append([None])
            continue
        rows = plan.pop(widest)
        plan[widest:widest] = [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
    return plan


def token_budget_plan(
    lengths: Sequence[int], rank: int, ranks: int, max_tokens: int, max_rows: int, multiple: int
) -> Plan:
    """This data-parallel rank's plan under a token budget (see the module docstring).
    Every rank computes every rank's packing (cheap), so the counts agree without a
    collective."""
    return token_budget_plans(lengths, ranks, max_tokens, max_rows, multiple)[rank]


def token_budget_plans(lengths: Sequence[int], ranks: int, max_tokens: int, max_rows: int, multiple: int) -> list[Plan]:
    """Every data-parallel rank's :func:`token_budget_plan`."""
    packed = [
        pack_by_tokens(share, lengths, max_tokens, max_rows, multiple) for share in balance_by_tokens(lengths, ranks)
    ]
    count = max(1, *(len(p) for p in packed))
    return [equalize(p, count) for p in packed]


def padded_tokens(plans: Sequence[Plan], lengths: Sequence[int], multiple: int) -> int:
    """The tokens of the plans' micro-batches, each padded to its own longest sample (as
    :func:`moe_rl.trainer.batch.build_train_batch` pads them), empty rows included."""
    return sum(
        len(mb) * round_up(max([lengths[i] for i in mb if i is not None] or [2]), multiple)
        for plan in plans
        for mb in plan
    )


DERIVED_BUDGET = -1  # max_tokens: micro_batch_size samples of the step's mean length
# under the derived budget, rows are taken instead when they make fewer micro-batches and
# pad at most this share more tokens than the packing
ROWS_PADDING_SLACK = 0.25


def derived_budget(lengths: Sequence[int], micro_batch_size: int, multiple: int) -> int:
    """``micro_batch_size`` x the step's mean sample length (rounded up to ``multiple``): as
    many micro-batches as fixed rows would make for samples of equal length, long samples
    in fewer rows, short ones in full rows. Computed from every sample of the step, so
    every data-parallel rank derives the same budget."""
    mean = -(-sum(lengths) // max(len(lengths), 1))
    return micro_batch_size * round_up(max(mean, 2), multiple)


@dataclass(frozen=True)
class MicroBatchPlanner:
    """The run's way of planning micro-batches, chosen once: ``max_tokens`` > 0 packs by
    that token budget, :data:`DERIVED_BUDGET` (-1) by :func:`derived_budget` of each step
    (or by rows, when rows make fewer micro-batches with at most :data:`ROWS_PADDING_SLACK`
    more padded tokens: samples of nearly one length), 0 by rows (``micro_batch_size``
    each, samples in order). Every rank decides alike, from every rank's plans."""

    micro_batch_size: int
    max_tokens: int = DERIVED_BUDGET
    seq_len_multiple: int = 1

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1 or self.max_tokens < DERIVED_BUDGET:
            raise ValueError(
                f"micro_batch_size={self.micro_batch_size} must be >= 1 and max_tokens={self.max_tokens} >= -1"
            )

    def budget(self, lengths: Sequence[int]) -> int:
        """The token budget of a step's micro-batches (0: by rows)."""
        if self.max_tokens == DERIVED_BUDGET:
            return derived_budget(lengths, self.micro_batch_size, self.seq_len_multiple)
        return self.max_tokens

    def plan(self, lengths: Sequence[int]) -> Plan:
        """This data-parallel rank's plan for a step's samples of ``lengths``."""
        from parallel.collectives import data_parallel_position

        rank, size = data_parallel_position()
        budget = self.budget(lengths)
        if not budget:
            return self._rows(lengths, size)[rank]
        packed = token_budget_plans(lengths, size, budget, self.micro_batch_size, self.seq_len_multiple)
        if self.max_tokens == DERIVED_BUDGET:
            rows = self._rows(lengths, size)
            multiple = self.seq_len_multiple
            if len(rows[0]) < len(packed[0]) and padded_tokens(rows, lengths, multiple) <= (
                1 + ROWS_PADDING_SLACK
            ) * padded_tokens(packed, lengths, multiple):
                return rows[rank]
        return packed[rank]

    def _rows(self, lengths: Sequence[int], ranks: int) -> list[Plan]:
        """Every rank's fixed plan: ``micro_batch_size`` rows, samples dealt round robin."""
        rows_per_rank = -(-len(lengths) // ranks)
        return [fixed_plan(range(r, len(lengths), ranks), rows_per_rank, self.micro_batch_size) for r in range(ranks)]
