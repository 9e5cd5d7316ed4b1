"""CanopyModule under a real Lightning Trainer, on the tiny model, with the real local engine."""

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from omegaconf import OmegaConf

from canopy.callbacks import OnPolicyAudit
from canopy.envs.embedded import EmbeddedEnvironment
from canopy.mismatch import OffPolicyError, RolloutCorrection
from canopy.modules.policy import export_hf_state_dict, load_policy
from canopy.rollout.budget import Budget
from canopy.rollout.local import LocalEngine
from tests.helpers import UNFILTERED, canopy_module, datamodule_over

BUDGET = Budget(
    max_turns=3, max_response_tokens=48, max_prompt_tokens=128, max_observation_tokens=32, max_context_tokens=512
)


SHIPPED_BOUNDS = OmegaConf.to_container(
    OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "engine" / "local.yaml").gap_bounds
)


class RecordSteps(Callback):
    """Records every optimizer step (through Lightning's optimizer) with the gradients and the statistics of the
    update it is about to apply."""

    def __init__(self):
        self.steps, self.stats = [], []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.steps.append({n: p.grad.detach().clone() for n, p in module.policy.named_parameters()})
        self.stats.append(dict(module.update_stats))


class StaleEngine(LocalEngine):
    """Claims every sync but keeps its weights: a sync that silently did nothing."""

    def update_weights(self, named_tensors, version):
        for _ in named_tensors:
            pass
        self.weight_version = version


class PartialSyncEngine(LocalEngine):
    """Claims every sync but loads only the first decoder layer and the rest outside the layers."""

    @torch.no_grad()
    def update_weights(self, named_tensors, version):
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if ".layers.1." not in name:
                params[name].copy_(tensor)
        self.weight_version = version


class PerturbedEngine(LocalEngine):
    """Serves weights with 1% noise on top of whatever it loaded: not the trainer's policy."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.perturb()

    @torch.no_grad()
    def perturb(self):
        generator = torch.Generator().manual_seed(1)
        for p in self.model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 1e-2 * p.std())


class VersionLaggingEngine(LocalEngine):
    """Honest about its staleness: ignores syncs and keeps stamping its samples with version 0."""

    def update_weights(self, named_tensors, version):
        for _ in named_tensors:
            pass


def make(tiny_path, tokenizer, seed=0, engine_class=LocalEngine, reward="sparse", rollout_correction=None, **values):
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    engine = engine_class(tiny_path, stop, tokenizer.pad_token_id, seed=seed)
    dm = datamodule_over(
        EmbeddedEnvironment(),
        engine,
        tokenizer,
        split="train",
        tasks_per_step=3,
        group_size=4,
        budget=BUDGET,
        sampling=UNFILTERED,
        reward=reward,
        seed=seed,
    )
    if rollout_correction is not None:
        values["rollout_correction"] = rollout_correction
    module = canopy_module(tiny_path, lr=1e-3, temperature=1.0, seed=seed, engine=dm.engine_handle, **values)
    return dm, module


def fit(dm, module, steps, callbacks=()):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )
    trainer.fit(module, datamodule=dm)
    return trainer


def test_one_optimizer_step_per_rollout_batch_and_weights_reach_the_engine(tiny_path, tokenizer):
    dm, module = make(tiny_path, tokenizer)
    recorder = RecordSteps()
    trainer = fit(dm, module, steps=2, callbacks=[recorder])
    assert len(recorder.steps) == 2 and trainer.global_step == 2 and dm.step == 2
    assert module.weight_version == 2 == dm.engine.weight_version == dm.engine_handle.version
    engine_weights = dm.engine.model.state_dict()
    for name, value in export_hf_state_dict(module.policy, module.adapter).items():
        assert torch.equal(engine_weights[name], value), name
    # the policy moved; the reference is still the base checkpoint and takes no gradient
    base, _ = load_policy(tiny_path)
    assert not torch.equal(module.policy.lm_head.weight, base.lm_head.weight)
    for name, value in base.state_dict().items():
        assert torch.equal(module.reference.state_dict()[name], value), name
    assert all(not p.requires_grad for p in module.reference.parameters())
    assert "reference.lm_head.weight" not in module.state_dict()  # checkpoints hold the policy only


def test_micro_batches_only_accumulate(tiny_path, tokenizer):
    grads = []
    for micro_batch_tokens in (100_000, 150):
        dm, module = make(tiny_path, tokenizer, micro_batch_tokens=micro_batch_tokens, kl_coef=0.1)
        recorder = RecordSteps()
        fit(dm, module, steps=1, callbacks=[recorder])
        grads.append(recorder.steps[0])
    assert len(dm.next_batch().micro_batches(150)) > 1
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-4), name


def test_half_minibatch_ablation_takes_two_updates_per_batch(tiny_path, tokenizer):
    """Both half-batch updates go through Lightning's optimizer (hooks, global step); the second one learns from
    samples of the weights before the first, so its trainer ratio moves (the entropy bonus makes sure the first
    update moves the policy), while the first one's is exactly 1."""
    dm, module = make(tiny_path, tokenizer, minibatches_per_step=2, entropy_coef=0.05)
    recorder = RecordSteps()
    trainer = fit(dm, module, steps=2, callbacks=[recorder])  # max_steps counts updates: one rollout batch
    assert trainer.global_step == 2 and len(recorder.steps) == 2
    assert module.weight_version == 1 and dm.step == 1 and dm.engine.weight_version == 1
    first, second = recorder.stats
    assert first["actor/ppo_kl"] == 0.0 and first["actor/pg_clipfrac"] == 0.0
    assert second["actor/ppo_kl"] != 0.0
    # the engine-trainer gap is measured against the behaviour policy (weights before the first update): in sync
    assert first["mismatch/logprob_gap"] < 1e-5 and second["mismatch/logprob_gap"] < 1e-5


def test_engine_in_sync_passes_the_audit_with_the_shipped_bounds(tiny_path, tokenizer):
    dm, module = make(tiny_path, tokenizer, entropy_coef=0.05)
    recorder = RecordSteps()
    fit(dm, module, steps=3, callbacks=[OnPolicyAudit(SHIPPED_BOUNDS), recorder])
    gaps = [stats["mismatch/logprob_gap"] for stats in recorder.stats]
    assert len(gaps) == 3 and all(0 <= gap < 1e-6 for gap in gaps)  # float32 HF engine vs TorchTitan trainer


def test_perturbed_engine_fails_parity_before_any_update(tiny_path, tokenizer):
    dm, module = make(tiny_path, tokenizer, engine_class=PerturbedEngine)
    base, _ = load_policy(tiny_path)
    with pytest.raises(OffPolicyError, match=r"update 0 .*before any update.*parity bound 0\.001 for float32"):
        fit(dm, module, steps=2, callbacks=[OnPolicyAudit(SHIPPED_BOUNDS)])
    assert torch.equal(module.policy.lm_head.weight, base.lm_head.weight)  # stopped before the weights moved


@pytest.mark.parametrize("engine_class", [StaleEngine, PartialSyncEngine])
def test_broken_weight_sync_stops_the_run_before_the_update(tiny_path, tokenizer, engine_class):
    """The engine claims every version but serves old (or half-old) weights: parity passes (both start from the
    checkpoint), then the gap crosses the stop bound as soon as the policy has moved, and the run stops before
    that update is applied."""
    dm, module = make(tiny_path, tokenizer, engine_class=engine_class, entropy_coef=0.05)
    recorder = RecordSteps()
    trainer = None
    with pytest.raises(OffPolicyError, match=r"gap .* > stop bound 0\.001 for float32.*stale or partial weight sync"):
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=6,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[recorder, OnPolicyAudit(SHIPPED_BOUNDS)],
        )
        trainer.fit(module, datamodule=dm)
    assert 2 <= len(recorder.stats) <= 6 and recorder.stats[0]["mismatch/logprob_gap"] < 1e-6
    assert trainer.global_step == len(recorder.stats) - 1  # the failing update was never applied
    assert recorder.stats[-1]["mismatch/logprob_gap"] > 1e-3


def test_engine_sampling_with_old_weights_is_refused(tiny_path, tokenizer):
    """An engine honest about its version but missing syncs: the module refuses tokens of another version."""
    dm, module = make(tiny_path, tokenizer, engine_class=VersionLaggingEngine, entropy_coef=0.05)
    with pytest.raises(
        OffPolicyError,
        match=r"sampled tokens came from weight version\(s\) \[0\], but the policy is at "
        r"version 1: the engine missed a weight sync",
    ):
        fit(dm, module, steps=3)
    assert module.weight_version == 1


def test_non_strict_audit_warns_where_it_would_stop(tiny_path, tokenizer):
    dm, module = make(tiny_path, tokenizer, engine_class=StaleEngine, entropy_coef=0.05)
    bounds = {"float32": {"parity": 1e-3, "warn": 1e-4, "stop": 1e-3}}
    with pytest.warns(RuntimeWarning, match="stale or partial weight sync"):
        trainer = fit(dm, module, steps=4, callbacks=[OnPolicyAudit(bounds, strict=False)])
    assert trainer.global_step == 4


@pytest.mark.parametrize("mode", ["token_tis", "token_mask", "sequence_mask"])
def test_rollout_correction_reweights_the_policy_gradient(tiny_path, tokenizer, mode):
    """Against an engine that samples from perturbed weights, each correction changes the update and logs its
    metrics; with no correction the same batch gives the recipe's gradient."""
    tight = RolloutCorrection(mode, tis_cap=1.0, token_bounds=(0.99, 1.01), sequence_bounds=(0.999, 1.001))
    grads, stats = [], []
    for correction in (None, tight):
        dm, module = make(
            tiny_path, tokenizer, engine_class=PerturbedEngine, reward="dense", rollout_correction=correction
        )
        recorder = RecordSteps()
        fit(dm, module, steps=1, callbacks=[recorder])
        grads.append(recorder.steps[0])
        stats.append(recorder.stats[0])
    assert not any(key.startswith("correction/") for key in stats[0])
    assert stats[0]["mismatch/logprob_gap"] == pytest.approx(stats[1]["mismatch/logprob_gap"])
    changed = {"token_tis": "truncated_frac", "token_mask": "masked_token_frac", "sequence_mask": "masked_seq_frac"}
    assert 0 < stats[1][f"correction/{changed[mode]}"] <= 1
    assert stats[1]["correction/weight_mean"] < 1
    assert any(not torch.allclose(grads[0][n], grads[1][n]) for n in grads[0])


def test_resumed_policy_resyncs_the_engine_before_generating(tiny_path, tokenizer):
    dm, module = make(tiny_path, tokenizer)
    module.configure_model()
    with torch.no_grad():
        module.policy.lm_head.weight.add_(0.1)
    module.weight_version = 3  # as restored from a checkpoint
    fit(dm, module, steps=4)  # global_step starts at 0 here, so 4 more updates
    assert dm.engine.weight_version == 7 == module.weight_version


def test_policy_only_state_dict_round_trips_strictly(tiny_path, tokenizer):
    _, module = make(tiny_path, tokenizer)
    module.configure_model()
    state = module.state_dict()
    assert state and all(k.startswith("policy.") for k in state)
    module.load_state_dict(state)  # the reference is rebuilt from model_path, not stored
    del state["policy.lm_head.weight"]
    with pytest.raises(RuntimeError, match="missing"):
        module.load_state_dict(state)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_leaves_gradients_unchanged(tiny_path, mode):
    from canopy.models.logprob_head import token_logprobs
    from canopy.modules.parallel import apply_activation_checkpointing

    ids = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for checkpointing in ("none", mode):
        model, _ = load_policy(tiny_path)
        apply_activation_checkpointing(model, checkpointing)
        logprobs, _ = token_logprobs(model(ids), ids, 1.0)
        logprobs.sum().backward()
        grads.append({n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6), name
