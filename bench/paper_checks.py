"""The paper's claims and open checks over seeds, on the embedded testbed (issue 16).

Each check is `python train.py` with a few overrides, run for every seed:
- recipe: the CANOPY recipe;
- Table A2: each component ablation (`conf/ablation/*.yaml`): token-level loss, hardest data, KL anchor, the
  smaller group, strict on-policy, and the dense reward;
- Appendix F, the compute-matched pair: the smaller group with proportionally more tasks per step, so that the
  rollouts per step equal the recipe's (the check the paper names as its most important open one);
- Appendix G, the sensitivity pair: serving faults injected at a set rate per action (`env.fault_rate`), the
  faulted episodes quarantined (removed from their groups) or scored as failures;
- beyond the paper: `group_size=auto` (coverage-adaptive groups under the recipe's rollout budget), and advantages
  centred by the group's mean without dividing by its std (`ablation=no_std`: Dr. GRPO, LOOP).

Every finished run leaves `<out>/<check>/seed<k>/result.json`: its wall time and overrides, and its numbers and
curves read from its TensorBoard log, so the report needs nothing else and the result files alone (a few KB each;
the rest of a run folder can go) carry a benchmark across machines and sessions. A run with one is never redone,
so an interrupted benchmark resumes where it stopped, and `--shard i/N` splits the runs over N processes (or
machines sharing the folder). Once a shard ends, the report is
rebuilt from every finished run there: `paper_checks.md` (final train success, dev TGC mean@k, hardest-tier dev
TGC, each check's dev TGC difference to the recipe paired by seed, the step each seed took off; then entropy, clip
fraction, grad norm and quarantined share; each with its 95% bootstrap interval over seeds), `paper_checks.json`,
`fig6_paper_checks.png` (bars with error bars) and `fig3_fig4_paper_checks.png` (coverage, entropy, train success
and dev score against steps, mean and range over seeds).

    python bench/paper_checks.py --seeds 0 1 2 --steps 150 [--checks recipe no_kl] [--shard 0/2] [-- overrides]
    python bench/paper_checks.py --out <folder> --report-only
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from canopy.config import compose_config  # noqa: E402
from canopy.reports.plots import plot_check_bars, plot_check_curves  # noqa: E402
from canopy.reports.stats import bootstrap_mean, describe, paired_difference  # noqa: E402
from canopy.reports.tb_scalars import read_scalars  # noqa: E402

FAULT_RATE = 0.04  # Appendix G pair: per action; 13-14% of the embedded episodes, more of the long (failing) ones
LAST = 10  # train success and entropy: the mean of the last LAST steps (one step's value is noisy at n x tasks)


def checks(extra: list[str]) -> dict[str, tuple[str, list[str]]]:
    """Each check's (what it checks, overrides). The compute-matched pair's task batch is scaled by the recipe's
    group size over the smaller group's, as composed with `extra`."""
    recipe, small = compose_config(extra), compose_config([*extra, "ablation=n8"])
    scale = recipe.algorithm.group_size / small.algorithm.group_size
    matched_tasks = round(recipe.data.tasks_per_step * scale)
    return {
        "recipe": ("the recipe", []),
        "seq_mean": ("Table A2: w/o token-level loss", ["ablation=seq_mean"]),
        "drop_hardest": ("Table A2: w/o hardest data", ["ablation=drop_hardest"]),
        "no_kl": ("Table A2: w/o KL anchor", ["ablation=no_kl"]),
        "n8": (f"Table A2: group n={small.algorithm.group_size}", ["ablation=n8"]),
        "half_minibatch": ("Table A2: w/o strict on-policy", ["ablation=half_minibatch"]),
        "dense_reward": ("Table A2: dense reward", ["ablation=dense_reward"]),
        "n8_matched": (
            f"App. F: n={small.algorithm.group_size} x {matched_tasks} tasks (compute-matched)",
            ["ablation=n8", f"data.tasks_per_step={matched_tasks}"],
        ),
        "faults": (f"App. G: fault rate {FAULT_RATE}, quarantined", [f"env.fault_rate={FAULT_RATE}"]),
        "faults_as_failure": (
            f"App. G: fault rate {FAULT_RATE}, scored as failures",
            [f"env.fault_rate={FAULT_RATE}", "ablation=quarantine_as_failure"],
        ),
        "auto_group": ("beyond: group_size=auto", ["ablation=auto_group"]),
        "no_std": ("beyond: no group std (Dr. GRPO / LOOP)", ["ablation=no_std"]),
    }


def run_one(run_dir: Path, overrides: list[str], args) -> dict:
    """One training run (from scratch: what an interrupted run left is removed), then its result, whose
    `result.json` marks it finished."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    command = [
        sys.executable,
        "train.py",
        f"hydra.run.dir={run_dir}",
        f"trainer.max_steps={args.steps}",
        f"eval.k={args.eval_k}",
        f"eval.every_n_steps={args.eval_every}",
        "report.eval_samples_per_task=0",
        *overrides,
    ]
    environment = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
    started = time.perf_counter()
    with open(run_dir / "stdout.log", "w") as log:
        done = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=environment)
    if done.returncode:
        raise RuntimeError(f"exit {done.returncode}: see {run_dir / 'stdout.log'}")
    result = {"wall_s": time.perf_counter() - started, "overrides": overrides, **result_of(run_dir / "tensorboard")}
    staged = run_dir / "result.json.tmp"
    staged.write_text(json.dumps(result))
    staged.replace(run_dir / "result.json")  # written whole, or not at all
    return result


def result_of(log_dir: Path) -> dict:
    """What the report needs from a run's TensorBoard log: the final numbers and the curves."""
    s = read_scalars(log_dir)
    values = {key: [v for _, v in points] for key, points in s.items()}
    hardest = max((k for k in s if k.startswith("eval/training_budget/tgc_tier")), key=lambda k: int(k[-1]))
    episodes, quarantined = sum(values["rollout/episodes"]), sum(values["rollout/quarantined"])
    return {
        "train_success": last_mean(values["reward/success"]),
        "dev_tgc": values["eval/training_budget/tgc_all"][-1],
        "hard_tgc": values[hardest][-1],
        "entropy": last_mean(values["actor/entropy"]),
        "clipfrac": last_mean(values["actor/pg_clipfrac"]),
        "grad_norm": last_mean(values["actor/grad_norm"]),
        "quarantined": quarantined / episodes,
        "curves": {
            "success": values["reward/success"],
            "entropy": values["actor/entropy"],
            "mixed": values["coverage/mixed"],
            "dev_tgc": s["eval/training_budget/tgc_all"],
        },
    }


def last_mean(values: list[float]) -> float:
    return sum(values[-LAST:]) / len(values[-LAST:])


def takeoff(success: list[float], level: float) -> int | None:
    """The first step whose trailing LAST-step mean train success reaches `level` (None if none did): how fast a
    run learns, where the final numbers only say whether it had by the last step."""
    for step in range(LAST - 1, len(success)):
        if sum(success[step - LAST + 1 : step + 1]) / LAST >= level:
            return step + 1
    return None


SCORES = ("train_success", "dev_tgc", "hard_tgc")  # the first table's columns, in percent
DIAGNOSTICS = ("entropy", "clipfrac", "grad_norm", "quarantined")  # Table A2's training-log columns, and Appendix G's


def summarize(results: dict[str, dict[int, dict]]) -> list[dict]:
    """Per check: each column's mean and bootstrap interval over seeds, and the dev TGC difference to the recipe
    paired by seed (their mean with its interval, and each seed's own, None where the recipe lacks that seed)."""
    reference = {seed: r["dev_tgc"] for seed, r in results.get("recipe", {}).items()}
    rows = []
    for check, by_seed in results.items():
        row = {
            "check": check,
            "seeds": sorted(by_seed),
            "takeoff": [by_seed[seed]["takeoff"] for seed in sorted(by_seed)],
        }
        for key in (*SCORES, *DIAGNOSTICS):
            row[key] = bootstrap_mean([r[key] for r in by_seed.values()])
        if check != "recipe" and set(reference) & set(by_seed):
            row["delta_dev"] = paired_difference({s: r["dev_tgc"] for s, r in by_seed.items()}, reference)
            row["delta_dev_per_seed"] = [
                by_seed[seed]["dev_tgc"] - reference[seed] if seed in reference else None for seed in row["seeds"]
            ]
        rows.append(row)
    return rows


def format_tables(rows: list[dict], what: dict[str, str], eval_k: int, takeoff_level: float) -> str:
    """The scores (percent) with the dev TGC difference to the recipe, then Table A2's training diagnostics; each a
    mean over seeds with its 95% bootstrap interval."""
    scores = [
        f"| Check | what | seeds | train success | dev TGC m@{eval_k} | hardest-tier dev TGC | dev TGC vs recipe | "
        f"vs recipe, per seed | step reaching {takeoff_level:.0%} train success, per seed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    diagnostics = ["| Check | entropy | clip frac | grad norm | quarantined % |", "|---|---|---|---|---|"]
    for r in rows:
        delta = describe(r["delta_dev"], signed=True) if "delta_dev" in r else "-"
        per_seed = ", ".join("-" if d is None else f"{100 * d:+.1f}" for d in r.get("delta_dev_per_seed", []))
        reached = ", ".join("-" if step is None else str(step) for step in r["takeoff"])
        cells = [r["check"], what.get(r["check"], ""), str(len(r["seeds"])), *(describe(r[k]) for k in SCORES)]
        cells += [delta, per_seed or "-", reached]
        scores.append(f"| {' | '.join(cells)} |")
        cells = [
            r["check"],
            describe(r["entropy"], scale=1.0, digits=3),
            describe(r["clipfrac"], scale=1.0, digits=4),
            describe(r["grad_norm"], scale=1.0, digits=3),
            describe(r["quarantined"]),
        ]
        diagnostics.append(f"| {' | '.join(cells)} |")
    return "\n".join(scores) + "\n\nTraining diagnostics (mean of the last 10 steps):\n\n" + "\n".join(diagnostics)


def report(out: Path, names: list[str], what: dict[str, str], eval_k: int, takeoff_level: float) -> str:
    """Rebuild the table and figures from every finished run under `out`."""
    results = {
        check: {int(path.parent.name.removeprefix("seed")): json.loads(path.read_text()) for path in runs}
        for check in names
        if (runs := sorted((out / check).glob("seed*/result.json")))
    }
    for by_seed in results.values():
        for result in by_seed.values():
            result["takeoff"] = takeoff(result["curves"]["success"], takeoff_level)
    rows = summarize(results)
    if not rows:
        return "no finished run yet"
    table = format_tables(rows, what, eval_k, takeoff_level)
    walls = [r["wall_s"] for by_seed in results.values() for r in by_seed.values()]
    header = f"Paper checks: {len(walls)} runs, {sum(walls) / 60:.0f} min of runs in all; mean [95% bootstrap interval]"
    (out / "paper_checks.md").write_text(f"{header}\n\n{table}\n")
    (out / "paper_checks.json").write_text(
        json.dumps([{k: (v.__dict__ if hasattr(v, "__dict__") else v) for k, v in r.items()} for r in rows], indent=2)
    )
    plot_check_bars(rows, out / "fig6_paper_checks.png")
    plot_check_curves(results, out / "fig3_fig4_paper_checks.png")
    return f"{header}\n\n{table}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per run (the recipe converges by ~140)")
    parser.add_argument("--eval-k", type=int, default=4, help="dev runs per task (mean@k)")
    parser.add_argument("--eval-every", type=int, default=50, help="dev evaluations during training (curves)")
    parser.add_argument("--checks", nargs="+", help="a subset of the checks (default: all)")
    parser.add_argument("--shard", default="0/1", help="i/N: run every N-th run starting at the i-th")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS of each run (e.g. 1 with 2 shards on 2 cores)")
    parser.add_argument("--takeoff", type=float, default=0.8, help="a run took off once its 10-step mean reaches it")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "paper_checks")
    parser.add_argument("--report-only", action="store_true", help="rebuild the report from the finished runs")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides given to every run, e.g. data.tasks_per_step=4")
    args = parser.parse_args()
    catalogue = checks(args.overrides)
    names = args.checks or list(catalogue)
    unknown = sorted(set(names) - set(catalogue))
    if unknown:
        sys.exit(f"unknown checks {unknown}: use some of {', '.join(catalogue)}")
    what = {name: catalogue[name][0] for name in names}
    if args.report_only:
        print(report(args.out, names, what, args.eval_k, args.takeoff))
        return
    index, count = (int(part) for part in args.shard.split("/"))
    runs = [(name, seed) for seed in args.seeds for name in names][index::count]  # seed-major: all checks early
    failed = []
    for number, (name, seed) in enumerate(runs, start=1):
        run_dir = args.out / name / f"seed{seed}"
        if (run_dir / "result.json").is_file():
            print(f"[{number}/{len(runs)}] {name} seed {seed}: done before", flush=True)
            continue
        overrides = [*args.overrides, f"seed={seed}", *catalogue[name][1]]
        try:
            result = run_one(run_dir, overrides, args)
        except RuntimeError as error:
            failed.append(f"{name} seed {seed}: {error}")
            print(f"[{number}/{len(runs)}] {name} seed {seed}: FAILED, {error}", flush=True)
            continue
        print(
            f"[{number}/{len(runs)}] {name} seed {seed}: dev TGC {100 * result['dev_tgc']:.1f}, "
            f"train success {result['train_success']:.3f}, {result['wall_s']:.0f} s",
            flush=True,
        )
    print(f"\n{report(args.out, names, what, args.eval_k, args.takeoff)}\n\nwritten under {args.out}")
    if failed:
        sys.exit(f"{len(failed)} runs failed:\n" + "\n".join(failed))


if __name__ == "__main__":
    main()
