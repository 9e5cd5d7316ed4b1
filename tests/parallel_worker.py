"""Worker for the multi-process tests: one rank of a gloo group comparing the sharded policy with one process."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from canopy.models.logprob_head import ChunkedLogprobs, token_logprobs
from canopy.modules.logprobs import model_token_logprobs
from canopy.modules.parallel import (
    ParallelSettings,
    build_parallel_policy,
    data_parallel_rank,
    end_rank,
    gather_on_rank0,
)
from canopy.modules.policy import export_hf_state_dict, iter_hf_weights, load_policy, unwrap
from canopy.objective import canopy_loss

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(module: str, world: int, model_path, dp: int, other: int, out_dir) -> None:
    """`python -m MODULE WORLD PORT MODEL DP OTHER OUT_DIR` from the repository root: `world` gloo ranks, each
    writing `OUT_DIR/rank<r>.json`; fails with the ranks' stderr if any of them failed."""
    command = [sys.executable, "-m", module, str(world), str(free_port()), str(model_path), str(dp), str(other)]
    run = subprocess.run([*command, str(out_dir)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


def spawn_from_argv(main) -> None:
    """The `__main__` of a worker module: spawn `main(rank, world, port, model, dp, other, out_dir)` per rank."""
    world, port, path, dp, other, out = sys.argv[1:7]
    args = (main, int(world), int(port), path, int(dp), int(other), out)
    torch.multiprocessing.spawn(run_rank, args=args, nprocs=int(world))


def run_rank(rank: int, main, *args) -> None:
    """`main(rank, *args)`, then end the process without the interpreter's finalization (`end_rank`, whose
    docstring says why). An exception in `main` still reaches torch's spawn, which reports it."""
    main(rank, *args)
    end_rank()


def batch(vocab: int):
    """Tokens, their aligned targets (the next token; the last position predicts nothing), mask, advantages."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (4, 24), generator=g)
    targets = torch.cat([ids[:, 1:], torch.zeros(4, 1, dtype=ids.dtype)], dim=1)
    mask = torch.cat([(torch.rand(4, 23, generator=g) > 0.3).float(), torch.zeros(4, 1)], dim=1)
    advantages = torch.tensor([1.0, -0.5, 0.3, -0.8])
    return ids, targets, mask, advantages


def loss_and_grads(model, ids, targets, mask, advantages, ref, rows, n_tokens, chunk_tokens=None):
    """Loss and gradients as the module computes them (temperature 0.7, entropy bonus 0.01, so both the
    logprobs and the entropy carry gradient): through the chunked `LogprobHead`, `chunk_tokens` at a time, or with
    `chunk_tokens=None` through whole logits (the unchunked path). Also the vocabulary rows of the head's weight
    this rank scored with and how many DTensors were gathered whole on the way."""
    with (
        mock.patch.object(DTensor, "full_tensor", autospec=True, side_effect=DTensor.full_tensor) as gathered,
        mock.patch.object(ChunkedLogprobs, "apply", side_effect=ChunkedLogprobs.apply) as head,
    ):
        if chunk_tokens is None:
            logprobs, entropy = token_logprobs(model(ids[rows]), targets[rows], 0.7)
        else:
            positions = torch.arange(ids.shape[1]).expand(len(ids[rows]), -1)
            inputs = {"tokens": ids[rows], "positions": positions, "targets": targets[rows]}
            logprobs, entropy = model_token_logprobs(model, inputs, 0.7, chunk_tokens)
    loss, _ = canopy_loss(
        logprobs,
        logprobs.detach(),
        ref[rows],
        advantages[rows],
        mask[rows],
        kl_coef=0.1,
        num_action_tokens=n_tokens,
        clip_low=0.2,
        clip_high=0.2,
        aggregation="token-mean",
    )
    loss = loss - 0.01 * (entropy * mask[rows]).sum() / n_tokens
    loss.backward()
    local_vocab = head.call_args.args[1].shape[0] if head.called else None
    return loss.detach(), local_vocab, gathered.call_count


def main(rank: int, world: int, port: int, path: str, dp: int, tp: int, out: str) -> None:
    """`dp` data-parallel shards, as FSDP (`dp_shard=dp`), or as HSDP when `world` has room for replicas:
    `dp_replicate = world // (dp x tp)` replicas of a `dp`-way sharded model."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    single, single_adapter = load_policy(path)
    ids, targets, mask, advantages = batch(single.config.vocab_size)
    with torch.no_grad():
        ref = token_logprobs(single(ids), targets, 0.7)[0] - 0.05
    full_loss, _, _ = loss_and_grads(single, ids, targets, mask, advantages, ref, slice(None), mask.sum())
    expected = {name: p.grad for name, p in single.named_parameters()}

    settings = ParallelSettings(dp_replicate=world // (dp * tp), dp_shard=dp, tp=tp)
    model, adapter, dims = build_parallel_policy(path, settings, world, torch.device("cpu"))
    dp_rank, dp_size = data_parallel_rank(dims)
    rows = torch.arange(4)[dp_rank::dp_size]
    loss, local_vocab, gathered = loss_and_grads(model, ids, targets, mask, advantages, ref, rows, mask.sum(), 7)
    if dp_size > 1:
        dist.all_reduce(loss, group=dims.get_mesh("batch").get_group())
    # relative to each gradient's scale: max |g - g_ref| / max |g_ref|, per tensor (the worst one named)
    grad_diff, grad_diff_tensor = max(
        (((unwrap(p.grad) - expected[name]).abs().max() / expected[name].abs().max().clamp_min(1e-12)).item(), name)
        for name, p in model.named_parameters()
    )
    # the same step again on the same rank: a race (a collective's buffer read early) would not repeat exactly,
    # float summation order on this machine would (reported with a failure, not asserted)
    first = {name: unwrap(p.grad).clone() for name, p in model.named_parameters()}
    model.zero_grad()
    loss_and_grads(model, ids, targets, mask, advantages, ref, rows, mask.sum(), 7)
    rerun_grad_diff = max((unwrap(p.grad) - first[name]).abs().max().item() for name, p in model.named_parameters())
    with mock.patch.object(DTensor, "full_tensor", autospec=True, side_effect=DTensor.full_tensor) as full_tensor:
        exported = dict(iter_hf_weights(model, adapter, gather_on_rank0))
    expected_export = export_hf_state_dict(single, single_adapter)
    weight_diff = max(
        (unwrap(p.detach()) - dict(single.named_parameters())[name]).abs().max().item()
        for name, p in model.named_parameters()
    )
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(
            {
                "full_loss": full_loss.item(),
                "loss": loss.item(),
                "grad_diff": grad_diff,
                "grad_diff_tensor": grad_diff_tensor,
                "rerun_grad_diff": rerun_grad_diff,
                "machine": f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads",
                "weight_diff": weight_diff,
                "vocab": single.config.vocab_size,
                "local_vocab": local_vocab,
                "full_tensor_calls": gathered,
                "export_diff": max((exported[k] - v).abs().max().item() for k, v in expected_export.items())
                if rank == 0
                else None,
                "export_on_meta": all(t.is_meta for t in exported.values())
                and exported.keys() == expected_export.keys(),
                "export_full_tensor_calls": full_tensor.call_count,
            },
            f,
        )
    dist.barrier()  # no rank tears gloo down while a peer's last collective is in flight
    dist.destroy_process_group()


if __name__ == "__main__":
    spawn_from_argv(main)
