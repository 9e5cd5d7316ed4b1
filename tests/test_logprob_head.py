"""The chunked logprob head (`canopy.models.logprob_head`) against the unchunked path it replaces: values,
entropies and gradients equal in float32 (1e-6), for any chunk size, on raw tensors and through the policy; in
float64 its backward passes gradcheck. TP and CP: tests/test_parallel.py and tests/test_context_parallel.py run the
chunked head on vocabulary-sharded weights and on each CP rank's positions against one process."""

import pytest
import torch

from canopy.models.logprob_head import chunked_token_logprobs, token_logprobs
from canopy.modules.logprobs import model_token_logprobs
from canopy.modules.policy import load_policy


def relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def head_case(tokens=300, dim=32, vocab=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, dim, generator=g)
    weight = torch.randn(vocab, dim, generator=g) / dim**0.5
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    upstream = torch.randn(2, tokens, generator=g)  # gradients arriving at the logprobs and at the entropies
    return hidden, weight, targets, upstream


def values_and_grads(fn, hidden, weight, targets, upstream):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    chosen, entropy = fn(hidden, weight, targets)
    (chosen * upstream[0] + entropy * upstream[1]).sum().backward()
    return chosen.detach(), entropy.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("chunk", [64, 97, 300, 4096], ids=["64", "97 (uneven)", "one chunk", "chunk > tokens"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_head_equals_whole_logits(chunk, temperature):
    case = head_case()
    expected = values_and_grads(lambda h, w, t: token_logprobs(h @ w.T, t, temperature), *case)
    got = values_and_grads(lambda h, w, t: chunked_token_logprobs(h, w, t, temperature, chunk), *case)
    for name, a, b in zip(("logprobs", "entropy", "hidden grad", "weight grad"), got, expected, strict=True):
        assert relative_diff(a, b) < 1e-6, name


def test_chunked_head_gradcheck_in_float64():
    hidden, weight, targets, _ = head_case(tokens=20, dim=6, vocab=40)
    inputs = (hidden.double().requires_grad_(), weight.double().requires_grad_())
    assert torch.autograd.gradcheck(lambda h, w: chunked_token_logprobs(h, w, targets, 0.7, 7), inputs)


def test_chunked_head_in_bfloat16_stays_within_bfloat16_rounding():
    """bf16 hidden states and weight (FSDP's compute dtype): the logits are formed in bf16 and reduced in float32,
    as the unchunked path does; the weight gradient is accumulated over chunks in float32."""
    hidden, weight, targets, upstream = head_case(tokens=512, dim=64, vocab=2000)
    expected = values_and_grads(lambda h, w, t: token_logprobs(h @ w.T, t, 0.7), hidden, weight, targets, upstream)
    low = values_and_grads(
        lambda h, w, t: chunked_token_logprobs(h, w, t, 0.7, 100),
        hidden.bfloat16(),
        weight.bfloat16(),
        targets,
        upstream,
    )
    assert low[0].dtype == torch.float32 and low[3].dtype == torch.bfloat16
    for name, a, b in zip(("logprobs", "entropy", "hidden grad", "weight grad"), low, expected, strict=True):
        assert relative_diff(a.float(), b) < 0.03, name


def test_policy_logprobs_through_the_head_equal_the_logits_path(tiny_path):
    """The trainer's path (decoder hidden states, then the model's `LogprobHead` chunk by chunk) against today's
    unchunked one (the model's logits, then `token_logprobs`): values and every parameter's gradient."""
    ids = torch.randint(0, 40, (3, 37), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(ids, -1, 1)
    inputs = {"tokens": ids, "positions": torch.arange(37).expand(3, -1), "targets": targets}

    def run(chunked: bool):
        model, _ = load_policy(tiny_path)
        if chunked:
            with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
                chosen, entropy = model_token_logprobs(model, inputs, 0.7, chunk_tokens=16)
        else:
            chosen, entropy = token_logprobs(model(ids), targets, 0.7)
        (chosen.sum() - 0.3 * entropy.sum()).backward()
        return chosen.detach(), entropy.detach(), {n: p.grad for n, p in model.named_parameters()}

    saved: list[torch.Tensor] = []
    whole, chunked = run(False), run(True)
    assert relative_diff(chunked[0], whole[0]) < 1e-6 and relative_diff(chunked[1], whole[1]) < 1e-6
    for name, grad in whole[2].items():
        assert relative_diff(chunked[2][name], grad) < 1e-6, name
    vocab = whole[2]["lm_head.weight"].shape[0]
    assert saved and all(t.shape[-1] != vocab for t in saved if t.dim() >= 2), "logits were saved for backward"


def test_a_plain_model_call_still_gives_logits(tiny_path):
    """The head skips the projection only inside `model_token_logprobs`: a plain call returns logits after it."""
    model, _ = load_policy(tiny_path)
    ids = torch.randint(0, 40, (2, 9))
    with torch.no_grad():
        model_token_logprobs(model, {"tokens": ids, "positions": torch.arange(9).expand(2, -1), "targets": ids}, 1.0, 4)
        assert model(ids).shape == (2, 9, model.config.vocab_size)


def test_reference_forward_saves_nothing_for_backward():
    """Under no_grad (the frozen reference) the head returns plain tensors and keeps nothing alive."""
    hidden, weight, targets, _ = head_case()
    with torch.no_grad():
        chosen, entropy = chunked_token_logprobs(hidden, weight, targets, 1.0, 64)
    assert chosen.grad_fn is None and entropy.grad_fn is None
    expected, _ = token_logprobs(hidden @ weight.T, targets, 1.0)
    assert relative_diff(chosen, expected) < 1e-6


def test_head_never_forms_more_than_a_chunk_of_logits(monkeypatch):
    """Every tensor the head's forward and backward create has at most `chunk` rows of vocabulary width."""
    hidden, weight, targets, upstream = head_case(tokens=400, dim=16, vocab=3000)
    widest = []
    real_matmul = torch.Tensor.__matmul__

    def recording_matmul(a, b):
        out = real_matmul(a, b)
        if out.shape[-1] == weight.shape[0]:
            widest.append(out.shape[0])
        return out

    monkeypatch.setattr(torch.Tensor, "__matmul__", recording_matmul)
    values_and_grads(lambda h, w, t: chunked_token_logprobs(h, w, t, 1.0, 50), hidden, weight, targets, upstream)
    assert widest and max(widest) == 50
    assert len(widest) == 2 * 400 // 50  # each chunk's logits formed twice: forward, and recomputed in backward
