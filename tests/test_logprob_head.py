"""The chunked log-prob/entropy head against full-vocabulary log_softmax (one process;
the vocabulary-parallel path is compared across TP ranks in test_megatron_backend)."""

from __future__ import annotations

import pytest
import torch

from moe_rl.models.logprob_head import LogProbConfig, vocab_parallel_logprobs


@pytest.mark.parametrize("keep_logits_mb", [0.0, 32.0], ids=["recomputed", "kept"])
@pytest.mark.parametrize("chunk_size, temperature", [(1024, 1.0), (3, 0.7), (1, 1.3)])
def test_matches_full_log_softmax_values_and_gradients(chunk_size: int, temperature: float, keep_logits_mb: float) -> None:
    gen = torch.Generator().manual_seed(0)
    s, b, h, v = 7, 2, 5, 11
    hidden = torch.randn(s, b, h, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (s, b), generator=gen)
    cfg = LogProbConfig(temperature=temperature, chunk_size=chunk_size, keep_logits_mb=keep_logits_mb)
    logp, entropy = vocab_parallel_logprobs(hidden, weight, targets, config=cfg)

    logits = (hidden @ weight.t()) / temperature
    ref_logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    ref_entropy = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(entropy, ref_entropy)

    probe = torch.randn(s, b, generator=gen, dtype=torch.float64)
    ours = torch.autograd.grad((logp * probe).sum() + (entropy * probe).sum(), (hidden, weight))
    refs = torch.autograd.grad((ref_logp * probe).sum() + (ref_entropy * probe).sum(), (hidden, weight))
    for a, r in zip(ours, refs):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("keep_logits_mb, keeps_logits", [(0.0, False), (32.0, True)])
def test_small_chunks_keep_their_logits_for_backward(keep_logits_mb: float, keeps_logits: bool) -> None:
    s, b, h, v = 6, 2, 4, 50
    hidden = torch.randn(s, b, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    saved: list[int] = []

    def pack(tensor):
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        vocab_parallel_logprobs(hidden, weight, torch.randint(0, v, (s, b)), config=LogProbConfig(keep_logits_mb=keep_logits_mb))
    assert (max(saved) >= s * b * v) is keeps_logits  # a [s, b, v] logits-sized tensor kept, or none (recomputed)
