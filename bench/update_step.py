"""Update-phase cost of the strictly on-policy fast path against recomputing old logprobs, and of each opt-in
rollout correction against none.

With one optimizer step per rollout batch the behaviour policy IS the current policy, so old logprobs are the
detached current ones (Appendix C) and no extra forward pass is needed. A rollout correction
(`canopy/mismatch.py`) adds elementwise work on the engine's logprobs. This times every variant of the update
phase (forward, CANOPY loss, backward) on the same batch in one process and prints ratios to the fast path.

    python bench/update_step.py [--hidden-size 256 --layers 4 --batch 16 --seq-len 512 --repeats 5]
"""

import argparse
import statistics
import tempfile
import time

import torch

from canopy.mismatch import CORRECTIONS, RolloutCorrection, sequence_log_ratio
from canopy.modules.logprobs import model_token_logprobs
from canopy.modules.policy import load_policy
from canopy.objective import canopy_loss
from canopy.tools.tiny_model import build_tiny_checkpoint

RECIPE = dict(clip_low=0.2, clip_high=0.2, kl_coef=1e-4, aggregation="token-mean")  # algorithm.* of conf/train.yaml


def logprobs_of(policy, input_ids: torch.Tensor) -> torch.Tensor:
    """The trainer's logprobs (decoder, then its chunked `LogprobHead`), of each token as its own target."""
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    inputs = {"tokens": input_ids, "positions": positions, "targets": input_ids}
    return model_token_logprobs(policy, inputs, 1.0, chunk_tokens=2048)[0]


def update(policy, batch: dict, recompute_old: bool = False, correction: RolloutCorrection | None = None) -> None:
    input_ids, mask = batch["input_ids"], batch["mask"]
    if recompute_old:
        with torch.no_grad():
            old = logprobs_of(policy, input_ids)
    logprobs = logprobs_of(policy, input_ids)
    old = old if recompute_old else logprobs.detach()
    weights = None
    if correction is not None:
        log_ratio = torch.where(mask.bool(), old - batch["engine_logprobs"], 0.0)
        ratio, _ = sequence_log_ratio(log_ratio.sum(-1), mask.sum(-1))
        weights, _ = correction.weights(log_ratio, ratio)
    loss, _ = canopy_loss(logprobs, old, batch["ref_logprobs"], batch["advantages"], mask, pg_weights=weights, **RECIPE)
    loss.backward()
    policy.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_checkpoint(f"{tmp}/model", hidden_size=args.hidden_size, layers=args.layers)
        policy, _ = load_policy(path)
    vocab = policy.config.vocab_size
    input_ids = torch.randint(0, vocab, (args.batch, args.seq_len))
    with torch.no_grad():
        current = logprobs_of(policy, input_ids)
    batch = {
        "input_ids": input_ids,
        "mask": (torch.rand(args.batch, args.seq_len) < 0.5).float(),
        "ref_logprobs": torch.full((args.batch, args.seq_len), -3.0),
        "engine_logprobs": current + 0.02 * torch.randn_like(current),  # a bf16-sized engine-trainer gap
        "advantages": torch.randn(args.batch),
    }
    variants = {
        "on-policy fast path (detached old logprobs)": dict(),
        "recompute old logprobs (extra forward)": dict(recompute_old=True),
        **{f"rollout correction {mode}": dict(correction=RolloutCorrection(mode)) for mode in CORRECTIONS[1:]},
    }
    times = {name: [] for name in variants}
    update(policy, batch, recompute_old=True)  # warm-up
    for _ in range(args.repeats):
        for name, kwargs in variants.items():  # interleaved, so drift in machine load hits every variant alike
            started = time.perf_counter()
            update(policy, batch, **kwargs)
            times[name].append(time.perf_counter() - started)
    print(
        f"model: hidden {args.hidden_size}, {args.layers} layers; batch {args.batch} x {args.seq_len} tokens; "
        f"median of {args.repeats}"
    )
    baseline = statistics.median(times["on-policy fast path (detached old logprobs)"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<46} {median * 1e3:8.1f} ms   {median / baseline:.2f}x")


if __name__ == "__main__":
    main()
