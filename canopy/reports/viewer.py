"""The rollout viewer: one self-contained HTML page per run (`<run>/viewer.html`; no server, opens from disk).

It shows the run's figures (the PNGs in the run folder, inlined), train success by tier, group composition and the
invalid-action share (format health) against the step from the trajectory logs' index (every logged step, even pruned
ones), and a browser of the last `steps` logged steps of each stream (train, and each evaluation): groups by task
with their successes, the episodes of a group with reward and advantage, and an episode turn by turn, the policy's
actions set apart from what the environment returned, its invalid actions marked. Long texts are cut to `max_chars`
(head and tail kept). The address names what is shown (`viewer.html#stream=train&step=12&task=T&sample=3`,
`episode_address`), so a link opens that episode.

    python -m canopy.tools.episodes view <run dir> [--steps 5] [--max-chars 4000]
    python -m canopy.tools.viewer <run dir> <steps> <max chars>   # the rollout viewer callback's build
"""

import base64
import json
import time
from pathlib import Path
from urllib.parse import urlencode

from canopy.trajectories import read_index, read_step, step_files, step_summary

FIGURES = (  # in the order a reader wants them; any other PNG of the run folder follows
    "learning_curve.png",
    "fig2_coverage.png",
    "fig3_group_composition.png",
    "fig4_entropy_score.png",
    "fig5_budget_transfer.png",
)


def cut(text: str, max_chars: int) -> str:
    """`text`, its middle replaced by a note when longer than `max_chars`."""
    if len(text) <= max_chars:
        return text
    keep = max_chars // 2
    return f"{text[:keep]}\n[... {len(text) - 2 * keep} characters cut by the viewer ...]\n{text[-keep:]}"


def episode_view(record: dict, max_chars: int) -> dict:
    """What the page needs of an episode (no token ids)."""
    view = {key: value for key, value in record.items() if key not in ("token_ids", "mask_runs")}
    view["prompt"] = cut(record["prompt"], max_chars)
    view["turns"] = [
        {**turn, "action": cut(turn["action"], max_chars), "observation": cut(turn["observation"], max_chars)}
        for turn in record["turns"]
    ]
    return view


def collect(run_dir: Path, steps: int, max_chars: int) -> dict:
    """The page's data: per stream, the index (curves) and the episodes of its last `steps` logged steps."""
    logs = run_dir / "trajectories"
    streams = {}
    for folder in sorted(p for p in logs.glob("*") if p.is_dir()) if logs.is_dir() else []:
        records = {step: read_step(path) for step, path in list(step_files(folder).items())[-steps:]}
        streams[folder.name] = {  # a log without an index (written before there was one): the steps it holds
            "index": read_index(folder) or [step_summary(step, rs) for step, rs in records.items()],
            "steps": {step: [episode_view(r, max_chars) for r in rs] for step, rs in records.items()},
        }
    return {"run": str(run_dir), "generated": time.strftime("%Y-%m-%d %H:%M:%S"), "streams": streams}


def figures(run_dir: Path) -> list[tuple[str, str]]:
    """(name, data URL) of the run folder's PNG figures."""
    found = {p.name: p for p in run_dir.glob("*.png")}
    names = [n for n in FIGURES if n in found] + sorted(set(found) - set(FIGURES))
    return [(n, "data:image/png;base64," + base64.b64encode(found[n].read_bytes()).decode()) for n in names]


def episode_address(run_dir: str | Path, stream: str, step: int, task_id: str, sample: int) -> str:
    """The `file://` address of the run's page opened at one episode."""
    where = urlencode({"stream": stream, "step": step, "task": task_id, "sample": sample})
    return f"{(Path(run_dir) / 'viewer.html').absolute().as_uri()}#{where}"


def build_viewer(run_dir: str | Path, steps: int = 5, max_chars: int = 4000) -> Path:
    """Write `<run_dir>/viewer.html` whole (a temporary name, then renamed) and return its path."""
    run_dir = Path(run_dir)
    data = json.dumps(collect(run_dir, steps, max_chars)).replace("</", "<\\/")  # safe inside <script>
    images = "\n".join(
        f'<figure><img alt="{name}" src="{url}"><figcaption>{name}</figcaption></figure>'
        for name, url in figures(run_dir)
    )
    page = Path(__file__).with_name("viewer_page.html").read_text(encoding="utf-8")  # the page, its script and style
    page = page.replace("__FIGURES__", images or "<p>no figures yet</p>")
    page = page.replace("__DATA__", data)  # last: the episodes' text may hold anything
    out, staged = run_dir / "viewer.html", run_dir / ".viewer.html.tmp"
    staged.write_text(page, encoding="utf-8")
    staged.replace(out)
    return out
