"""Component ablations (Fig. 6, Table A2) on the embedded default.

Runs the recipe and every `conf/ablation/*.yaml` variant with the same seed, steps and budget, one
`python train.py ablation=<name>` subprocess after another, then prints the per-variant diagnostics at the
last step (final train success, dev TGC mean@k at the training budget, entropy, clip fraction, grad norm),
and writes `ablations.md`, `ablations.json`, `fig6_ablations.png` and `fig4_kl_anchor.png` (recipe vs no_kl).

    python bench/ablations.py --steps 50 [--variants no_kl n8] [-- extra.hydra=overrides ...]
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from canopy.tools.plots import plot_ablations, plot_drift  # noqa: E402
from canopy.tools.tb_scalars import read_scalars  # noqa: E402

VARIANTS = ["recipe"] + sorted(p.stem for p in (ROOT / "conf" / "ablation").glob("*.yaml"))


def run_variant(name: str, steps: int, eval_k: int, out_dir: Path, extra: list[str]) -> Path:
    run_dir = out_dir / name
    command = [
        sys.executable,
        "train.py",
        f"hydra.run.dir={run_dir}",
        f"trainer.max_steps={steps}",
        "report.eval_samples_per_task=0",
        f"eval.k={eval_k}",
        *extra,
    ]
    if name != "recipe":
        command.append(f"ablation={name}")
    started = time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "stdout.log", "w") as log:
        done = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"variant {name} failed (exit {done.returncode}): see {run_dir / 'stdout.log'}")
    print(f"{name}: {time.perf_counter() - started:.0f} s", flush=True)
    return run_dir


def diagnostics(name: str, run_dir: Path) -> dict:
    """Table A2's training-log quantities at the last step, plus dev TGC from the budget-transfer callback."""
    s = read_scalars(run_dir / "tensorboard")
    keys = ("reward/success", "actor/entropy", "actor/pg_clipfrac", "actor/grad_norm", "mismatch/logprob_gap")
    last = {key: s[key][-1][1] for key in keys}
    grad_norms = [v for _, v in s["actor/grad_norm"]]
    row = {
        "variant": name,
        "train_success": last["reward/success"],
        "entropy": last["actor/entropy"],
        "clipfrac": last["actor/pg_clipfrac"],
        "grad_norm_mean": sum(grad_norms) / len(grad_norms),
        "grad_norm_final": last["actor/grad_norm"],
        "engine_gap": last["mismatch/logprob_gap"],
    }
    transfer = run_dir / "budget_transfer.json"
    if transfer.is_file():
        row["dev_tgc"] = json.loads(transfer.read_text())[0]["metrics"]["all"]["tgc_mean"]
    row["score"] = row.get("dev_tgc", row["train_success"])
    return row


def format_table(rows: list[dict], eval_k: int) -> str:
    lines = [
        f"| Variant | train success | dev TGC m@{eval_k} | entropy | clip frac | grad norm (mean) | grad norm "
        "(final) | engine gap |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        dev = f"{100 * r['dev_tgc']:.1f}" if "dev_tgc" in r else "-"
        lines.append(
            f"| {r['variant']} | {r['train_success']:.3f} | {dev} | {r['entropy']:.3f} | {r['clipfrac']:.2g} | "
            f"{r['grad_norm_mean']:.3g} | {r['grad_norm_final']:.3g} | {r['engine_gap']:.2g} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--steps", type=int, default=50, help="optimizer steps per variant (the recipe's 200 take ~4 min)"
    )
    parser.add_argument("--eval-k", type=int, default=4, help="dev runs per task at the end (mean@k)")
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "ablations" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides given to every variant, e.g. data.tasks_per_step=4"
    )
    args = parser.parse_args()
    variants = ["recipe"] + [v for v in args.variants if v != "recipe"]  # the recipe is the reference
    rows = [diagnostics(v, run_variant(v, args.steps, args.eval_k, args.out, args.overrides)) for v in variants]
    table = format_table(rows, args.eval_k)
    (args.out / "ablations.json").write_text(json.dumps(rows, indent=2))
    (args.out / "ablations.md").write_text(f"Ablations, {args.steps} steps each, same seed and budget\n\n{table}\n")
    plot_ablations(rows, args.out / "fig6_ablations.png", metric="score")
    written = ["ablations.md", "ablations.json", "fig6_ablations.png"]
    if "no_kl" in variants:
        runs = {v: read_scalars(args.out / v / "tensorboard") for v in ("recipe", "no_kl")}
        plot_drift(runs, args.out / "fig4_kl_anchor.png")
        written.append("fig4_kl_anchor.png")
    print(f"\n{table}\n\nwritten under {args.out}: {', '.join(written)}")


if __name__ == "__main__":
    main()
