"""CanopyModule: the policy, its frozen reference, and exactly one optimizer step per rollout batch (Section 3.3)."""

import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import lightning as L
import torch

from canopy.coverage import AdaptiveGroupSettings
from canopy.errors import ConfigError, is_int, require
from canopy.mismatch import OffPolicyError, RolloutCorrection
from canopy.modules.logprobs import model_token_logprobs, padded_width, sequence_inputs
from canopy.modules.loss import Pooled, trained_loss
from canopy.modules.parallel import (
    ParallelSettings,
    all_reduce_max,
    all_reduce_sum,
    apply_activation_checkpointing,
    build_parallel_policy,
    context_parallel_mesh,
    gather_on_rank0,
    gather_sequence,
)
from canopy.modules.policy import iter_hf_weights, load_policy, unwrap
from canopy.rollout.engine import EngineHandle, SamplingParams
from canopy.step import RolloutBatch

CP_NEEDS_GPU = (
    "parallelism.cp > 1: context parallel needs GPUs (SDPA has no CPU sharding rule); set trainer.accelerator=gpu "
    "or use parallelism.dp_shard and parallelism.tp"
)
CP_SEQ_MEAN = (
    "algorithm.loss_aggregation=seq-mean with parallelism.cp > 1: per-sequence means need whole sequences on a rank; "
    "use token-mean (the recipe) or parallelism.cp=1"
)


@dataclass
class AlgorithmSettings:
    """`algorithm.*`, the recipe's knobs (Table A1): the schema. conf/train.yaml holds the defaults and says what each
    key means; the data module reads the group size, reward and quarantine keys, this module the rest."""

    group_size: Any  # n >= 2, or "auto"
    adaptive_group: AdaptiveGroupSettings
    kl_coef: float
    clip_low: float
    clip_high: float
    loss_aggregation: str
    reward: str
    advantage_std: bool
    entropy_coef: float
    minibatches_per_step: int
    quarantine_as_failure: bool
    rollout_correction: RolloutCorrection = field(default_factory=RolloutCorrection)

    def validate(self) -> None:
        require(
            self.group_size == "auto" or is_int(self.group_size),
            f"algorithm.group_size={self.group_size!r} must be an integer >= 2 or auto (per-task sizes, "
            "algorithm.adaptive_group)",
        )
        require(
            self.group_size == "auto" or self.group_size >= 2,
            f"algorithm.group_size={self.group_size}: group-relative advantages need >= 2 rollouts per task; set "
            "algorithm.group_size >= 2, or auto (per-task sizes, algorithm.adaptive_group)",
        )
        self.adaptive_group.validate()
        self.rollout_correction.validate()
        require(self.kl_coef >= 0, f"algorithm.kl_coef={self.kl_coef} must be >= 0 (0 disables the KL anchor, no_kl)")
        require(
            0 <= self.clip_low < 1 and self.clip_high >= 0,
            f"algorithm.clip_low={self.clip_low} / clip_high={self.clip_high}: need 0 <= clip_low < 1 and "
            "clip_high >= 0",
        )
        require(
            self.loss_aggregation in ("token-mean", "seq-mean"),
            f"algorithm.loss_aggregation={self.loss_aggregation!r} is unknown: use token-mean (the recipe) or seq-mean",
        )
        require(self.reward in ("sparse", "dense"), f"algorithm.reward={self.reward!r} is unknown: use sparse or dense")
        require(self.entropy_coef >= 0, f"algorithm.entropy_coef={self.entropy_coef} must be >= 0 (the recipe uses 0)")
        require(
            self.minibatches_per_step >= 1,
            f"algorithm.minibatches_per_step={self.minibatches_per_step}: use 1 (strict on-policy) up to the episodes "
            "per step",
        )

    def mean_group_size(self) -> int:
        """Rollouts per task on average: `group_size`, or with `auto` its `adaptive_group.mean`."""
        return self.adaptive_group.mean if self.group_size == "auto" else self.group_size


@dataclass
class OptimSettings:
    """`optim.*`, AdamW's: the schema (conf/train.yaml holds the defaults)."""

    lr: float
    betas: list[float]
    weight_decay: float
    grad_clip: float | None  # null: off

    def validate(self) -> None:
        require(self.lr > 0, f"optim.lr={self.lr} must be > 0")
        require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"optim.betas={list(self.betas)} must be two numbers in [0, 1), e.g. [0.9, 0.999]",
        )
        require(self.weight_decay >= 0, f"optim.weight_decay={self.weight_decay} must be >= 0")
        require(
            self.grad_clip is None or self.grad_clip > 0, f"optim.grad_clip={self.grad_clip} must be null (off) or > 0"
        )


@dataclass
class TrainerSettings:
    """`trainer.*`, Lightning's Trainer and this module's batching: the schema (conf/train.yaml holds the defaults)."""

    max_steps: int
    accelerator: str
    devices: int
    num_nodes: int
    rollout_timeout_s: int
    micro_batch_tokens: int
    logprob_chunk_tokens: int
    precision: str
    memory_check: bool
    gpu_memory_gib: float | None

    def validate(self) -> None:
        for key in ("max_steps", "devices", "num_nodes", "micro_batch_tokens", "logprob_chunk_tokens"):
            require(getattr(self, key) >= 1, f"trainer.{key}={getattr(self, key)} must be a positive integer")
        require(
            self.rollout_timeout_s > 0,
            f"trainer.rollout_timeout_s={self.rollout_timeout_s} must be a positive integer: how long the other ranks "
            "wait for rank 0's rollout step or evaluation",
        )
        require(
            self.gpu_memory_gib is None or self.gpu_memory_gib > 0,
            f"trainer.gpu_memory_gib={self.gpu_memory_gib} must be null (the device's own) or the GPU's memory in "
            "GiB, e.g. 79.6 for an H100 80 GB",
        )


BENIGN_WARNINGS = (
    r"You are using the `dataloader_iter` step flavor",  # the step pulls its batch once the synced weights are in
    r"Found `dataloader_iter` argument in the `training_step`",
    r"Found \d+ module\(s\) in eval mode at the start of training",  # the frozen reference, on purpose
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",  # Lightning 2.6 on torch 2.13's pytree
    r"Triton is not supported on current platform, roll back to CPU",  # fla on CPU: Qwen3.5 runs torch kernels
)


def silence_benign_warnings() -> None:
    """Ignore the benign warnings a run would print (matched by their exact text, nothing broader)."""
    for message in BENIGN_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


class CanopyModule(L.LightningModule):
    """Owns the policy pi_theta (TorchTitan Qwen3) and the frozen base pi_ref; trains with manual optimization so
    that one rollout batch is exactly one optimizer step (micro-batches only accumulate gradients). Every update
    goes through Lightning's optimizer (precision plugin, `on_before_optimizer_step` hooks, the global step)."""

    def __init__(
        self,
        model_path: str,
        *,
        algorithm: AlgorithmSettings,
        optim: OptimSettings,
        trainer: TrainerSettings,
        sampling: SamplingParams,
        parallel: ParallelSettings,
        seed: int,
        engine: EngineHandle | None = None,
    ):
        """Each settings object whole, as the config composes it (`canopy.build.build_module`): `algorithm` (Eq. 8's
        clip, KL, aggregation, entropy; the updates per batch; the opt-in rollout correction, `canopy.mismatch`),
        `optim` (AdamW), `trainer` (micro-batch and logprob-head chunk sizes), `sampling` (the temperature the
        engine samples at, which the trainer's logprobs match). `engine` is the run's engine handle, the one the
        data module generates with: after every optimizer step the new weights go into it (`EngineHandle.sync`),
        before the next rollout is generated."""
        super().__init__()
        settings = {"algorithm": algorithm, "optim": optim, "trainer": trainer, "sampling": sampling}
        self.save_hyperparameters(
            {"model_path": model_path, "seed": seed, **{k: asdict(v) for k, v in settings.items()}}
        )
        self.model_path, self.seed, self.engine = model_path, seed, engine
        self.algorithm, self.optim, self.sampling = algorithm, optim, sampling
        self.batching = trainer  # trainer.* (`self.trainer` is Lightning's Trainer)
        self.parallel = parallel
        if self.parallel.cp > 1 and algorithm.loss_aggregation != "token-mean":
            raise ConfigError(CP_SEQ_MEAN)
        self.automatic_optimization = False
        self.policy = None
        self.reference = None
        self.parallel_dims = None  # TorchTitan's meshes when the policy is sharded
        self.weight_version = 0  # rollout batches consumed = weight syncs sent to the engine
        self.update_stats: dict[str, float] = {}  # the update about to be applied, reduced (read by OnPolicyAudit)

    @property
    def updates_per_batch(self) -> int:
        """Optimizer steps (Lightning global steps) per rollout batch: 1 when strictly on-policy."""
        return self.algorithm.minibatches_per_step

    def configure_model(self) -> None:
        """Single process: plain modules. Under `ModelParallelStrategy`: policy and reference sharded alike."""
        if self.policy is not None:
            return
        path, world = self.model_path, self.trainer.world_size if self._trainer is not None else 1
        if self.parallel.cp > 1 and self.device.type == "cpu":
            raise ConfigError(CP_NEEDS_GPU)
        if world > 1:
            self.policy, self.adapter, self.parallel_dims = build_parallel_policy(
                path, self.parallel, world, self.device
            )
            self.reference, _, _ = build_parallel_policy(
                path, self.parallel, world, self.device, trainable=False, dims=self.parallel_dims
            )
        else:
            self.policy, self.adapter = load_policy(path)
            apply_activation_checkpointing(self.policy, self.parallel.activation_checkpointing)
            self.reference, _ = load_policy(path)
        self.reference.requires_grad_(False).eval()

    def configure_optimizers(self):
        o = self.optim
        return torch.optim.AdamW(self.policy.parameters(), lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)

    def state_dict(self, *args, **kwargs):
        """Only the policy is checkpointed; the reference is the base checkpoint at `model_path`."""
        return {k: v for k, v in super().state_dict(*args, **kwargs).items() if not k.startswith("reference.")}

    def load_state_dict(self, state_dict, strict: bool = True, **kwargs):
        result = super().load_state_dict(state_dict, strict=False, **kwargs)
        missing = [k for k in result.missing_keys if not k.startswith("reference.")]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(
                f"checkpoint does not match the policy: missing {missing}, unexpected {result.unexpected_keys}"
            )
        return result

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["weight_version"] = self.weight_version

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.weight_version = checkpoint["weight_version"]

    def on_train_start(self) -> None:
        """A resumed policy is ahead of the engine, which starts from the base checkpoint: sync it first."""
        if self.weight_version != self.engine.version:
            self.engine.sync(self.iter_hf_weights(), self.weight_version, self.trainer.is_global_zero)

    def _logprobs(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return model_token_logprobs(model, inputs, self.sampling.temperature, self.batching.logprob_chunk_tokens)

    def _micro_batches(self, batch) -> list[tuple[torch.Tensor, bool]]:
        """(rows, real) groups of at most `micro_batch_tokens`. Every data-parallel shard runs as many as the
        busiest one (FSDP's collectives must pair up); the extra ones repeat a group and count for nothing."""
        groups = batch.micro_batches(self.batching.micro_batch_tokens)
        count = all_reduce_max(len(groups), self.parallel_dims)
        return [(g, True) for g in groups] + [(groups[0], False)] * (count - len(groups))

    @torch.no_grad()
    def _logprobs_no_grad(self, model, batch, micro_batches) -> torch.Tensor:
        """`model`'s target logprobs for `batch`, aligned and whole: [B, T], T padded for CP. Every CP rank gathers
        the whole rows, since a later (mini)batch may group and therefore shard them differently."""
        cp_mesh = context_parallel_mesh(self.parallel_dims)
        ids = batch.input_ids
        out = torch.zeros(ids.shape[0], padded_width(ids.shape[1], cp_mesh), device=ids.device)
        for indices, _ in micro_batches:
            inputs = sequence_inputs(batch.select(indices), cp_mesh)
            logprobs, positions = self._logprobs(model, inputs)[0], inputs["positions"]
            if cp_mesh is not None:
                logprobs, positions = gather_sequence(logprobs, cp_mesh), gather_sequence(positions, cp_mesh)
            out[indices.to(ids.device)[:, None], positions] = logprobs
        return out

    def iter_hf_weights(self):
        """The policy's (HF name, full tensor) pairs, streamed (see `policy.iter_hf_weights`). Sharded, a collective
        that gathers on global rank 0 only: the other ranks walk meta tensors."""
        return iter_hf_weights(self.policy, self.adapter, unwrap if self.parallel_dims is None else gather_on_rank0)

    def _pooled(self, minibatch) -> Pooled:
        """Eq. 8's denominators for this (mini)batch, summed over the data-parallel shards."""
        counts = {
            "tokens": float(minibatch.num_action_tokens),
            "sequences": float((minibatch.action_mask[:, 1:].sum(-1) > 0).sum()),
        }
        counts = all_reduce_sum(counts, self.parallel_dims, over="batch")
        cp_mesh = context_parallel_mesh(self.parallel_dims)
        share = counts["sequences"] * (1 if cp_mesh is None else cp_mesh.size())
        return Pooled(counts["tokens"], counts["sequences"], share)

    def _minibatch_backward(self, batch, minibatch_indices, ref_logprobs, old_logprobs) -> dict[str, float]:
        """Accumulate the gradient of Eq. 8 (`trained_loss`) over one minibatch (rows `minibatch_indices` of
        `batch`), micro-batch by micro-batch; returns this rank's metric partials. Each rank sums the per-token terms
        of its own rows and positions divided by the minibatch-wide N, so FSDP's summed gradient over dp_shard x cp
        is Eq. 8 exactly. `old_logprobs` is None when strictly on-policy (old = current, detached)."""
        cp_mesh = context_parallel_mesh(self.parallel_dims)
        minibatch = batch.select(minibatch_indices)
        pooled = self._pooled(minibatch)
        sums: dict[str, float] = {}
        for local, real in self._micro_batches(minibatch):
            rows = minibatch_indices[local]
            micro = batch.select(rows)
            width = micro.input_ids.shape[1]
            extras = {"ref_logprobs": ref_logprobs[rows, :width]}
            if old_logprobs is not None:
                extras["old_logprobs"] = old_logprobs[rows, :width]
            inputs = sequence_inputs(micro, cp_mesh, **extras)
            logprobs, entropy = self._logprobs(self.policy, inputs)
            loss, metrics = trained_loss(logprobs, entropy, inputs, micro.advantages, self.algorithm, pooled, cp_mesh)
            self.manual_backward(loss if real else loss * 0.0)
            if real:
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + float(value)
        return sums

    def training_step(self, dataloader_iter):
        """Section 3.3: a fresh rollout batch, the frozen reference's logprobs, ONE optimizer step on Eq. 8, then
        the new weights to the engine, so that the next batch is sampled from them (strictly on-policy). Sharded,
        `rows` are this data-parallel shard's episodes only (`RolloutStream` deals them out)."""
        rows, action_tokens = self._fresh_batch(dataloader_iter)
        micro_batches = self._micro_batches(rows)

        started = time.perf_counter()
        ref_logprobs = self._logprobs_no_grad(self.reference, rows, micro_batches)
        timings = {"time/reference": time.perf_counter() - started}

        started = time.perf_counter()
        metrics = self._optimizer_step(rows, micro_batches, ref_logprobs)
        timings["time/update"] = time.perf_counter() - started

        started = time.perf_counter()
        self.weight_version += 1
        self.engine.sync(self.iter_hf_weights(), self.weight_version, self.trainer.is_global_zero)
        timings["time/weight_sync"] = time.perf_counter() - started

        self._log_step(rows, {**metrics, "actor/action_tokens": action_tokens}, timings)

    def _fresh_batch(self, dataloader_iter) -> tuple[RolloutBatch, float]:
        """This rank's rows of the batch generated for this step, on this device, and the batch's action tokens over
        every shard. Every sampled token carries the weight version the engine sampled it with; a token from any
        version but the policy's current one is refused, on every rank at once (the count is summed over the
        shards)."""
        batch, _, _ = next(dataloader_iter)
        batch = batch.to(self.device)  # a `dataloader_iter` step gets its batch as generated
        versions = batch.token_versions[batch.action_mask]
        stale = versions != self.weight_version
        counts = all_reduce_sum(
            {"stale": float(stale.sum()), "tokens": float(versions.numel())}, self.parallel_dims, over="batch"
        )
        if counts["stale"]:
            seen = sorted(set(versions[stale].tolist())) if bool(stale.any()) else "(on other shards)"
            raise OffPolicyError(
                f"{int(counts['stale'])} of {int(counts['tokens'])} sampled tokens came from weight version(s) {seen}, "
                f"but the policy is at version {self.weight_version}: the engine missed a weight sync (check the "
                "engine's log); strict on-policy training needs every token sampled by the current weights"
            )
        return batch, counts["tokens"]

    def _optimizer_step(self, batch: RolloutBatch, micro_batches, ref_logprobs: torch.Tensor) -> dict[str, float]:
        """One optimizer step over the whole batch (micro-batches only accumulate gradients); the step's metrics,
        summed over ranks, and the gradient norm. Only the half_minibatch ablation splits the batch into several
        updates, and only it needs the behaviour policy's logprobs from a forward pass before the first one.
        Each update's reduced metrics are `update_stats` before it is applied, so that `OnPolicyAudit` can stop
        the run (in `on_before_optimizer_step`) before the weights move."""
        a = self.algorithm
        old_logprobs = (
            None if a.minibatches_per_step == 1 else self._logprobs_no_grad(self.policy, batch, micro_batches)
        )
        optimizer = self.optimizers()
        order = torch.randperm(
            len(batch.lengths), generator=torch.Generator().manual_seed(self.seed + self.weight_version)
        )
        sums: dict[str, float] = {}
        grad_norms = []
        for minibatch_indices in order.chunk(a.minibatches_per_step):
            partials = self._minibatch_backward(batch, minibatch_indices, ref_logprobs, old_logprobs)
            self.update_stats = all_reduce_sum(partials, self.parallel_dims)
            for key, value in self.update_stats.items():
                sums[key] = sums.get(key, 0.0) + value / a.minibatches_per_step
            grad_norm = torch.nn.utils.clip_grad_norm_(
                self.policy.parameters(), self.optim.grad_clip if self.optim.grad_clip else float("inf")
            )
            grad_norms.append(float(unwrap(grad_norm)))
            optimizer.step()  # Lightning's LightningOptimizer: precision plugin, hooks, one global step each
            optimizer.zero_grad()
        sums["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
        sums["actor/lr"] = optimizer.param_groups[0]["lr"]
        return sums

    def _log_step(self, batch: RolloutBatch, metrics: dict[str, float], timings: dict[str, float]) -> None:
        """The step's actor metrics, the batch's rollout metrics and the phase timings; success and KL on the bar."""
        logged = {**metrics, **batch.metrics, **timings}
        self.log_dict(logged, on_step=True, on_epoch=False, batch_size=len(batch.lengths))
        self.log_dict(
            {"success": logged.get("reward/success", 0.0), "kl": logged["actor/kl"]},
            on_step=True,
            on_epoch=False,
            prog_bar=True,
            logger=False,
            batch_size=len(batch.lengths),
        )
