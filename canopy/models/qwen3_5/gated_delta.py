"""Pure-torch Gated DeltaNet kernels (Qwen3.5's linear-attention layers), for where flash-linear-attention's Triton
kernels cannot run (CPU). Differentiable through autograd; checked against transformers' own torch implementation
(tests/test_gated_delta.py). On GPUs the policy keeps TorchTitan's fla kernels.

The gated delta rule, per head, with state S (d_k x d_v), decay g_t <= 0 (log space) and write strength beta_t:

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - (exp(g_t) S_{t-1})^T k_t))^T,      o_t = S_t^T q_t / sqrt(d_k)

with q and k L2-normalized. `chunk_gated_delta_rule` computes it chunk by chunk: inside a chunk the updates are
folded into one unit-lower-triangular solve (the WY form), and only the state crosses chunk boundaries.
"""

import torch
import torch.nn.functional as F


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dimension (fla's and transformers' convention)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _chunk_rule(q, k, v, g, beta, chunk_size: int, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence batch in [B, H, T, d] layout (float32, q already scaled); returns (outputs, final state)."""
    T = q.shape[2]
    pad = (chunk_size - T % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))  # padded steps: no decay, no write, read nothing
    B, H, padded, _ = q.shape
    q, k, v = (x.reshape(B, H, padded // chunk_size, chunk_size, -1) for x in (q, k, v))
    g, beta = (x.reshape(B, H, padded // chunk_size, chunk_size) for x in (g, beta))

    log_decay = g.cumsum(-1)  # Gamma_i: decay from the chunk's start to position i
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # decay from position j to position i (j <= i), zero above the diagonal
    pair_decay = torch.where(causal, log_decay[..., :, None] - log_decay[..., None, :], -torch.inf).exp()
    # the delta rule's coupling of each write to the earlier writes in the chunk: (I + A) is unit lower triangular
    coupling = (beta[..., None] * (k @ k.transpose(-1, -2)) * pair_decay).tril(-1)
    system = coupling + torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    pseudo_values = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    decayed_keys = torch.linalg.solve_triangular(
        system, beta[..., None] * log_decay.exp()[..., None] * k, upper=False, unitriangular=True
    )
    attention = (q @ k.transpose(-1, -2)) * pair_decay  # within the chunk, j <= i
    to_chunk_end = (log_decay[..., -1:] - log_decay).exp()[..., None]  # decay from j to the chunk's end

    outputs = []
    for c in range(q.shape[2]):
        corrected = pseudo_values[:, :, c] - decayed_keys[:, :, c] @ state  # what the old state did not predict
        read_old = (q[:, :, c] * log_decay[:, :, c, :, None].exp()) @ state
        outputs.append(read_old + attention[:, :, c] @ corrected)
        state = (
            log_decay[:, :, c, -1, None, None].exp() * state
            + (k[:, :, c] * to_chunk_end[:, :, c]).transpose(-1, -2) @ corrected
        )
    return torch.stack(outputs, 2).reshape(B, H, padded, -1)[:, :, :T], state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over [B, T, H, d] inputs (g, beta: [B, T, H]; q/k heads repeated to v's when fewer),
    with q and k L2-normalized inside; returns (outputs [B, T, H, d_v], final states [N, H, d_k, d_v]).

    `cu_seqlens` (batch size 1, offsets [0, t_1, ..., T]) restarts the state at each document's start, as fla's
    varlen kernels do; N is then the number of documents. Computes in float32 (float64 for float64 inputs) and
    returns in q's dtype."""
    dtype, repeat = q.dtype, v.shape[2] // q.shape[2]
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, 2), k.repeat_interleave(repeat, 2)
    compute = torch.promote_types(dtype, torch.float32)
    q, k, v, g, beta = (x.transpose(1, 2).to(compute) for x in (q, k, v, g, beta))
    q, k = l2_normalize(q) * q.shape[-1] ** -0.5, l2_normalize(k)
    B, H, _, d_k = q.shape
    spans = [(0, q.shape[2])] if cu_seqlens is None else list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"document offsets need the documents packed in one row, got batch size {B}")
    outputs, states = [], []
    for start, end in spans:
        state = q.new_zeros(B, H, d_k, v.shape[-1]) if initial_state is None else initial_state.to(compute)
        out, state = _chunk_rule(
            q[:, :, start:end],
            k[:, :, start:end],
            v[:, :, start:end],
            g[:, :, start:end],
            beta[:, :, start:end],
            chunk_size,
            state,
        )
        outputs.append(out)
        states.append(state)
    return torch.cat(outputs, 2).transpose(1, 2).to(dtype), torch.cat(states, 0)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution then SiLU over [B, T, D] (weight [D, 1, K] or [D, K]), zero history before each
    row's start, or, with `cu_seqlens` (batch size 1), before each document's start."""
    weight = weight.reshape(weight.shape[0], -1)
    width, T = weight.shape[1], x.shape[1]
    start = torch.zeros(T, dtype=torch.long, device=x.device)
    if cu_seqlens is not None:
        starts = cu_seqlens[:-1].to(x.device)
        start = starts[torch.searchsorted(starts, torch.arange(T, device=x.device), right=True) - 1]
    position_in_document = torch.arange(T, device=x.device) - start
    out = torch.zeros_like(x)
    for shift in range(width):  # out_t = sum_s w[K-1-s] * x_{t-s}, for t - s inside t's document
        shifted = F.pad(x, (0, 0, shift, 0))[:, :T]
        inside = (position_in_document >= shift).to(x.dtype)[None, :, None]
        out = out + shifted * inside * weight[:, width - 1 - shift]
    return F.silu(out)


def transformers_on_torch_kernels() -> None:
    """Make transformers' Qwen3.5 run its own pure-torch kernels. With flash-linear-attention installed it dispatches
    to fla's Triton kernels, which need a GPU; this rebinds its module-level kernels to the torch code they wrap.
    Process-wide: for processes that run HF Qwen3.5 on CPU (the local engine, the tiny-model builder, tests)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    for name in (
        "torch_chunk_gated_delta_rule",
        "torch_recurrent_gated_delta_rule",
        "causal_conv1d_fn",
        "causal_conv1d_update",
    ):
        kernel = getattr(modeling_qwen3_5, name)
        setattr(modeling_qwen3_5, name, getattr(kernel, "__wrapped__", kernel))
