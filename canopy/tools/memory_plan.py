"""Print the memory plan of a training config, per GPU and term by term, and whether it fits the named GPUs.

    python -m canopy.tools.memory_plan experiment=appworld_canopy            # the same overrides as train.py
    python -m canopy.tools.memory_plan experiment=swebench_canopy trainer.num_nodes=4 trainer.devices=8 \\
        parallelism.dp_shard=8 parallelism.tp=4 engine.sglang.num_servers=32
    python -m canopy.tools.memory_plan --markdown experiment=...              # the tables as markdown

The model's shape comes from `model.path`'s config.json, or, with no checkpoint at hand, from the config.json
shipped for `model.name` (canopy/model_configs/). The plan is computed for GPUs (`canopy.memory`); train.py
refuses a GPU run that does not fit before anything starts. For each named GPU the trainer does not fit, the tool
prints the smallest layout change that does (`canopy.memory.nearby_layouts`: fewest changed keys, then fewest
trainer GPUs).
"""

import argparse
import json
import math
import sys

from omegaconf import DictConfig, OmegaConf

from canopy.config import compose_config
from canopy.errors import ConfigError
from canopy.memory import (
    GIB,
    GPUS,
    Fix,
    ModelShape,
    Plan,
    TrainerLayout,
    fix_line,
    gpu_servers,
    model_shape,
    nearby_layouts,
    read_model_config,
    sglang_plan,
    smallest_fix,
    trainer_plan,
)


def planned_shape(cfg: DictConfig) -> ModelShape:
    """The shape of `model.path`'s model, or while it is unset (`???` included) of `model.name`'s."""
    hf = read_model_config(OmegaConf.select(cfg, "model.path"), cfg.model.get("name"))
    return model_shape(json.dumps(hf, sort_keys=True))


def plans(cfg: DictConfig) -> tuple[Plan, dict[str, Plan | None], str]:
    """The trainer's plan, each named GPU's SGLang server plan (None without SGLang), and what the model is."""
    path = OmegaConf.select(cfg, "model.path")
    shape = planned_shape(cfg)
    trainer = trainer_plan(shape, TrainerLayout.from_config(cfg, device="cuda"))
    source = f"{path}/config.json" if path else f"canopy/model_configs/{cfg.model.name}.json"
    what = f"{shape.params / 1e9:.2f} B parameters ({source})"
    servers: dict[str, Plan | None] = dict.fromkeys(GPUS)
    served = gpu_servers(cfg)
    if served is not None:
        s = served.settings
        count = len(s.urls) or s.num_servers
        per_server = math.ceil(s.concurrency / count)
        context = cfg.budget.max_context_tokens
        for gpu, gib in GPUS.items():
            servers[gpu] = sglang_plan(shape, s.tp_size, served.fraction, context, gib, per_server)
    return trainer, servers, what


def layout_line(cfg: DictConfig) -> str:
    p, t = cfg.parallelism, cfg.trainer
    return (
        f"{t.num_nodes} node(s) x {t.devices} trainer GPUs: dp_replicate {p.dp_replicate} x dp_shard {p.dp_shard} x "
        f"tp {p.tp} x cp {p.cp}, {p.mixed_precision}, {p.activation_checkpointing} checkpointing, "
        f"micro-batch {t.micro_batch_tokens:,} tokens, context {cfg.budget.max_context_tokens:,}"
    )


def fit_line(total: float) -> str:
    return "; ".join(
        f"{gpu}: "
        + (f"fits, {gib - total / GIB:.1f} GiB spare" if total <= gib * GIB else f"over by {total / GIB - gib:.1f} GiB")
        for gpu, gib in GPUS.items()
    )


def fixes(cfg: DictConfig) -> dict[str, Fix | None]:
    """For each named GPU the trainer's plan is over: the smallest layout change that fits it (`nearby_layouts`),
    or None where none near does."""
    trainer = plans(cfg)[0]
    over = {gpu: gib for gpu, gib in GPUS.items() if trainer.total > gib * GIB}
    layouts = nearby_layouts(cfg, planned_shape(cfg)) if over else []
    return {gpu: smallest_fix(layouts, gib) for gpu, gib in over.items()}


def by_checkpointing(cfg: DictConfig) -> str:
    """The trainer's total per GPU under each activation-checkpointing mode, the rest of the layout unchanged."""
    totals = []
    for mode in ("none", "selective", "full"):
        variant = OmegaConf.merge(cfg, {"parallelism": {"activation_checkpointing": mode}})
        totals.append(f"{mode} {plans(variant)[0].total / GIB:.1f}")
    return "trainer total per GPU by activation checkpointing (GiB): " + ", ".join(totals)


def render(cfg: DictConfig, markdown: bool = False) -> str:
    trainer, servers, what = plans(cfg)
    bullet = "- " if markdown else ""
    lines = [f"{bullet}model: {what}", f"{bullet}layout: {layout_line(cfg)}", bullet + by_checkpointing(cfg), ""]
    if markdown:
        lines += ["| per trainer GPU | GiB | what |", "|---|---|---|"]
        lines += [
            f"| {t.name} | {t.bytes / GIB:.1f} | {t.detail}{' (GPU only)' if t.gpu_only else ''} |"
            for t in trainer.terms
        ]
        lines += [f"| **total** | **{trainer.total / GIB:.1f}** | {fit_line(trainer.total)} |", ""]
    else:
        lines += ["per trainer GPU                  GiB"]
        lines += [f"  {t.name:<26}{t.bytes / GIB:>7.1f}  {t.detail}" for t in trainer.terms]
        lines += [f"  {'total':<26}{trainer.total / GIB:>7.1f}", f"  {fit_line(trainer.total)}"]
    for gpu, fix in fixes(cfg).items():
        lines.append(("- " if markdown else "  ") + f"smallest change that fits {gpu}: {fix_line(fix, GPUS[gpu])}")
    for gpu, server in servers.items():
        if server is None:
            continue
        weights, kv = server.term("weights").bytes / GIB, server.term("kv cache").bytes / GIB
        lines.append(
            ("- " if markdown else "  ")
            + f"{gpu_servers(cfg).name} server on {gpu}: weights {weights:.1f} GiB, KV cache {kv:.1f} GiB: "
            + server.note
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the trainer's terms as a markdown table")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    args = parser.parse_args(argv)
    try:
        print(render(compose_config(args.overrides), args.markdown))
    except ConfigError as error:
        sys.exit(f"config error: {error}")


if __name__ == "__main__":
    main()
