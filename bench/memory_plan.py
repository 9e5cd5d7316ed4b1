"""The memory plan's predictions against a CPU training step's measured allocations, term by term, as a markdown
table (docs/memory.md). The cases vary tokens, vocabulary, width, depth, checkpointing, micro-batch and the model
family; tests/test_memory_plan.py holds each term to 15%.

    python bench/memory_plan.py
"""

import json

from canopy.memory import TrainerLayout, model_shape, trainer_plan
from canopy.tools.memory_measure import measure_training_step, qwen3_5_config, qwen3_config

MEASURED_TERMS = ("weights", "reference", "gradients", "optimizer", "activations", "logprob head", "peak")


# (config.json, checkpointing, micro-batch tokens, rows x sequence length, head chunk): the first is dominated by
# the logprob head, the others by a layer's backward
CASES = {
    "head-bound": (qwen3_config(128, 384, 4, 2, 32, 4, 4000), "none", 1024, (4, 512), 256),
    "wide-ffn-full": (qwen3_config(64, 1024, 4, 2, 16, 3, 500), "full", 1024, (4, 512), 256),
    "wide-selective": (qwen3_config(256, 512, 8, 4, 32, 2, 300), "selective", 512, (4, 256), 128),
    "long-rows-full": (qwen3_config(128, 256, 4, 2, 32, 2, 8000), "full", 2048, (2, 1024), 512),
    "qwen3_5-none": (qwen3_5_config(64, 256, 4, 300), "none", 512, (2, 256), 128),
    "qwen3_5-selective": (qwen3_5_config(64, 256, 4, 300), "selective", 512, (2, 256), 128),
}


def compare(case: str) -> tuple[dict[str, float], dict[str, float]]:
    """(predicted, measured) bytes of `MEASURED_TERMS` for one of `CASES`."""
    hf, checkpointing, micro_batch, (rows, seq_len), chunk = CASES[case]
    layout = TrainerLayout(
        activation_checkpointing=checkpointing,
        micro_batch_tokens=micro_batch,
        max_context_tokens=seq_len,
        logprob_chunk_tokens=chunk,
        device="cpu",
    )
    plan = trainer_plan(model_shape(json.dumps(hf, sort_keys=True)), layout)
    predicted = {term.name: term.bytes for term in plan.terms}
    predicted.update({"peak": plan.total, "logprob head": plan.working["logprob head"]})
    return predicted, measure_training_step(hf, layout, rows, seq_len)


def main() -> None:
    print("| case | " + " | ".join(MEASURED_TERMS) + " |")
    print("|---" * (len(MEASURED_TERMS) + 1) + "|")
    for case in CASES:
        predicted, measured = compare(case)
        cells = [
            f"{predicted[t] / 1e6:.2f} / {measured[t] / 1e6:.2f} ({predicted[t] / measured[t]:.3f})"
            for t in MEASURED_TERMS
        ]
        print(f"| {case} | " + " | ".join(cells) + " |")
    print("\nMB predicted / measured (ratio), one process, float32, CPU")


if __name__ == "__main__":
    main()
