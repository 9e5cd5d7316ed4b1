"""bench/step_profile.py's attribution, on hand-built samples: a sample's phase is the innermost phase function on
its stack, it weighs the time since the sample before, and what is outside every phase goes to the innermost frame
of Canopy's or Lightning's code."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from step_profile import split  # noqa: E402

STEP = ("/x/site-packages/lightning/pytorch/loops/training_epoch_loop.py", "advance")
NEXT_BATCH = ("/repo/canopy/datamodules/rollout.py", "next_batch")
GENERATE = ("/repo/canopy/rollout/local.py", "generate")
RENDER = ("/repo/canopy/rollout/chat.py", "render_observation")
TOKENIZER = ("/x/site-packages/transformers/tokenization_utils_base.py", "apply_chat_template")
UPDATE = ("/repo/canopy/modules/canopy_module.py", "_optimizer_step")
LOG = ("/x/site-packages/lightning/fabric/loggers/tensorboard.py", "log_metrics")


def test_each_sample_goes_to_its_innermost_phase_weighted_by_its_time():
    samples = [
        ([STEP, NEXT_BATCH, GENERATE], 0.4),  # generation, though next_batch is on the stack too
        ([STEP, NEXT_BATCH, RENDER, TOKENIZER], 0.2),  # the rollout's rest, named by Canopy's innermost frame
        ([STEP, UPDATE], 0.6),
        ([STEP, LOG], 0.1),  # other: Lightning's frame
        ([NEXT_BATCH, GENERATE], 5.0),  # outside a step (a base-policy report): not the step's
    ]
    seconds, where = split(samples, steps=2)
    assert seconds == pytest.approx({"generation": 0.2, "rollout rest": 0.1, "update": 0.3, "other": 0.05})
    assert where["generation"] == pytest.approx({"canopy/rollout/local.py:generate": 0.2})
    assert where["rollout rest"] == pytest.approx({"canopy/rollout/chat.py:render_observation": 0.1})
    assert where["other"] == pytest.approx({"lightning/fabric/loggers/tensorboard.py:log_metrics": 0.05})


def test_generation_is_named_down_to_the_model_and_a_venv_under_a_canopy_folder_is_not_canopy():
    """Generation's samples go to the innermost Canopy, Transformers or torch frame; a package is found at its last
    occurrence in the path, so torch inside `/home/u/canopy/.venv` is torch's."""
    venv = "/home/u/canopy/.venv/lib/python3.11/site-packages"
    model = (f"{venv}/transformers/models/qwen3/modeling_qwen3.py", "forward")
    linear = (f"{venv}/torch/nn/modules/linear.py", "forward")
    samples = [
        ([STEP, NEXT_BATCH, GENERATE, model, linear], 0.3),
        ([STEP, NEXT_BATCH, GENERATE, model], 0.1),
        ([STEP, (f"{venv}/lightning/pytorch/core/module.py", "log")], 0.2),
    ]
    _, where = split(samples, steps=1)
    assert where["generation"] == pytest.approx(
        {"torch/nn/modules/linear.py:forward": 0.3, "transformers/models/qwen3/modeling_qwen3.py:forward": 0.1}
    )
    assert where["other"] == pytest.approx({"lightning/pytorch/core/module.py:log": 0.2})


def test_the_operator_report_splits_each_phase_into_operators_and_the_python_around_them():
    from step_profile import OpProfile

    ops = OpProfile(skip=2)
    ops.wall.update({"reference": 0.5, "update": 2.0})  # over the 4 - 2 profiled steps
    ops.ops["reference"].update({"aten::mm": 0.3, "aten::mul": 0.1})
    ops.ops["update"].update({"aten::mm": 1.0, "aten::add": 0.6})
    text = ops.report(steps=4, top=1, command="python bench/step_profile.py --ops")
    assert "reference: 0.250 s per step under the profiler, 0.200 s in torch operators, 0.050 s around them" in text
    assert "| `aten::mm` | 0.1500 | 60% |" in text and "aten::mul" not in text  # top 1 only
    assert "update: 1.000 s per step under the profiler, 0.800 s in torch operators, 0.200 s around them" in text
