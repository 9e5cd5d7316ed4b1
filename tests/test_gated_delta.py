"""The pure-torch Gated DeltaNet kernels (canopy/models/qwen3_5/gated_delta.py) against transformers' Qwen3.5 torch
implementation: outputs, final states and gradients, whole, chunked across boundaries, and per document."""

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from canopy.models.qwen3_5.gated_delta import causal_conv1d, chunk_gated_delta_rule

# transformers' own torch code, not the fla kernels it dispatches to once fla is installed (they need a GPU)
torch_chunk_gated_delta_rule = hf.torch_chunk_gated_delta_rule.__wrapped__
torch_recurrent_gated_delta_rule = hf.torch_recurrent_gated_delta_rule.__wrapped__
causal_conv1d_fn = hf.causal_conv1d_fn.__wrapped__


def inputs(batch=2, length=37, k_heads=2, v_heads=4, d_k=8, d_v=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, k_heads, d_k, generator=g, dtype=dtype)
    k = torch.randn(batch, length, k_heads, d_k, generator=g, dtype=dtype)
    v = torch.randn(batch, length, v_heads, d_v, generator=g, dtype=dtype)
    decay = -torch.rand(batch, length, v_heads, generator=g, dtype=dtype) * 2  # log space, <= 0
    beta = torch.rand(batch, length, v_heads, generator=g, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v, decay, beta)]


@pytest.mark.parametrize("chunk_size", [64, 8, 5])
def test_chunked_rule_matches_transformers(chunk_size):
    """Longer than one chunk, not a multiple of it, with grouped heads (4 value heads read 2 key heads)."""
    ours_in, theirs_in = inputs(), inputs()
    ours, ours_state = chunk_gated_delta_rule(*ours_in, chunk_size=chunk_size)
    theirs, theirs_state = torch_chunk_gated_delta_rule(
        *theirs_in, chunk_size=16, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    recurrent, _ = torch_recurrent_gated_delta_rule(*inputs(), use_qk_l2norm_in_kernel=True)
    assert ours.dtype == torch.float64 and ours.shape == (2, 37, 4, 6)
    # transformers computes in float32 whatever the input dtype, so this is float32-tight
    assert torch.allclose(ours, theirs.double(), atol=1e-5) and torch.allclose(ours, recurrent.double(), atol=1e-5)
    assert torch.allclose(ours_state, theirs_state.double(), atol=1e-5)
    weights = torch.randn(ours.shape, generator=torch.Generator().manual_seed(1), dtype=ours.dtype)
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    for name, a, b in zip("q k v g beta".split(), ours_in, theirs_in):
        assert torch.allclose(a.grad, b.grad, atol=1e-4, rtol=1e-4), name


def test_chunked_rule_gradients_are_exact_in_float64():
    args = inputs(batch=1, length=11, k_heads=1, v_heads=2, d_k=3, d_v=2)
    assert torch.autograd.gradcheck(lambda *a: chunk_gated_delta_rule(*a, chunk_size=4)[0], args)


def test_documents_restart_the_state():
    """With document offsets (one packed row), each document is computed as if alone, from a zero state."""
    q, k, v, decay, beta = (x.detach() for x in inputs(batch=1, length=30))
    offsets = torch.tensor([0, 7, 19, 30])
    packed, states = chunk_gated_delta_rule(q, k, v, decay, beta, chunk_size=8, cu_seqlens=offsets)
    assert states.shape == (3, 4, 8, 6)
    for d, (start, end) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        alone, state = chunk_gated_delta_rule(*(x[:, start:end] for x in (q, k, v, decay, beta)), chunk_size=8)
        assert torch.allclose(packed[:, start:end], alone, atol=1e-12) and torch.allclose(states[d], state[0])


def test_causal_conv_matches_transformers_and_resets_per_document():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 13, 10, generator=g, dtype=torch.float64)
    weight = torch.randn(10, 1, 4, generator=g, dtype=torch.float64)
    theirs = causal_conv1d_fn(x.transpose(1, 2), weight.squeeze(1), activation="silu").transpose(1, 2)
    assert torch.allclose(causal_conv1d(x, weight), theirs, atol=1e-12)
    packed = causal_conv1d(x.reshape(1, 26, 10), weight, cu_seqlens=torch.tensor([0, 13, 26]))
    assert torch.allclose(packed.reshape(2, 13, 10), theirs, atol=1e-12)
