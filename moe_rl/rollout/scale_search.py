"""Finding the scale at which a measured figure meets its target (the simulated mismatch's
calibration, :mod:`moe_rl.rollout.mismatch`), in as few measurements as possible: each one is a
forward pass over the engine's recent tokens.

The figures (a flip fraction, a KL) grow with the scale roughly as a power of it, so the search
works on ``log figure`` against ``log scale``: a secant step from the last scale (a power-law
guess the first time), then regula falsi (Illinois) inside the bracket once the target is
bracketed, and a measurement within ``tolerance`` of the target ends it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

SCALE_RANGE = (1e-5, 16.0)
MAX_MEASUREMENTS = 12
# a bracket this narrow (relative) ends the search: a figure over finitely many tokens jumps
# where single tokens flip, and no scale between two close ones may hit the target
NARROWEST_BRACKET = math.log(1.02)
EMPTY_STEP = math.log(4.0)  # where the figure is 0 (nothing flipped): 4x the scale


@dataclass(frozen=True)
class Found:
    scale: float
    value: float  # the figure measured there
    measurements: int
    reached: bool  # within tolerance (else: the closest measured, e.g. the range's end)


def solve_scale(
    measure: Callable[[float], float],
    target: float,
    start: float,
    *,
    tolerance: float,
    exponent: float,
    scale_range: tuple[float, float] = SCALE_RANGE,
    max_measurements: int = MAX_MEASUREMENTS,
) -> Found:
    """The scale in ``scale_range`` at which ``measure(scale)`` (non-decreasing in it) is within
    ``tolerance`` (relative) of ``target``; ``exponent``: the guessed power of the growth (1 for a
    flip fraction, 2 for a KL), for the first step. Ends at the closest measurement after
    ``max_measurements`` or once the bracket is narrower than :data:`NARROWEST_BRACKET`, or at
    the range's end when the target lies beyond it."""
    if target <= 0:
        raise ValueError(f"target={target} must be > 0")
    lo_end, hi_end = math.log(scale_range[0]), math.log(scale_range[1])
    x = min(max(math.log(start), lo_end), hi_end) if start > 0 else (lo_end + hi_end) / 2
    below: tuple[float, float] | None = None  # (log scale, log figure - log target) with the figure short
    above: tuple[float, float] | None = None
    best: tuple[float, float, float] | None = None  # (log scale, gap, figure) of the closest
    last_side = 0
    for n in range(1, max_measurements + 1):
        value = measure(math.exp(x))
        gap = math.log(value / target) if value > 0 else -math.inf
        if best is None or abs(gap) < abs(best[1]):
            best = (x, gap, value)
        if abs(gap) <= math.log1p(tolerance):
            return Found(math.exp(x), value, n, True)
        if gap < 0:
            if x >= hi_end:
                return Found(math.exp(x), value, n, False)
            below = (x, gap)
        else:
            if x <= lo_end:
                return Found(math.exp(x), value, n, False)
            above = (x, gap)
        if below is not None and above is not None:  # regula falsi, halving the stale side (Illinois)
            (xb, gb), (xa, ga) = below, above
            side = -1 if gap < 0 else 1
            if side == last_side:
                if side < 0:
                    ga /= 2
                    above = (xa, ga)
                else:
                    gb /= 2
                    below = (xb, gb)
            last_side = side
            if abs(xa - xb) <= NARROWEST_BRACKET:
                break
            x = (xa + xb) / 2 if math.isinf(gb) else xb - gb * (xa - xb) / (ga - gb)
        elif math.isinf(gap):
            x += EMPTY_STEP
        else:
            x -= gap / exponent  # the power-law guess
        x = min(max(x, lo_end), hi_end)
    assert best is not None  # max_measurements >= 1
    return Found(math.exp(best[0]), best[2], n, False)
