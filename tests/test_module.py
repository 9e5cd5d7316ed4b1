"""CanopyModule under a real Lightning Trainer, on the tiny model, with the real local engine."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from canopy.datamodules.rollout import RolloutDataModule
from canopy.envs.embedded import EmbeddedEnvironment
from canopy.modules.canopy_module import CanopyModule
from canopy.modules.policy import export_hf_state_dict, load_policy
from canopy.rollout.agent_loop import Budget
from canopy.rollout.engine import LocalEngine, SamplingParams

BUDGET = Budget(
    max_turns=3, max_response_tokens=48, max_prompt_tokens=128, max_observation_tokens=32, max_context_tokens=512
)


class RecordSteps(Callback):
    """Records every optimizer step with the gradients it applied."""

    def __init__(self):
        self.steps = []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.steps.append({n: p.grad.detach().clone() for n, p in module.policy.named_parameters()})


def make(tiny_path, tokenizer, seed=0, **module_args):
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    engine = LocalEngine(tiny_path, stop, tokenizer.pad_token_id, seed=seed)
    dm = RolloutDataModule(
        EmbeddedEnvironment(),
        engine,
        tokenizer,
        split="train",
        tasks_per_step=3,
        group_size=4,
        budget=BUDGET,
        sampling=SamplingParams(temperature=1.0),
        seed=seed,
    )
    module = CanopyModule(str(tiny_path), lr=1e-3, temperature=1.0, seed=seed, engine=dm.engine_handle, **module_args)
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
    assert module.weight_version == 2 == dm.engine.weight_version == dm.trainer_version
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
    dm, module = make(tiny_path, tokenizer, minibatches_per_step=2)
    recorder = RecordSteps()
    trainer = fit(dm, module, steps=1, callbacks=[recorder])
    # Lightning counts one global step per rollout batch; the first half-batch update goes to the raw optimizer
    assert trainer.global_step == 1 and module.weight_version == 1 and dm.step == 1
    assert len(recorder.steps) == 1


def test_stale_batch_is_refused_by_the_module(tiny_path, tokenizer):
    dm, module = make(tiny_path, tokenizer)
    fresh = dm.next_batch

    def stale():
        batch = fresh()
        batch.weight_version = module.weight_version - 1  # generated before the last update
        return batch

    dm.next_batch = stale
    with pytest.raises(RuntimeError, match="stale"):
        fit(dm, module, steps=1)


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
    from canopy.modules.logprobs import token_logprobs
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
