"""Per-step logging on rank 0: TensorBoard scalars (and the routing tags), a
``metrics.jsonl`` copy, and a progress bar with step, reward and ETA."""

from __future__ import annotations

import json
from pathlib import Path

from torch import Tensor


class StepLogger:
    def __init__(self, run_dir: Path, total_steps: int, start_step: int, *, enabled: bool, progress: bool = True) -> None:
        self.enabled = enabled
        self.writer = self.bar = self.jsonl = None
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        self.jsonl = open(run_dir / "metrics.jsonl", "a")
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc=run_dir.name, unit="step", dynamic_ncols=True)

    def log(self, step: int, scalars: dict[str, float], routing: dict[str, dict[str, Tensor]], histograms: dict[str, Tensor] | None = None) -> None:
        """``histograms`` (e.g. per-token log-ratios) come from this rank's share of the batch."""
        if not self.enabled:
            return
        from moe_rl.routing.tensorboard import log_routing

        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        for tag, values in (histograms or {}).items():
            if values.numel():
                self.writer.add_histogram(tag, values.float(), step)
        written = {}
        prefixes = {"old_vs_new": "routing", "train_vs_rollout": "routing/train_vs_rollout", "replayed": "routing/replayed"}
        for group, prefix in prefixes.items():
            if group in routing:
                metrics = dict(routing[group])
                if group == "old_vs_new" and "load" in routing:
                    metrics.update(routing["load"])
                written.update(log_routing(self.writer, step, metrics, prefix=prefix, images=step % 10 == 0))
        if "load" in routing and "old_vs_new" not in routing:
            written.update(log_routing(self.writer, step, routing["load"], images=step % 10 == 0))
        self.writer.flush()
        self.jsonl.write(json.dumps({"step": step, **scalars, **written}) + "\n")
        self.jsonl.flush()
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{scalars.get('reward/total', 0.0):.3f}", loss=f"{scalars.get('train/loss', 0.0):.3f}")

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        self.writer.close()
        self.jsonl.close()
