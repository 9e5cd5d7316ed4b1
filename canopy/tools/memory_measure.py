"""Measured memory of a piece of work, to hold the memory plan (`canopy.memory`) and the benchmarks to reality.

On CUDA: the caching allocator's own counters (`max_memory_allocated`). On CPU, where torch keeps no such counter,
the profiler's allocation events: every allocation and free torch makes, in order, summed into the live total.
Both report bytes above what was allocated when the work started, so tensors that exist before (parameters) are
not counted and must be added by the caller.
"""

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Measured:
    peak: int  # the most bytes allocated at any moment of the work, above its start
    end: int  # bytes still allocated when it returned (what it created and kept), above its start


def measure(work: Callable[[], object], device: torch.device | str = "cpu") -> tuple[object, Measured]:
    """Run `work()` and measure its allocations on `device`; returns its result (kept alive, so that what it
    returns counts in `end`) and the measurement."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = work()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - start
        return result, Measured(peak=peak, end=torch.cuda.memory_allocated(device) - start)
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = work()
    sizes = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            sizes.append((node.start_time_ns, node.extra_fields.alloc_size))  # negative for a free
        stack.extend(node.children)
    live = peak = 0
    for _, size in sorted(sizes, key=lambda event: event[0]):
        live += size
        peak = max(peak, live)
    return result, Measured(peak=peak, end=live)


def qwen3_config(hidden, intermediate, heads, kv_heads, head_dim, layers, vocab, **extra) -> dict:
    """config.json of a random Qwen3 of this shape (for `measure_training_step` and the plan); `extra` overrides."""
    shape = dict(
        model_type="qwen3",
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_hidden_layers=layers,
        vocab_size=vocab,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    return shape | extra


def qwen3_5_config(
    hidden, intermediate, layers, vocab, heads=4, kv_heads=2, head_dim=16, linear_heads=(2, 4, 16), **extra
) -> dict:
    """config.json of a random Qwen3.5 text model: Qwen3's attention and FFN shapes, with three Gated DeltaNet layers
    to each full-attention one; `linear_heads` = (key heads, value heads, head dim) of the Gated DeltaNet; `extra`
    overrides."""
    key_heads, value_heads, linear_dim = linear_heads
    gated_delta = dict(
        model_type="qwen3_5_text",
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=linear_dim,
        linear_value_head_dim=linear_dim,
        linear_conv_kernel_dim=4,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    return qwen3_config(hidden, intermediate, heads, kv_heads, head_dim, layers, vocab) | gated_delta | extra


def measure_training_step(
    hf: dict,
    layout,
    rows: int,
    seq_len: int,
    seed: int = 0,
    device: str = "cpu",
    autocast: torch.dtype | None = None,
    repeats: int = 1,
) -> dict[str, float]:
    """Bytes of one single-process training step on `device`, term by term as the memory plan names them, from a
    randomly initialized model of config.json `hf` (policy and frozen reference, `layout`'s checkpointing, micro-
    batch and head chunk) on `rows` random sequences of `seq_len` tokens: weights, reference, gradients and
    optimizer from the tensors themselves; activations (what one micro-batch's forward keeps) and the logprob head's
    working set measured alone; `peak` for a whole steady-state step (the second: AdamW's moments exist); and
    `step seconds`, the median of `repeats` steady-state steps. `autocast` runs the steps' compute in that dtype
    over float32 weights (the plan's single process computes in float32)."""
    from canopy.build import build_module
    from canopy.config import compose_config
    from canopy.modules.logprobs import model_token_logprobs, sequence_inputs
    from canopy.modules.parallel import apply_activation_checkpointing
    from canopy.step import RolloutBatch

    torch.manual_seed(seed)
    cfg = compose_config(
        ["algorithm.kl_coef=0.1", f"trainer.micro_batch_tokens={layout.micro_batch_tokens}",
         f"trainer.logprob_chunk_tokens={layout.logprob_chunk_tokens}"]
    )  # fmt: skip
    module = build_module(cfg, "unused")
    module.policy = apply_activation_checkpointing(_random_model(hf, device), layout.activation_checkpointing)
    module.reference = _random_model(hf, device).requires_grad_(False).eval()
    module.manual_backward = lambda loss: loss.backward()
    optimizer = torch.optim.AdamW(module.policy.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(seed)
    vocab = module.policy.lm_head.weight.shape[0]
    action = torch.rand(rows, seq_len, generator=g) > 0.3
    batch = RolloutBatch(
        torch.randint(0, vocab, (rows, seq_len), generator=g).to(device),
        action.to(device),
        (-torch.rand(rows, seq_len, generator=g) * action).to(device),
        torch.where(action, 0, -1).to(device),
        torch.randn(rows, generator=g).to(device),
        torch.full((rows,), seq_len, device=device),
        {},
    )
    compute = torch.autocast(torch.device(device).type, dtype=autocast, enabled=autocast is not None)

    def step() -> None:
        with compute:
            micro_batches = module._micro_batches(batch)
            ref_logprobs = module._logprobs_no_grad(module.reference, batch, micro_batches)
            module._minibatch_backward(batch, torch.arange(rows), ref_logprobs, None)
        optimizer.step()

    step()  # the first step creates AdamW's moments
    measured = {
        "weights": sum(p.nbytes for p in module.policy.parameters()),
        "reference": sum(p.nbytes for p in module.reference.parameters()),
        "gradients": sum(p.grad.nbytes for p in module.policy.parameters()),
        "optimizer": sum(t.nbytes for state in optimizer.state.values() for t in state.values() if t.dim()),
    }
    optimizer.zero_grad(set_to_none=True)
    _, whole_step = measure(step, device)
    measured["peak"] = measured["weights"] + measured["reference"] + measured["optimizer"] + whole_step.peak
    seconds = []
    for _ in range(repeats):
        optimizer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        step()
        _synchronize(device)
        seconds.append(time.perf_counter() - start)
    measured["step seconds"] = statistics.median(seconds)

    optimizer.zero_grad(set_to_none=True)
    micro = batch.select(module._micro_batches(batch)[0][0])
    inputs = sequence_inputs(micro)
    t = layout.logprob_chunk_tokens
    with compute:
        logprobs, forward = measure(lambda: model_token_logprobs(module.policy, inputs, 1.0, t), device)
    measured["activations"] = forward.end
    del logprobs  # frees the activations before the head is measured

    width = module.policy.lm_head.weight.shape[1]
    hidden = torch.randn(inputs["tokens"].numel(), width, device=device, requires_grad=True)
    targets = inputs["targets"].reshape(-1)

    def head_step() -> None:
        with compute:
            chosen, entropy = module.policy.lm_head(hidden, targets, 1.0, t)
        (chosen - 0.1 * entropy).sum().backward()

    _, head = measure(head_step, device)
    measured["logprob head"] = head.peak - module.policy.lm_head.weight.grad.nbytes  # its gradient: "gradients"
    return measured


def _synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _random_model(hf: dict, device: str = "cpu") -> torch.nn.Module:
    """The TorchTitan model of config.json `hf`, randomly initialized on `device` in float32 (no checkpoint)."""
    from canopy.modules.policy import build_model

    model = build_model(hf, device)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02)
    return model
