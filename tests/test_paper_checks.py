"""bench/paper_checks.py end to end at one step: two shards share the runs, a finished run is never redone, and the
report (tables with bootstrap intervals, figures) is built from whatever has finished."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def paper_checks(out: Path, tiny: Path, *args: str, shard: str = "0/1") -> subprocess.Popen:
    command = [
        sys.executable,
        "bench/paper_checks.py",
        "--out",
        str(out),
        "--steps",
        "1",
        "--eval-k",
        "1",
        "--eval-every",
        "1",
        "--seeds",
        "0",
        "1",
        "--checks",
        "recipe",
        "n8_matched",
        "--shard",
        shard,
        *args,
        "--",
        f"model.tiny.dir={tiny}",
        "model.tiny.format_warmup_steps=30",
        "data.tasks_per_step=2",
        "eval.split=test",
    ]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen) -> str:
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-3000:]
    return output


@pytest.mark.slow
def test_shards_share_the_runs_and_a_finished_run_is_never_redone(tmp_path, warm_tiny):
    shards = [paper_checks(tmp_path, warm_tiny, shard=f"{i}/2") for i in range(2)]
    outputs = [finish(process) for process in shards]
    runs = [(check, seed) for check in ("recipe", "n8_matched") for seed in (0, 1)]
    results = {run: tmp_path / run[0] / f"seed{run[1]}" / "result.json" for run in runs}
    assert all(path.is_file() for path in results.values())
    finished = [line for output in outputs for line in output.splitlines() if re.match(r"\[\d/2\] .*: dev TGC", line)]
    assert len(finished) == 4  # each run once, by one shard
    matched = json.loads(results["n8_matched", 0].read_text())["overrides"]
    assert "ablation=n8" in matched and "data.tasks_per_step=4" in matched  # n=8 x 4 tasks = n=16 x 2 tasks

    first = {run: path.stat().st_mtime_ns for run, path in results.items()}
    results["recipe", 1].unlink()  # as if that run had been interrupted
    output = finish(paper_checks(tmp_path, warm_tiny))
    assert output.count("done before") == 3 and "recipe seed 1: dev TGC" in output
    assert all(results[run].stat().st_mtime_ns == first[run] for run in runs if run != ("recipe", 1))

    table = (tmp_path / "paper_checks.md").read_text()
    recipe = next(line for line in table.splitlines() if line.startswith("| recipe |"))
    matched = next(line for line in table.splitlines() if line.startswith("| n8_matched |"))
    assert recipe.split(" | ")[2] == "2" and recipe.count("[") == 3  # two seeds; three scores with intervals
    assert matched.count("[") == 4  # and the paired difference to the recipe
    rows = json.loads((tmp_path / "paper_checks.json").read_text())
    assert [r["check"] for r in rows] == ["recipe", "n8_matched"] and rows[1]["seeds"] == [0, 1]
    assert rows[0]["dev_tgc"]["low"] <= rows[0]["dev_tgc"]["mean"] <= rows[0]["dev_tgc"]["high"]
    for name in ("fig6_paper_checks.png", "fig3_fig4_paper_checks.png"):
        assert (tmp_path / name).stat().st_size > 0, name

    for run_folder in results.values():  # the result files alone carry the benchmark (e.g. committed, elsewhere)
        for other in run_folder.parent.iterdir():
            if other.name != "result.json":
                shutil.rmtree(other) if other.is_dir() else other.unlink()
    again = finish(paper_checks(tmp_path, warm_tiny, "--report-only"))
    assert "done before" not in again and (tmp_path / "paper_checks.md").read_text() == table


def test_an_unknown_check_is_named_with_the_choices(tmp_path):
    process = paper_checks(tmp_path, tmp_path / "tiny", "--checks", "no_such_check")  # stops before any model
    output, _ = process.communicate(timeout=300)
    assert process.returncode != 0 and "unknown checks ['no_such_check']: use some of recipe, seq_mean" in output


def test_each_seeds_difference_to_the_recipe_is_reported_beside_their_mean():
    from bench.paper_checks import DIAGNOSTICS, SCORES, format_tables, summarize

    def run(dev_tgc: float, takeoff: int | None) -> dict:
        return {**{key: 0.5 for key in (*SCORES, *DIAGNOSTICS)}, "dev_tgc": dev_tgc, "takeoff": takeoff}

    results = {
        "recipe": {0: run(0.50, 100), 1: run(0.70, None)},
        "variant": {0: run(0.60, 90), 1: run(0.65, 120), 2: run(0.90, 80)},  # seed 2: no recipe run to pair with
    }
    recipe, variant = summarize(results)
    assert "delta_dev_per_seed" not in recipe
    assert variant["delta_dev_per_seed"][0] == pytest.approx(0.10) and variant["delta_dev_per_seed"][2] is None
    assert variant["delta_dev_per_seed"][1] == pytest.approx(-0.05)
    assert variant["delta_dev"].mean == pytest.approx(0.025)  # over the paired seeds 0 and 1 only
    line = next(x for x in format_tables([recipe, variant], {}, 4, 0.8).splitlines() if x.startswith("| variant |"))
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert cells[7:] == ["+10.0, -5.0, -", "90, 120, 80"]  # per seed: vs recipe, then the step reaching 80%
