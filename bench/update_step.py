"""Update-phase cost of the strictly on-policy fast path against recomputing old logprobs.

With one optimizer step per rollout batch the behaviour policy IS the current policy, so old logprobs are the
detached current ones (Appendix C) and no extra forward pass is needed. This times both variants of the update
phase (forward, CANOPY loss, backward) on the same batch in one process and prints the ratio.

    python bench/update_step.py [--hidden-size 256 --layers 4 --batch 16 --seq-len 512 --repeats 5]
"""

import argparse
import statistics
import tempfile
import time

import torch

from canopy.modules.logprobs import token_logprobs
from canopy.modules.policy import load_policy
from canopy.objective import canopy_loss
from canopy.tools.tiny_model import build_tiny_checkpoint


def update(policy, input_ids, mask, ref_logprobs, advantages, recompute_old: bool) -> None:
    if recompute_old:
        with torch.no_grad():
            old, _ = token_logprobs(policy(input_ids), input_ids, 1.0)
    logprobs, _ = token_logprobs(policy(input_ids), input_ids, 1.0)
    loss, _ = canopy_loss(logprobs, old if recompute_old else logprobs.detach(), ref_logprobs, advantages, mask)
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
    mask = (torch.rand(args.batch, args.seq_len - 1) < 0.5).float()
    ref_logprobs = torch.full((args.batch, args.seq_len - 1), -3.0)
    advantages = torch.randn(args.batch)

    times = {False: [], True: []}
    update(policy, input_ids, mask, ref_logprobs, advantages, recompute_old=True)  # warm-up
    for _ in range(args.repeats):
        for recompute in (False, True):  # interleaved, so drift in machine load hits both alike
            started = time.perf_counter()
            update(policy, input_ids, mask, ref_logprobs, advantages, recompute)
            times[recompute].append(time.perf_counter() - started)
    fast, slow = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"model: hidden {args.hidden_size}, {args.layers} layers; batch {args.batch} x {args.seq_len} tokens; "
        f"median of {args.repeats}"
    )
    print(f"on-policy fast path (detached old logprobs): {fast * 1e3:8.1f} ms")
    print(f"recompute old logprobs (extra forward):     {slow * 1e3:8.1f} ms")
    print(f"ratio recompute / fast path: {slow / fast:.2f}x")


if __name__ == "__main__":
    main()
