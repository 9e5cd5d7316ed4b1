"""The memory plan: what one GPU of the trainer and one GPU of an SGLang server hold, term by term, for a config,
known before anything starts. `check_memory` refuses a run that cannot fit (train.py, before any rollout);
`python -m canopy.tools.memory_plan` prints the plan for named GPUs.

Per trainer GPU (E = this rank's share of the parameters: TP-sharded ones / tp, all of them / (dp_shard x cp)):
- weights, gradients, AdamW's two moments and the frozen reference: float32, 4 + 4 + 8 + 4 bytes x E;
- activations kept for backward by one micro-batch (`trainer.micro_batch_tokens`, or a longer sequence alone, / cp
  tokens per rank), per decoder layer as the layer's own code saves them (traced on the meta device, so any model
  family is planned from its TorchTitan definition) under none / selective / full checkpointing;
- the working set on top at the step's worst moment: the logprob head (two float32 [chunk, vocab / tp] buffers,
  plus its float32 weight-gradient accumulator in bf16 training) or one layer's backward (its recomputed
  activations under checkpointing and its gradient temporaries), whichever is larger, or AdamW's step;
- GPU only: FSDP's unsharded bf16 blocks and gradient buffers in flight, NCCL and the CUDA context, and headroom
  for the caching allocator.
Per SGLang GPU: bf16 weights / tp, then the KV cache (and Qwen3.5's recurrent state) that fits under
`mem_fraction`, expressed as full-context episodes in flight.
For a trainer that does not fit, `nearby_layouts` and `smallest_fix` find the smallest change of its layout that
does (more TP or FSDP, more checkpointing, fewer tokens per micro-batch).
"""

import json
import math
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from functools import cache
from itertools import product
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from canopy.errors import ConfigError
from canopy.models import MODEL_FAMILIES
from canopy.rollout.sglang.weight_sync import BUCKET_BYTES as SGLANG_SYNC_BUCKET

GIB = 1 << 30
GPUS = {"A100-80GB": 80.0, "H100-80GB": 79.6, "H200-141GB": 140.4}  # GiB, the total nvidia-smi reports
MODEL_CONFIGS = Path(__file__).parent / "model_configs"  # config.json of the models the experiments name
CUDA_CONTEXT_GIB = 1.0  # CUDA context, cuBLAS workspaces
NCCL_GIB = 1.0  # NCCL's own buffers over a run's communicators
ALLOCATOR_HEADROOM = 0.10  # fragmentation in PyTorch's caching allocator, on top of what tensors hold
GRADIENT_TEMPORARIES = 2  # a layer's backward holds about this many [tokens, intermediate] gradient buffers
PROBE_TOKENS = (128, 256)  # the token counts a layer is traced at: saved bytes are linear in tokens


@dataclass(frozen=True)
class Term:
    name: str
    bytes: float
    detail: str
    gpu_only: bool = False  # an estimate only a GPU can confirm (the CPU tests cannot measure it)


@dataclass(frozen=True)
class Plan:
    terms: tuple[Term, ...]
    working: dict[str, float] = field(default_factory=dict)  # the trainer: candidates for "working set"
    note: str = ""
    episodes: int | None = None  # a server: full-context episodes its KV cache holds at once

    @property
    def total(self) -> float:
        return sum(term.bytes for term in self.terms)

    def term(self, name: str) -> Term:
        return next(term for term in self.terms if term.name == name)

    def largest(self) -> Term:
        return max(self.terms, key=lambda term: term.bytes)


@dataclass(frozen=True)
class TrainerLayout:
    """What of the config decides the trainer's memory (`parallelism.*`, `trainer.*`, the budget's context)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    sequence_parallel: bool = True
    mixed_precision: str = "float32"
    activation_checkpointing: str = "none"
    micro_batch_tokens: int = 16384
    max_context_tokens: int = 40960
    logprob_chunk_tokens: int = 2048
    device: str = "cuda"  # cuda | cpu: what the activations are traced for (kernels differ)
    sync_bucket_bytes: float = 0.0  # the weight sync's bucket on the trainer's GPU (a broadcast to the servers)

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.cp

    @property
    def fsdp(self) -> int:
        """Ranks one parameter is sharded over: TorchTitan's FSDP mesh is dp_shard x cp."""
        return self.dp_shard * self.cp

    @property
    def compute_dtype(self) -> torch.dtype:
        """bf16 only through FSDP's mixed precision, i.e. on several processes; one process trains in float32."""
        return torch.bfloat16 if self.world > 1 and self.mixed_precision == "bfloat16" else torch.float32

    @property
    def rank_tokens(self) -> int:
        """Tokens one rank runs per forward: a micro-batch, or a longer sequence on its own, split over cp."""
        return math.ceil(max(self.micro_batch_tokens, self.max_context_tokens) / self.cp)

    @classmethod
    def from_config(cls, cfg, device: str | None = None) -> "TrainerLayout":
        p, t = cfg.parallelism, cfg.trainer
        return cls(
            dp_replicate=p.dp_replicate,
            dp_shard=p.dp_shard,
            tp=p.tp,
            cp=p.cp,
            sequence_parallel=p.sequence_parallel,
            mixed_precision=p.mixed_precision,
            activation_checkpointing=p.activation_checkpointing,
            micro_batch_tokens=t.micro_batch_tokens,
            max_context_tokens=cfg.budget.max_context_tokens,
            logprob_chunk_tokens=t.logprob_chunk_tokens,
            device=device or ("cpu" if t.accelerator == "cpu" else "cuda"),
            sync_bucket_bytes=sync_bucket_bytes(cfg),
        )


def sync_bucket_bytes(cfg) -> float:
    """What a broadcast weight sync holds on the trainer's GPU at once: vLLM's NCCL transfer one bucket of
    `engine.vllm.bucket_mib`, SGLang's distributed sync one of 1 GiB; a disk sync none (tensors go to the CPU)."""
    engine = cfg.engine
    if engine.name == "vllm" and engine.vllm.weight_sync == "nccl":
        return engine.vllm.bucket_mib * 2**20
    if engine.name == "sglang" and engine.sglang.weight_sync == "distributed":
        return float(SGLANG_SYNC_BUCKET)
    return 0.0


@dataclass(frozen=True)
class LayerActivations:
    """Bytes one decoder layer keeps for backward: `per_token` x tokens + `fixed`, of which `hidden_per_token`
    are [tokens, hidden] tensors (the residual stream, which sequence parallelism shards over TP)."""

    per_token: float
    hidden_per_token: float
    fixed: float = 0.0

    def at(self, tokens: int) -> float:
        return self.fixed + self.per_token * tokens


@dataclass(eq=False)
class ModelShape:
    """What the plan needs of a model, read off its TorchTitan definition built on the meta device (no weights)."""

    hf: dict
    model: torch.nn.Module = field(repr=False)
    hidden: int
    intermediate: int
    vocab: int
    params: int  # trained parameters (text model)
    tp_sharded: int  # of which matrices that TP splits (projections, embedding, head); vectors stay whole
    largest_block: int  # parameters of the largest decoder layer (FSDP gathers one at a time)
    largest_param: int
    layer_kinds: list[int]  # each layer's index into `self.kind_layers` (layers that trace alike)
    kind_layers: list[torch.nn.Module] = field(repr=False)

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelShape":
        from canopy.modules.policy import build_model

        model = build_model(hf, device="meta")
        text = hf.get("text_config") or hf  # a multimodal checkpoint nests the language model's config
        named = list(model.named_parameters())
        layers = list(model.layers.values())
        kinds, kind_layers, signatures = [], [], []
        for layer in layers:  # layers with the same parameters trace alike (Qwen3.5: attention, Gated DeltaNet)
            signature = [(n, tuple(p.shape)) for n, p in layer.named_parameters()]
            if signature not in signatures:
                signatures.append(signature)
                kind_layers.append(layer)
            kinds.append(signatures.index(signature))
        return cls(
            hf=hf,
            model=model,
            hidden=text["hidden_size"],
            intermediate=text["intermediate_size"],
            vocab=text["vocab_size"],
            params=sum(p.numel() for _, p in named),
            tp_sharded=sum(p.numel() for _, p in named if p.dim() >= 2),
            largest_block=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
            largest_param=max(p.numel() for _, p in named),
            layer_kinds=kinds,
            kind_layers=kind_layers,
        )

    def rank_params(self, tp: int, fsdp: int) -> float:
        """Parameters one rank holds: TP splits the matrices, FSDP everything."""
        return (self.tp_sharded / tp + (self.params - self.tp_sharded)) / fsdp

    def activations(self, mode: str, dtype: torch.dtype, device: str) -> list[LayerActivations]:
        """Each layer's saved bytes under activation checkpointing `mode`, for compute `dtype` on `device`."""
        per_kind = [_traced_activations(self, k, mode, dtype, device) for k in range(len(self.kind_layers))]
        return [per_kind[k] for k in self.layer_kinds]


def read_model_config(model_path: str | None, name: str | None) -> dict:
    """The config.json to plan with: the checkpoint's (`model.path`), else the shipped one of `model.name`."""
    if model_path is not None:
        config = Path(model_path) / "config.json"
        if not config.is_file():
            raise ConfigError(
                f"model.path '{model_path}' has no config.json: point it at an HF checkpoint directory (config.json "
                "+ *.safetensors + tokenizer), or leave it unset to plan model.name"
            )
        return json.loads(config.read_text())
    known = sorted(p.stem for p in MODEL_CONFIGS.glob("*.json"))
    if name is None or not (MODEL_CONFIGS / f"{name}.json").is_file():
        raise ConfigError(
            f"no model to plan: set model.path to a checkpoint directory, or model.name to one of {', '.join(known)}"
        )
    return json.loads((MODEL_CONFIGS / f"{name}.json").read_text())


def trainer_plan(shape: ModelShape, layout: TrainerLayout) -> Plan:
    """Per-GPU memory of the trainer at its peak (the policy's backward, or AdamW's step)."""
    E = shape.rank_params(layout.tp, layout.fsdp)
    c = torch.finfo(layout.compute_dtype).bits // 8
    tokens, tp, sp = layout.rank_tokens, layout.tp, layout.sequence_parallel
    gpu = layout.device == "cuda"
    mode = layout.activation_checkpointing
    saved_layers = shape.activations(mode, layout.compute_dtype, layout.device)
    none_layers = shape.activations("none", layout.compute_dtype, layout.device)

    def per_rank(layer: LayerActivations, mode: str) -> float:
        """One layer's saved bytes on one rank. TP splits heads and the FFN; SP also splits the residual stream
        (the layer's input, its norms) but not the [tokens, hidden] tensors held whole: the two norm outputs the
        column-parallel projections gather (none), the row-parallel outputs before their reduce (selective)."""
        if tp == 1:
            return layer.at(tokens)
        other = (layer.per_token - layer.hidden_per_token) / tp
        whole = {"none": 2 * shape.hidden * c, "full": 0.0, "selective": layer.hidden_per_token - shape.hidden * c}
        gathered = min(layer.hidden_per_token, whole[mode])
        hidden = (layer.hidden_per_token - gathered) / tp + gathered if sp else layer.hidden_per_token
        return layer.fixed + (other + hidden) * tokens

    # outside the layers: the token ids, the final norm (its input, normalized value and output) and the head's
    # per-token statistics, targets and outputs
    outside = tokens * (3 * shape.hidden * c + 8 + 4 + 16 + 8 + 8)
    activations = sum(per_rank(layer, mode) for layer in saved_layers) + outside

    head = logprob_head_bytes(tokens, math.ceil(shape.vocab / tp), shape.hidden, layout.logprob_chunk_tokens, c)
    recompute = max(per_rank(n, "none") - per_rank(s, mode) for n, s in zip(none_layers, saved_layers, strict=True))
    layer_backward = recompute + GRADIENT_TEMPORARIES * tokens * math.ceil(shape.intermediate / tp) * c
    optimizer_step = E * 4 if gpu else 2 * shape.largest_param * 4  # foreach AdamW's temporaries / per tensor
    weight_sync = layout.sync_bucket_bytes + shape.largest_param * 4  # one bucket, one tensor gathered whole
    working = {"logprob head": head, "layer backward": layer_backward, "optimizer step": optimizer_step}
    if layout.sync_bucket_bytes:
        working["weight sync"] = weight_sync
    peak_name = max(("logprob head", "layer backward"), key=working.get)
    peak_working = working[peak_name]
    after = max(("optimizer step", "weight sync"), key=lambda name: working.get(name, 0.0))
    if working[after] > activations + peak_working:  # after backward: the activations are freed
        peak_name, peak_working, activations = after, working[after], 0.0

    terms = [
        Term("weights", E * 4, f"{E / 1e9:.2f} B parameters on this rank, float32"),
        Term("gradients", E * 4, "float32, sharded like the weights"),
        Term("optimizer", E * 8, "AdamW's two moments, float32"),
        Term("reference", E * 4, "the frozen base, float32, sharded like the policy"),
        Term(
            "activations",
            activations,
            f"{mode} checkpointing, {tokens:,} tokens per rank, {str(layout.compute_dtype).removeprefix('torch.')}"
            if activations
            else "freed before the optimizer step",
        ),
        Term("working set", peak_working, f"{peak_name} at its peak (the largest of: {_listed(working)})"),
    ]
    if gpu and layout.world > 1:
        gathered = (2 * shape.largest_block / tp + shape.vocab * shape.hidden / tp) * c
        reduce = max(shape.largest_block, shape.vocab * shape.hidden) / tp * (c + 4)
        terms.append(Term("fsdp buffers", gathered + reduce, "two blocks and the head gathered, one reduce", True))
    if gpu:
        comms = CUDA_CONTEXT_GIB + (NCCL_GIB if layout.world > 1 else 0.0)
        terms.append(Term("cuda context and nccl", comms * GIB, "fixed estimate", True))
        subtotal = sum(term.bytes for term in terms)
        terms.append(Term("allocator headroom", ALLOCATOR_HEADROOM * subtotal, "10% for fragmentation", True))
    return Plan(tuple(terms), working)


GPUS_PER_NODE = 8  # the most trainer GPUs per node the layout search proposes (or the run's own, if more)
TP_SIZES = (1, 2, 4, 8)
CHECKPOINTING = ("none", "selective", "full")  # each keeps less than the one before


@dataclass(frozen=True)
class Fix:
    """A trainer layout near the config's: the overrides that give it, its trainer GPUs and its plan's total."""

    overrides: dict[str, int | str]
    gpus: int
    total: float

    def __str__(self) -> str:
        return " ".join(f"{key}={value}" for key, value in self.overrides.items())


def nearby_layouts(cfg, shape: ModelShape) -> list[Fix]:
    """Every trainer layout a few keys from the config's, the smallest change first: fewest changed keys, then
    fewest trainer GPUs, then the mildest (the largest plan). Searched: trainer.devices up to 8 per node (no more
    than the run has when it launches GPU servers on the GPUs after the trainer's), trainer.num_nodes up to 8x the
    run's, parallelism.dp_shard filling them, tp in 1, 2, 4, 8 dividing the model's heads, dp_replicate folded into
    dp_shard, more activation checkpointing, trainer.micro_batch_tokens halved down to the context (a longer
    sequence runs alone, so fewer tokens than that save nothing); cp stays as it is."""
    p, t = cfg.parallelism, cfg.trainer
    served = gpu_servers(cfg)  # servers this run launches hold the node's GPUs from base_gpu_id on
    most = t.devices if served is not None and not served.settings.urls else max(GPUS_PER_NODE, t.devices)
    base = TrainerLayout.from_config(cfg, device="cuda")
    floor = min(t.micro_batch_tokens, base.max_context_tokens)
    tokens = {max(t.micro_batch_tokens >> k, floor) for k in range(8)}
    tps = {p.tp, *(n for n in TP_SIZES if all(heads % n == 0 for heads in head_counts(shape.hf)))}
    modes = CHECKPOINTING[CHECKPOINTING.index(p.activation_checkpointing) :]
    replicates = [n for n in range(1, p.dp_replicate + 1) if p.dp_replicate % n == 0]
    nodes_options = [t.num_nodes * k for k in (1, 2, 4, 8)]
    current = layout_keys(base, t.devices, t.num_nodes)
    fixes = []
    for nodes, devices, replicate, tp, mode, micro in product(
        nodes_options, range(1, most + 1), replicates, sorted(tps), modes, sorted(tokens)
    ):
        shard, rest = divmod(devices * nodes, replicate * tp * p.cp)
        if rest or not shard or devices % (tp * p.cp):
            continue
        layout = replace(
            base, dp_replicate=replicate, dp_shard=shard, tp=tp, activation_checkpointing=mode, micro_batch_tokens=micro
        )
        keys = layout_keys(layout, devices, nodes)
        overrides = {key: value for key, value in keys.items() if value != current[key]}
        if overrides:
            fixes.append(Fix(overrides, devices * nodes, trainer_plan(shape, layout).total))
    return sorted(fixes, key=lambda fix: (len(fix.overrides), fix.gpus, -fix.total))


def layout_keys(layout: TrainerLayout, devices: int, nodes: int) -> dict[str, int | str]:
    """The config keys the layout search varies, with their values for `layout` on `nodes` x `devices` GPUs."""
    return {
        "trainer.num_nodes": nodes,
        "trainer.devices": devices,
        "parallelism.dp_replicate": layout.dp_replicate,
        "parallelism.dp_shard": layout.dp_shard,
        "parallelism.tp": layout.tp,
        "parallelism.activation_checkpointing": layout.activation_checkpointing,
        "trainer.micro_batch_tokens": layout.micro_batch_tokens,
    }


def head_counts(hf: dict) -> list[int]:
    """The model's attention (and Gated DeltaNet) head counts, which TP splits evenly."""
    text = hf.get("text_config") or hf
    keys = ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads")
    return [text[key] for key in keys if key in text]


def smallest_fix(fixes: list[Fix], gpu_gib: float) -> Fix | None:
    """The first of `nearby_layouts` whose plan fits a GPU of `gpu_gib` GiB, or None."""
    return next((fix for fix in fixes if fix.total <= gpu_gib * GIB), None)


def fix_line(fix: Fix | None, gpu_gib: float) -> str:
    """A `smallest_fix` for a GPU of `gpu_gib` GiB, said in a few words."""
    if fix is None:
        return f"no layout near this one fits (up to {GPUS_PER_NODE} GPUs per node on 8x the nodes): {FIXES[None]}"
    total = fix.total / GIB
    return f"`{fix}` ({fix.gpus} trainer GPUs, {total:.1f} GiB per GPU, {gpu_gib - total:.1f} GiB spare)"


def logprob_head_bytes(tokens: int, vocab: int, hidden: int, chunk: int, compute_bytes: int) -> float:
    """The chunked logprob head's working set: two float32 [chunk, vocab] buffers, the hidden states' gradient,
    and in bf16 a float32 accumulator of the weight's gradient (in float32 it is the gradient itself)."""
    accumulator = vocab * hidden * 4 if compute_bytes != 4 else 0
    return 2 * min(chunk, tokens) * vocab * 4 + accumulator + tokens * hidden * compute_bytes


def _listed(amounts: dict[str, float]) -> str:
    return ", ".join(f"{name} {amount / GIB:.2f} GiB" for name, amount in amounts.items())


def sglang_plan(
    shape: ModelShape, tp_size: int, mem_fraction: float, context_tokens: int, gpu_gib: float, episodes: int
) -> Plan:
    """Per-GPU memory of one SGLang server of `tp_size` GPUs: bf16 weights, then KV cache (and recurrent state)
    for as many full-context episodes as `mem_fraction` of the GPU leaves room for. The note says how many fit
    against `episodes` (the requests in flight per server); SGLang queues the rest (throughput, not memory)."""
    text = shape.hf.get("text_config") or shape.hf
    weights = (shape.params + _vision_params(shape.hf)) * 2 / tp_size
    types = text.get("layer_types") or ["full_attention"] * text["num_hidden_layers"]
    attention_layers = sum(kind == "full_attention" for kind in types)
    kv_heads = max(1, text["num_key_value_heads"] // tp_size)
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    kv_per_token = attention_layers * 2 * kv_heads * head_dim * 2
    state = _recurrent_state_bytes(text, len(types) - attention_layers) / tp_size
    episode = context_tokens * kv_per_token + state
    pool = mem_fraction * gpu_gib * GIB - weights
    fits = max(0, int(pool // episode))
    terms = (
        Term("weights", weights, f"bf16, tp {tp_size}"),
        Term("kv cache", max(pool, 0.0), f"{kv_per_token / 1024:.0f} KiB per token, to mem_fraction {mem_fraction}"),
        Term("outside mem_fraction", (1 - mem_fraction) * gpu_gib * GIB, "activations, CUDA graphs", True),
    )
    note = (
        f"{fits} full-context episodes ({context_tokens:,} tokens, {episode / GIB:.2f} GiB each) in flight per "
        f"server; {episodes} requested" + (": SGLang queues the rest" if fits < episodes else "")
    )
    return Plan(terms, note=note, episodes=fits)


def _recurrent_state_bytes(text: dict, linear_layers: int) -> float:
    """Gated DeltaNet state per sequence: float32 [value heads, key dim, value dim] and the causal conv's window."""
    if not linear_layers:
        return 0.0
    heads, k, v = text["linear_num_value_heads"], text["linear_key_head_dim"], text["linear_value_head_dim"]
    conv = (text.get("linear_conv_kernel_dim", 4) - 1) * (2 * text["linear_num_key_heads"] * k + heads * v) * 2
    return linear_layers * (heads * k * v * 4 + conv)


def _vision_params(hf: dict) -> float:
    """A multimodal checkpoint's vision tower, which SGLang loads beside the language model (blocks only)."""
    vision = hf.get("vision_config")
    if not vision:
        return 0.0
    width, inner = vision["hidden_size"], vision["intermediate_size"]
    return vision["depth"] * (4 * width * width + 2 * width * inner)


def check_memory(cfg, model_path: str | None) -> None:
    """Refuse, before anything starts, a GPU run whose plan exceeds its GPU's memory (trainer or launched SGLang
    servers), in one line naming the term that overflows and the fix. Runs on GPUs (`trainer.accelerator=gpu`) or
    wherever `trainer.gpu_memory_gib` names the GPU; `trainer.memory_check=false` skips it."""
    t = cfg.trainer
    if not t.memory_check or (t.accelerator == "cpu" and t.gpu_memory_gib is None):
        return
    gpu_gib = t.gpu_memory_gib
    if gpu_gib is None:
        gpu_gib = torch.cuda.get_device_properties(0).total_memory / GIB
    shape = model_shape(json.dumps(read_model_config(model_path, cfg.model.get("name")), sort_keys=True))
    plan = trainer_plan(shape, TrainerLayout.from_config(cfg, device="cuda"))
    if plan.total > gpu_gib * GIB:
        largest = plan.largest()
        fix = smallest_fix(nearby_layouts(cfg, shape), gpu_gib)
        raise ConfigError(
            f"memory plan: the trainer needs {plan.total / GIB:.1f} GiB per GPU against {gpu_gib:.3g} GiB "
            f"({largest.name} {largest.bytes / GIB:.1f} GiB the largest term; `python -m canopy.tools.memory_plan` "
            "with the same overrides prints every term): "
            + (
                f"the smallest change that fits: {fix_line(fix, gpu_gib)}"
                if fix
                else FIXES.get(largest.name, FIXES[None])
            )
            + "; trainer.memory_check=false overrides"
        )
    served = gpu_servers(cfg)
    if served is not None and not served.settings.urls:  # servers this run launches, on its GPUs
        s = served.settings
        server = sglang_plan(shape, s.tp_size, served.fraction, cfg.budget.max_context_tokens, gpu_gib, 1)
        if not server.episodes:
            raise ConfigError(
                f"memory plan: a {served.name} server (tp {s.tp_size}) holds "
                f"{server.term('weights').bytes / GIB:.1f} GiB of weights and has no room left under "
                f"{served.key}.{served.fraction_key}={served.fraction} of {gpu_gib:.1f} GiB for one "
                f"{cfg.budget.max_context_tokens:,}-token episode: raise {served.key}.tp_size or "
                f"{served.fraction_key}; trainer.memory_check=false overrides"
            )


class GPUServers(NamedTuple):
    name: str  # SGLang | vLLM
    key: str  # engine.sglang | engine.vllm
    settings: object
    fraction_key: str  # the setting that bounds weights + KV cache, as a fraction of each GPU
    fraction: float


def gpu_servers(cfg) -> GPUServers | None:
    """The run's inference servers on GPUs (SGLang, or vLLM's CUDA build), planned alike: weights, then KV cache."""
    if cfg.engine.name == "sglang":
        s = cfg.engine.sglang
        return GPUServers("SGLang", "engine.sglang", s, "mem_fraction", s.mem_fraction)
    if cfg.engine.name == "vllm" and cfg.engine.vllm.device == "cuda":
        s = cfg.engine.vllm
        return GPUServers("vLLM", "engine.vllm", s, "gpu_memory_utilization", s.gpu_memory_utilization)
    return None


FIXES = {  # what shrinks each term of the trainer's plan
    "activations": "lower trainer.micro_batch_tokens (a longer sequence runs alone), set "
    "parallelism.activation_checkpointing=full, or split sequences over parallelism.tp (or cp)",
    "working set": "lower trainer.logprob_chunk_tokens or trainer.micro_batch_tokens, or split over parallelism.tp",
    **dict.fromkeys(
        ("weights", "gradients", "optimizer", "reference"), "shard over more GPUs (parallelism.dp_shard, tp)"
    ),
    None: "use GPUs with more memory",
}


@cache
def model_shape(hf_json: str) -> ModelShape:
    """`ModelShape` of a config.json (given as its JSON text, so that plans of one model share one)."""
    return ModelShape.from_hf(json.loads(hf_json))


@cache
def _traced_activations(shape: ModelShape, kind: int, mode: str, dtype: torch.dtype, device: str):
    layer = shape.kind_layers[kind].to(dtype)
    parameters = {p.untyped_storage()._cdata for p in shape.model.parameters()}
    parameters |= {b.untyped_storage()._cdata for b in shape.model.buffers()}
    measured = []
    for tokens in PROBE_TOKENS:
        x = torch.empty(1, tokens, shape.hidden, device="meta", dtype=dtype, requires_grad=True)
        positions = torch.arange(tokens, device="meta").unsqueeze(0)
        saved = _saved_by(layer, x, positions, mode, device, parameters)
        total = sum(size for size, _, _ in saved.values())
        hidden = sum(size for size, last, _ in saved.values() if last == shape.hidden)
        measured.append((total, hidden))
    (t1, h1), (t2, h2) = measured
    span = PROBE_TOKENS[1] - PROBE_TOKENS[0]
    per_token, hidden_per_token = (t2 - t1) / span, (h2 - h1) / span
    return LayerActivations(per_token, hidden_per_token, fixed=max(0.0, t1 - per_token * PROBE_TOKENS[0]))


def _saved_by(layer, x, positions, mode: str, device: str, exclude: set) -> dict:
    """{storage: (bytes, last dim, tensor)} of what `layer(x)` keeps for backward under checkpointing `mode`: every
    saved tensor (none), the layer's input (full), or its input plus the outputs TorchTitan's selective policy
    keeps."""
    saved: dict = {}

    def keep(tensor: torch.Tensor) -> None:  # holds the tensor, so that no later one takes its storage's address
        storage = tensor.untyped_storage()
        if storage._cdata not in exclude:
            saved[storage._cdata] = (storage.nbytes(), tensor.shape[-1] if tensor.dim() else 1, tensor)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        keep(tensor)
        return tensor

    with ExitStack() as stack:
        stack.enter_context(_kernel_stand_ins(device, keep if mode == "selective" else None))
        if mode == "none":
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor))
        elif mode == "selective":
            stack.enter_context(_SelectiveSaves(keep))
        else:
            stack.enter_context(torch.no_grad())
        layer(x, None, positions)
    if mode != "none":
        keep(x)  # the checkpoint keeps the layer's input
    return saved


class _SelectiveSaves(TorchDispatchMode):
    """The outputs TorchTitan's per-op selective checkpointing keeps (`SelectiveAC`): those of its save-list ops,
    except every second matmul of a layer."""

    def __init__(self, keep):
        super().__init__()
        from torchtitan.distributed.activation_checkpoint import _get_default_save_ops

        self.keep, self.save_ops, self.matmuls = keep, _get_default_save_ops(), 0
        self.matmul_ops = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.matmul_ops:
            self.matmuls += 1
        if func in self.save_ops and not (func in self.matmul_ops and self.matmuls % 2 == 0):
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor):
                    self.keep(tensor)
        return out


@contextmanager
def _kernel_stand_ins(device: str, keep_attention_outputs):
    """Kernels that the meta device cannot run as the target does, replaced by functions that keep what the
    target's kernel keeps: attention as flash attention does (q, k, v, output, float32 log-sum-exp; not the
    [tokens, tokens] scores of SDPA's math path); on GPUs, Gated DeltaNet as fla's chunked kernel does. Under
    selective checkpointing on GPUs the attention output is kept (CUDA's SDPA kernels are on the save list)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    def attention(self, q, k, v, **kwargs):
        log_sum_exp = q.new_empty(q.shape[:-1], dtype=torch.float32)
        out = _KeepsLike.apply(q, k, v, log_sum_exp)
        if keep_attention_outputs is not None and device == "cuda":
            keep_attention_outputs(out)
            keep_attention_outputs(log_sum_exp)
        return out

    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(ScaledDotProductAttention, "forward", attention))
        if device == "cuda":
            for spec in MODEL_FAMILIES.values():
                if spec.gated_delta_rule is not None:
                    stack.enter_context(mock.patch(spec.gated_delta_rule, _fla_gated_delta))
        yield


class _KeepsLike(torch.autograd.Function):
    """Output shaped like the first input; keeps every input and the output for backward."""

    @staticmethod
    def forward(ctx, first, *rest):
        out = torch.empty_like(first)
        ctx.save_for_backward(first, *rest, out)
        return out

    @staticmethod
    def backward(ctx, grad):  # never run: the plan traces forward only
        raise NotImplementedError


def _fla_gated_delta(q, k, v, g, beta, **kwargs):
    """What fla's chunked Gated DeltaNet keeps: q and k repeated to v's heads and normalized, their norms, v, the
    cumulative gate (float32), beta and the [tokens, heads, 64] intra-chunk matrix."""
    repeat = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(repeat, 2), k.repeat_interleave(repeat, 2)
    norms = g.new_empty(g.shape, dtype=torch.float32)
    return _KeepsLike.apply(
        v, q, k, norms, norms.clone(), g.float(), beta, v.new_empty(*v.shape[:3], 64, dtype=torch.float32)
    ), None
