"""The chunked log-prob/entropy head against full-vocabulary log_softmax (one process;
the vocabulary-parallel path is compared across TP ranks in test_megatron_backend)."""

from __future__ import annotations

import pytest
import torch

from moe_rl.models.logprob_head import LogProbConfig, vocab_parallel_logprobs


@pytest.mark.parametrize("keep_logits_mb", [0.0, 32.0], ids=["recomputed", "kept"])
@pytest.mark.parametrize("chunk_size, temperature", [(1024, 1.0), (3, 0.7), (1, 1.3)])
def test_matches_full_log_softmax_values_and_gradients(
    chunk_size: int, temperature: float, keep_logits_mb: float
) -> None:
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
        vocab_parallel_logprobs(
            hidden, weight, torch.randint(0, v, (s, b)), config=LogProbConfig(keep_logits_mb=keep_logits_mb)
        )
    assert (max(saved) >= s * b * v) is keeps_logits  # a [s, b, v] logits-sized tensor kept, or none (recomputed)


def test_a_chunk_holds_its_token_budget_whatever_the_rows() -> None:
    """``chunk_size`` counts tokens over the micro-batch's rows: 4 rows and a budget of 8
    take 2 positions a chunk (a budget of positions alone would hold 4x the logits)."""
    s, b, h, v = 6, 4, 4, 50
    hidden = torch.randn(s, b, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    targets = torch.randint(0, v, (s, b))
    saved: list[int] = []

    def pack(tensor):
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = vocab_parallel_logprobs(hidden, weight, targets, config=LogProbConfig(chunk_size=8))
    assert max(saved) == 8 * v  # the kept chunk's logits: 2 positions x 4 rows
    reference = torch.log_softmax(hidden @ weight.t(), -1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(logp, reference)


def test_bf16_activations_get_fp32_logits() -> None:
    """bf16 hidden states and weights: the log-probs are those of the fp32 product of the
    same bf16 values (not of logits rounded to bf16: steps of 0.125 at 16-32)."""
    gen = torch.Generator().manual_seed(0)
    s, b, h, v = 16, 2, 64, 97
    hidden = (3 * torch.randn(s, b, h, generator=gen)).to(torch.bfloat16)
    weight = (0.5 * torch.randn(v, h, generator=gen)).to(torch.bfloat16)
    targets = torch.randint(0, v, (s, b), generator=gen)
    logp, _ = vocab_parallel_logprobs(hidden, weight, targets)
    exact = torch.log_softmax(hidden.double() @ weight.double().t(), -1).gather(-1, targets[..., None]).squeeze(-1)
    rounded = torch.log_softmax((hidden @ weight.t()).double(), -1).gather(-1, targets[..., None]).squeeze(-1)
    assert logp.dtype == torch.float32
    assert (logp.double() - exact).abs().max() < 1e-4
    assert (rounded - exact).abs().max() > 1e-2  # what bf16 logits would have cost


@pytest.mark.parametrize("cuda_path", [False, True], ids=["upcast", "fp32_output_matmul"])
def test_bf16_logits_backward_is_the_matmul_gradient(monkeypatch, cuda_path: bool) -> None:
    """The backward of both fp32-logits paths against autograd of the same product in fp64
    (the CUDA path's forward, ``torch.mm(out_dtype=fp32)``, runs on CUDA only: its
    backward is called by hand), for a weight without megatron's ``main_grad``."""
    from types import SimpleNamespace

    from moe_rl.models import logprob_head

    assert not logprob_head.has_fp32_output_matmul("cpu", torch.bfloat16)  # so the CPU upcasts
    monkeypatch.setattr(logprob_head, "has_fp32_output_matmul", lambda device_type, dtype: cuda_path)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 4, generator=gen).to(torch.bfloat16)
    weight = torch.randn(5, 4, generator=gen).to(torch.bfloat16)
    grad = torch.randn(6, 5, generator=gen)
    ctx = SimpleNamespace(saved_tensors=(hidden, weight), weight_param=weight, needs_input_grad=(True, True, False))
    ours = logprob_head._Fp32Logits.backward(ctx, grad)[:2]
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    grad64 = grad.to(torch.bfloat16).double() if cuda_path else grad.double()
    refs = torch.autograd.grad((h64 @ w64.t() * grad64).sum(), (h64, w64))
    for a, r in zip(ours, refs):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.double(), r, rtol=1e-2, atol=1e-2)


def test_chunks_sum_the_output_weight_gradient_in_fp32_into_main_grad() -> None:
    """With megatron DDP's attributes on a bf16 weight (the DDP run itself is in
    test_layer_modules), every chunk adds its fp32 product to ``main_grad``, one chunk hands
    autograd a dummy, and a recomputed (checkpointed) chunk does the same."""
    gen = torch.Generator().manual_seed(2)
    s, b, h, v = 9, 2, 8, 13
    hidden = torch.randn(s, b, h, generator=gen).to(torch.bfloat16)
    targets = torch.randint(0, v, (s, b), generator=gen)
    w64 = torch.randn(v, h, generator=gen).to(torch.bfloat16).double().requires_grad_(True)
    torch.log_softmax(hidden.double() @ w64.t(), -1).gather(-1, targets[..., None]).sum().backward()
    for keep_logits_mb in (0.0, 32.0):
        weight = torch.nn.Parameter(w64.detach().to(torch.bfloat16))
        weight.main_grad, weight.grad_added_to_main_grad = torch.zeros(v, h), False
        weight.zero_out_wgrad = True  # so the dummy autograd gets is zeros, and countable
        cfg = LogProbConfig(chunk_size=2, keep_logits_mb=keep_logits_mb)
        vocab_parallel_logprobs(hidden, weight, targets, config=cfg)[0].sum().backward()
        assert weight.grad_added_to_main_grad
        torch.testing.assert_close(weight.main_grad.double(), w64.grad, rtol=1e-5, atol=1e-6)
        assert torch.equal(weight.grad, torch.zeros_like(weight))
