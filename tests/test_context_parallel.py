"""Context parallel, the CANOPY-specific part, on CPU: targets aligned with inputs before any sharding, and the
training step's sequence-sharded data path (padding, head-tail `cp_shard`, positions, per-rank terms over the global
N, FSDP's summed gradients over dp_shard x cp, reference logprobs gathered whole, metrics reduced over dp and cp).

SDPA's context-parallel dispatch has no CPU sharding rule, so the multi-process tests replace the attention with a
position-wise stand-in (each position's output depends on its own q, k, v only, RoPE included); the ring attention
itself is left to `scripts/gpu_check_parallel.py` on GPUs.
"""

import json
import os
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.models.common.attention import ScaledDotProductAttention

from canopy.errors import ConfigError
from canopy.modules.canopy_module import CanopyModule
from canopy.modules.logprobs import sequence_inputs
from canopy.modules.parallel import ParallelSettings, all_reduce_sum, build_parallel_policy, data_parallel_rank
from canopy.modules.policy import load_policy, unwrap
from canopy.objective import canopy_loss
from canopy.step import RolloutBatch
from tests.helpers import canopy_module
from tests.parallel_worker import run_ranks, spawn_from_argv

ROOT = Path(__file__).resolve().parents[1]
HPARAMS = dict(kl_coef=0.1, entropy_coef=0.01, temperature=0.7, micro_batch_tokens=45, logprob_chunk_tokens=7)


def rollout_batch(vocab: int) -> RolloutBatch:
    """Right-padded rows of decreasing, odd lengths (so CP pads them), with action spans and engine logprobs."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([21, 19, 17, 13, 9, 6])
    ids = torch.randint(1, vocab, (6, 21), generator=g)
    action = (torch.rand(6, 21, generator=g) > 0.4) & (torch.arange(21) >= 3)
    engine = -torch.rand(6, 21, generator=g) * action
    for row, length in enumerate(lengths.tolist()):
        ids[row, length:], action[row, length:], engine[row, length:] = 0, False, 0.0
    versions = torch.where(action, 0, -1)
    return RolloutBatch(ids, action, engine, versions, torch.tensor([1.0, -0.5, 0.3, -0.8, 1.2, -1.0]), lengths, {})


def position_wise_attention(self, q, k, v, **kwargs):
    """Stands in for SDPA: out[t] = q[t] * sigmoid(k[t]) + v[t] (KV heads repeated), all of q, k, v after RoPE."""
    q, k, v = (x.to_local() if isinstance(x, DTensor) else x for x in (q, k, v))
    repeat = q.shape[2] // k.shape[2]
    return q * torch.sigmoid(k.repeat_interleave(repeat, 2)) + v.repeat_interleave(repeat, 2)


def step_backward(module: CanopyModule, full: RolloutBatch, order: torch.Tensor | None = None):
    """The training step's data path up to the optimizer: this rank's rows, the reference's logprobs, and one
    strictly on-policy minibatch (rows in shuffled `order`) accumulated micro-batch by micro-batch."""
    dp_rank, dp_size = data_parallel_rank(module.parallel_dims)
    rows = torch.arange(len(full.lengths))[dp_rank::dp_size]
    batch = full.select(rows)
    ref = module._logprobs_no_grad(module.reference, batch, module._micro_batches(batch))
    order = torch.randperm(len(batch.lengths), generator=torch.Generator().manual_seed(0)) if order is None else order
    partials = module._minibatch_backward(batch, order, ref, None)
    return rows, ref[:, : batch.input_ids.shape[1]], partials


def module_with(policy, reference, dims, settings=None) -> CanopyModule:
    """A module around built models; the reference is scaled off the policy so that the KL term has gradient."""
    module = canopy_module("unused", parallel=settings, **HPARAMS)
    with torch.no_grad():
        for p in reference.requires_grad_(False).parameters():
            p.mul_(1.05)
    module.policy, module.reference, module.parallel_dims = policy, reference, dims
    module.manual_backward = lambda loss: loss.backward()  # Lightning's, without a Trainer
    return module


def test_aligned_targets_match_the_shifted_formulation(tiny_path):
    """cp = 1: the step's aligned formulation (target t = token t+1, per-token tensors shifted alike, last position
    masked) gives the loss, metrics and gradients of the previous one (logits[:, :-1] against input_ids[:, 1:])."""
    batch = rollout_batch(load_policy(tiny_path)[0].config.vocab_size)
    n_tokens, t = float(batch.num_action_tokens), HPARAMS["temperature"]

    def shifted(model):  # the previous formulation, whole batch
        log_probs = torch.log_softmax(model(batch.input_ids)[:, :-1].float() / t, dim=-1)
        return log_probs.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1), -(
            log_probs.exp() * log_probs
        ).sum(-1)

    previous = module_with(load_policy(tiny_path)[0], load_policy(tiny_path)[0], None)
    with torch.no_grad():
        ref = shifted(previous.reference)[0]
    logprobs, entropy = shifted(previous.policy)
    mask = batch.action_mask[:, 1:]
    loss, metrics = canopy_loss(
        logprobs,
        logprobs.detach(),
        ref,
        batch.advantages,
        mask,
        kl_coef=0.1,
        num_action_tokens=n_tokens,
        clip_low=0.2,
        clip_high=0.2,
        aggregation="token-mean",
    )
    entropy = (entropy * mask).sum() / n_tokens
    (loss - 0.01 * entropy).backward()
    expected = {"loss": loss - 0.01 * entropy, "entropy": entropy, **metrics}
    expected = {f"actor/{key}": value for key, value in expected.items()}

    aligned = module_with(load_policy(tiny_path)[0], load_policy(tiny_path)[0], None)
    aligned.batching.micro_batch_tokens = 10_000  # one micro-batch, as above
    aligned.batching.logprob_chunk_tokens = 10_000  # and one chunk of the head (chunking: tests/test_logprob_head.py)
    _, _, partials = step_backward(aligned, batch, order=torch.arange(6))  # rows stay in order: lengths decrease
    # equal up to float32 summation order over one more (masked) column (1e-7 relative), and the head's analytic
    # backward, which rounds differently from autograd through log_softmax (gradients 1e-6 relative)
    for key, value in expected.items():
        assert abs(partials[key] - value.item()) <= 1e-7 * max(1.0, abs(value.item())), key
    for (name, p), (_, q) in zip(previous.policy.named_parameters(), aligned.policy.named_parameters(), strict=True):
        assert (p.grad - q.grad).abs().max() <= 1e-6 * p.grad.abs().max(), name


def test_sequence_inputs_shard_whole_loss_terms_head_tail():
    """Under CP every tensor is padded to a multiple of 2 x cp and split with the same head-tail permutation, so
    each rank's positions carry their own target, mask and logprobs."""
    batch = rollout_batch(50)
    mesh = mock.Mock(size=lambda: 2)
    captured = {}

    def fake_cp_shard(cp_mesh, buffers, masks, balancer):
        captured.update(balancer=balancer, widths={b.shape[1] for b in buffers})
        return tuple(b[:, [0, 1, 2, 3, 4, 5, 18, 19, 20, 21, 22, 23]] for b in buffers), None  # rank 0 of 2

    with mock.patch("canopy.modules.logprobs.cp_shard", fake_cp_shard):
        local = sequence_inputs(batch, mesh, ref_logprobs=torch.ones(6, 21))
    assert captured == {"balancer": "headtail", "widths": {24}}  # 21 padded to 24 = 2 x cp x 6
    positions = local["positions"][0]
    assert torch.equal(
        local["targets"], torch.cat([batch.input_ids[:, 1:], torch.zeros(6, 4, dtype=torch.long)], 1)[:, positions]
    )
    assert torch.equal(
        local["action_mask"],
        torch.cat([batch.action_mask[:, 1:], torch.zeros(6, 4, dtype=torch.bool)], 1)[:, positions],
    )
    assert torch.equal(local["ref_logprobs"][:, -3:], torch.zeros(6, 3))  # padding is masked out and zero


def test_cp_refusals_name_the_fix():
    """seq-mean needs whole sequences per rank; SDPA's CP dispatch needs GPUs. Both fail at start, in one line."""
    from canopy.config import validate
    from tests.helpers import config

    with pytest.raises(ConfigError, match="use token-mean"):
        validate(config("parallelism.cp=2", "trainer.accelerator=gpu", "algorithm.loss_aggregation=seq-mean"))
    with pytest.raises(ConfigError, match="use token-mean"):
        canopy_module("unused", loss_aggregation="seq-mean", parallel=ParallelSettings(cp=2))
    with pytest.raises(ConfigError, match="context parallel needs GPUs"):
        canopy_module("unused", parallel=ParallelSettings(cp=2)).configure_model()


@pytest.mark.slow
@pytest.mark.parametrize("dp,cp", [(1, 2), (2, 2)], ids=["cp2", "fsdp2xcp2"])
def test_sequence_sharded_step_matches_single_process(tiny_path, tmp_path, dp, cp):
    world = dp * cp
    run_ranks("tests.test_context_parallel", world, tiny_path, dp, cp, tmp_path)
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world)]
    for rank, result in enumerate(results):
        # CP ranks of one data-parallel shard take the same rows; the shards split the batch
        assert result["rows"] == list(range(6))[rank // cp :: dp]
        assert result["ref_diff"] < 1e-6  # the reference's logprobs gathered whole on every CP rank
        assert result["grad_diff"] < 1e-6  # FSDP's sum over dp_shard x cp of per-rank terms / global N
        for key, expected in result["single_metrics"].items():
            assert abs(result["metrics"][key] - expected) <= 1e-6 * max(1.0, abs(expected)), key
        # each rank's partial is only its own positions' share: the reduction over cp is what completes it
        assert 0 < result["local_kl"] < result["metrics"]["actor/kl"]


def main(rank: int, world: int, port: int, path: str, dp: int, cp: int, out: str) -> None:
    """One rank: the step's data path single-process (every rank alike), then sharded over dp_shard x cp."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    with mock.patch.object(ScaledDotProductAttention, "forward", position_wise_attention):
        single = module_with(load_policy(path)[0], load_policy(path)[0], None)
        full = rollout_batch(single.policy.config.vocab_size)
        _, single_ref, single_partials = step_backward(single, full)
        expected = {name: p.grad for name, p in single.policy.named_parameters()}

        settings = ParallelSettings(dp_shard=dp, cp=cp)
        policy, _, dims = build_parallel_policy(path, settings, world, torch.device("cpu"))
        reference, _, _ = build_parallel_policy(path, settings, world, torch.device("cpu"), trainable=False, dims=dims)
        sharded = module_with(policy, reference, dims, settings)
        rows, ref, partials = step_backward(sharded, full)
    grad_diff = max(
        ((unwrap(p.grad) - expected[name]).abs().max() / expected[name].abs().max().clamp_min(1e-12)).item()
        for name, p in policy.named_parameters()
    )
    predicted = torch.arange(ref.shape[1]) < full.lengths[rows, None] - 1  # the positions that predict a token
    ref_diff = ((ref - single_ref[rows, : ref.shape[1]]).abs() * predicted).max().item()
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(
            {
                "rows": rows.tolist(),
                "grad_diff": grad_diff,
                "ref_diff": ref_diff,
                "metrics": all_reduce_sum(partials, dims),
                "single_metrics": single_partials,
                "local_kl": partials["actor/kl"],
            },
            f,
        )
    dist.barrier()  # no rank tears gloo down while a peer's last collective is in flight
    dist.destroy_process_group()


if __name__ == "__main__":
    spawn_from_argv(main)
