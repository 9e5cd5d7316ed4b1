"""Look at logged episodes (`canopy/trajectories.py`). `view` writes the run's rollout viewer (`<run>/viewer.html`,
canopy/reports/viewer.py); `replay` prints one episode as the model saw it: token-exact, with the action mask, for
debugging tokenization and masking (it needs `trajectories.token_ids=true`, the default).

    python -m canopy.tools.episodes view <run dir> [--steps 5] [--max-chars 4000]
    python -m canopy.tools.episodes replay <run dir> --step N --task T [--sample I] [--stream train] [--tokens]

Each segment (the prompt, then per turn the action, mask 1, and the observation, mask 0) is printed as its tokens
joined by `|`, newlines and tabs written `\\n` and `\\t`, so token boundaries show; `--tokens` prints one line per
token (position, id, mask, token). A segment whose decoded text does not re-encode to the same ids is flagged: a
loop that re-tokenized the conversation would train on other tokens than the engine sampled.
"""

import argparse
import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

from canopy.reports.viewer import build_viewer
from canopy.trajectories import META, expand_runs, read_step, step_files, step_path


class ReplayError(Exception):
    """A request these commands cannot serve; the message names the fix."""


def find_episode(run_dir: Path, stream: str, step: int, task: str, sample: int) -> dict:
    """The logged record of (stream, step, task, sample), or a `ReplayError` listing what there is."""
    folder = run_dir / "trajectories" / stream
    if not folder.is_dir():
        streams = sorted(p.name for p in (run_dir / "trajectories").glob("*") if p.is_dir())
        raise ReplayError(
            f"no trajectory logs of stream {stream!r} under {run_dir}: streams logged: {streams or 'none'}"
        )
    path = step_path(folder, step)
    if not path.is_file():
        steps = list(step_files(folder))
        shown = ", ".join(map(str, steps[:10])) + (", ..." if len(steps) > 10 else "")
        raise ReplayError(f"step {step} of {stream} was not logged (sampled out, or pruned): logged steps: {shown}")
    records = read_step(path)
    matches = [r for r in records if r["task_id"] == task]
    if not matches:
        tasks = sorted({r["task_id"] for r in records})
        raise ReplayError(f"task {task!r} is not in step {step} of {stream}: its tasks are {', '.join(tasks)}")
    record = next((r for r in matches if r["sample_index"] == sample), None)
    if record is None:
        samples = sorted(r["sample_index"] for r in matches)
        raise ReplayError(f"task {task} has no sample {sample} in step {step}: its samples are {samples}")
    if "token_ids" not in record:
        raise ReplayError(
            f"step {step} of {stream} was logged without token ids (trajectories.token_ids=false): rerun with "
            "trajectories.token_ids=true to replay"
        )
    return record


def segments(record: dict) -> list[tuple[str, int, int]]:
    """(label, start, end) of the prompt, then each turn's action and observation."""
    mask, start, turn, out = expand_runs(record["mask_runs"]), 0, 0, []
    prompt = record["prompt_tokens"]
    out.append(("prompt", 0, prompt))
    start = prompt
    while start < len(mask):
        end = start
        while end < len(mask) and mask[end] == mask[start]:
            end += 1
        if mask[start]:
            turn += 1
        out.append((f"action {turn}" if mask[start] else f"observation {turn}", start, end))
        start = end
    return out


def replay(record: dict, tokenizer, per_token: bool = False) -> str:
    """The episode's tokens segment by segment, with its outcome and the re-encoding check."""
    ids, mask = record["token_ids"], expand_runs(record["mask_runs"])
    verdict = record["verdict"]
    outcome = record["quarantine"] and f"quarantined ({record['quarantine']})"
    if not outcome:
        outcome = f"{'success' if verdict and verdict['success'] else 'failure'}, reward {record['reward']}"
    advantage = record["advantage"]
    lines = [
        f"task {record['task_id']} (tier {record['tier']}), step {record['step']}, sample {record['sample_index']} "
        f"of group {record['group']}: ending {record['ending']}, {outcome}"
        + ("" if advantage is None else f", advantage {advantage:+.4f}")
        + f"; weight versions {record['weight_versions']}; {len(ids)} tokens, {sum(mask)} of them actions"
    ]
    drifted = 0
    for label, start, end in segments(record):
        chunk = ids[start:end]
        tokens = tokenizer.convert_ids_to_tokens(chunk)
        lines.append(f"\n[{label}: {end - start} tokens, mask {mask[start]}]")
        if per_token:
            lines += [
                f"{start + i:6d} {token_id:8d}  {mask[start + i]}  {token!r}"
                for i, (token_id, token) in enumerate(zip(chunk, tokens))
            ]
        else:
            lines.append("|".join(token.replace("\n", "\\n").replace("\t", "\\t") for token in tokens))
        again = tokenizer.encode(tokenizer.decode(chunk, skip_special_tokens=False), add_special_tokens=False)
        if again != chunk:
            drifted += 1
            lines.append(f"!! its text re-encodes to {len(again)} tokens, not these {len(chunk)}")
    lines.append(
        f"\n{drifted} segment(s) do not survive decode -> encode: re-tokenizing this conversation would change it"
        if drifted
        else "\nevery segment survives decode -> encode"
    )
    return "\n".join(lines)


def tokenizer_for(run_dir: Path, given: str | None):
    """The tokenizer the run logged with (`meta.json`), else `<run>/final_hf`, unless `--tokenizer` names one."""
    candidates = [given] if given else []
    meta = run_dir / "trajectories" / META
    if not given and meta.is_file():
        candidates.append(json.loads(meta.read_text())["tokenizer"])
    if not given:
        candidates.append(str(run_dir / "final_hf"))
    for path in candidates:
        if Path(path).is_dir():
            return AutoTokenizer.from_pretrained(path)
    raise ReplayError(f"no tokenizer found at {', '.join(candidates)}: pass --tokenizer <HF checkpoint directory>")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    view = commands.add_parser("view", help="write <run dir>/viewer.html")
    view.add_argument("run_dir", type=Path)
    view.add_argument("--steps", type=int, default=5, help="the last logged steps of each stream to browse")
    view.add_argument("--max-chars", type=int, default=4000, help="longer actions and observations are cut")
    one = commands.add_parser("replay", help="print one episode token by token")
    one.add_argument("run_dir", type=Path)
    one.add_argument("--step", type=int, required=True)
    one.add_argument("--task", required=True)
    one.add_argument("--sample", type=int, default=0, help="the episode's sample index in its group")
    one.add_argument("--stream", default="train", help="train, or eval_<budget> (evaluations)")
    one.add_argument("--tokens", action="store_true", help="one line per token: position, id, mask, token")
    one.add_argument("--tokenizer", help="an HF checkpoint directory, if the run's tokenizer has moved")
    args = parser.parse_args(argv)
    try:
        if args.command == "view":
            if not (args.run_dir / "trajectories").is_dir():
                raise ReplayError(f"{args.run_dir} has no trajectory logs: train or evaluate with trajectories.enabled")
            print(f"viewer: {build_viewer(args.run_dir, args.steps, args.max_chars)}")
            return
        record = find_episode(args.run_dir, args.stream, args.step, args.task, args.sample)
        print(replay(record, tokenizer_for(args.run_dir, args.tokenizer), args.tokens))
    except ReplayError as error:
        sys.exit(f"{args.command}: {error}")


if __name__ == "__main__":
    main()
