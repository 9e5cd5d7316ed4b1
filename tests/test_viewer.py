"""The rollout viewer, loaded in a real headless Chromium (`make system` installs chromium-headless-shell): the page
opens from disk, the address navigates to an episode, and the DOM shows that episode, its group and the curves."""

import gzip
import html
import json
import os
import re
import sys

import matplotlib
import pytest

from canopy.reports.viewer import build_viewer, cut
from canopy.trajectories import TrajectoryLog, read_step
from tests.helpers import HEAVY, datamodule, dom, element, imports_of, logged_episodes
from tests.scripted import ScriptedEngine

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tokenizer):
    """A run folder with three logged training steps of the vault world, one evaluation and a figure."""
    import matplotlib.pyplot as plt

    run = tmp_path_factory.mktemp("run")
    log = TrajectoryLog(run / "trajectories", tokenizer, "m", logged_episodes(), "sparse")
    replies = ["guest login", "keyless key", "locked unlock", "shut open"]
    dm = datamodule(tokenizer, ScriptedEngine(tokenizer, replies), trajectory_log=log)
    for _ in range(3):
        dm.next_batch()
    groups = [dm.tasks[:2]]
    log.log_step("eval_embedded", 3, [[t] for t in _episodes(dm, groups[0])])
    log.close()
    figure, axes = plt.subplots(figsize=(2, 1.5))
    axes.plot([0, 1], [0, 1])
    figure.savefig(run / "learning_curve.png")
    plt.close(figure)
    return run


def _episodes(dm, tasks):
    from canopy.rollout.agent_loop import run_episodes

    trajectories, _ = run_episodes(dm.engine, dm.env, dm.tokenizer, [(t, 0) for t in tasks], dm.budget, dm.sampling)
    return trajectories


@pytest.mark.slow
def test_the_address_opens_an_episode_in_a_real_browser(run_dir, tmp_path):
    page = build_viewer(run_dir)
    records = read_step(run_dir / "trajectories" / "train" / "step_000001.jsonl.gz")
    record = next(r for r in records if r["sample_index"] == 2 and r["group"] == 1)
    shown = dom(page, f"stream=train&step=1&task={record['task_id']}&sample=2", tmp_path)
    episode = element(shown, "episode-view")
    assert f"<td>{record['task_id']}</td>" in episode and "<td>1</td>" in episode  # the task, at step 1
    assert f"<td>{record['reward']:.3f}</td>" in episode and f"<td>{record['advantage']:.3f}</td>" in episode
    assert html.escape(record["turns"][0]["action"]) in episode  # the policy's first action, verbatim
    assert 'class="turn action"' in episode and 'class="turn observation"' in episode  # set apart from the env's
    assert episode.count('class="turn action"') == record["num_turns"]
    groups = element(shown, "groups")
    assert re.search(rf'class="selected" data-task="{re.escape(record["task_id"])}"', groups)
    assert re.search(r'class="selected" data-sample="2"', element(shown, "episodes"))
    assert shown.count('data-line="tier ') >= 2 and 'data-line="mixed"' in shown  # the curves from the index
    assert 'alt="learning_curve.png"' in shown and 'src="data:image/png;base64,' in shown  # the figure, inlined


@pytest.mark.slow
def test_invalid_actions_are_marked_counted_filtered_and_curved(tokenizer, tmp_path):
    """Format health in the page: the episode's invalid actions counted and each marked at its turn, the filter that
    keeps the episodes with one, and the invalid-action share against the step; `episode_address` opens it."""
    from canopy.reports.viewer import episode_address

    log = TrajectoryLog(tmp_path / "run" / "trajectories", tokenizer, "m", logged_episodes(), "sparse")
    dm = datamodule(tokenizer, ScriptedEngine(tokenizer, ["hello", "guest login", "vault"]), trajectory_log=log)
    dm.next_batch()
    log.close()
    record = next(r for r in read_step(log.root / "train" / "step_000000.jsonl.gz") if r["num_turns"] == 4)
    page = build_viewer(tmp_path / "run")
    address = episode_address(tmp_path / "run", "train", 0, record["task_id"], record["sample_index"])
    shown = dom(page, address.split("#")[1], tmp_path)
    episode = element(shown, "episode-view")
    assert '<tr data-key="invalid actions"><th>invalid actions</th><td>3 of 4</td></tr>' in episode  # turns 1, 3, 4
    assert episode.count("· invalid action</div>") == 3 and 'class="label invalid">action 2 ·' not in episode
    assert '<option value="invalid">with invalid actions</option>' in shown and 'data-line="invalid"' in shown
    assert address == f"{page.as_uri()}#stream=train&step=0&task={record['task_id']}&sample={record['sample_index']}"


@pytest.mark.slow
def test_without_an_address_it_opens_the_last_step_and_evaluations_are_browsable(run_dir, tmp_path):
    page = build_viewer(run_dir, steps=2)
    shown = dom(page, "", tmp_path)
    steps = re.findall(r'<option value="(\d+)"', element(shown, "step"))
    assert steps == ["1", "2"]  # the last two logged steps, the last one selected
    assert re.search(r'<option value="2" selected', shown) or 'id="episode-view"' in shown
    first = read_step(run_dir / "trajectories" / "train" / "step_000002.jsonl.gz")[0]
    assert f"<td>{first['task_id']}</td>" in element(shown, "episode-view")
    evaluated = dom(page, "stream=eval_embedded&step=3", tmp_path)
    view = element(evaluated, "episode-view")
    assert "<td>-</td>" in view  # an evaluation episode has no advantage
    assert "eval_embedded" in element(evaluated, "stream")


@pytest.mark.slow
def test_the_page_is_self_contained_shows_any_text_literally_and_cuts_long_ones(run_dir, tmp_path):
    """An action holding markup (an agent writing HTML, or `</script>`) is shown as text, never run as the page."""
    record = read_step(run_dir / "trajectories" / "train" / "step_000000.jsonl.gz")[0]
    hostile = '</script><script>document.title="owned"</script><b id="bold">x</b>'
    record["turns"][0]["action"] = hostile
    record["turns"][0]["observation"] = "y" * 5000
    (tmp_path / "trajectories" / "train").mkdir(parents=True)
    with gzip.open(tmp_path / "trajectories" / "train" / "step_000000.jsonl.gz", "wt") as out:
        out.write(json.dumps(record) + "\n")
    page = build_viewer(tmp_path, max_chars=1000)
    text = page.read_text()
    assert not re.search(r'(src|href)="(https?:)?//', text)  # nothing fetched from anywhere
    shown = dom(page, f"step=0&task={record['task_id']}&sample={record['sample_index']}", tmp_path)
    assert "<title>Canopy rollouts</title>" in shown and '<b id="bold">' not in shown  # no element made
    assert html.escape(hostile, quote=False) in element(shown, "episode-view")
    assert "[... 4000 characters cut by the viewer ...]" in shown
    assert cut("a" * 10 + "b" * 10, 8) == "aaaa\n[... 12 characters cut by the viewer ...]\nbbbb"


def test_view_command_writes_the_page_or_names_the_fix(run_dir, tmp_path, capsys):
    from canopy.tools.episodes import main

    main(["view", str(run_dir), "--steps", "1"])
    assert capsys.readouterr().out.strip() == f"viewer: {run_dir / 'viewer.html'}"
    with pytest.raises(SystemExit, match="^view: .* has no trajectory logs: train or evaluate with trajectories"):
        main(["view", str(tmp_path)])


def test_the_viewer_entry_point_builds_the_same_page_without_torch(run_dir, tmp_path):
    """`python -m canopy.tools.viewer`, as the callback runs it, imports neither torch nor the training code, and
    writes the page `build_viewer` writes (but for the time it was generated)."""
    modules, ran = imports_of("canopy.tools.viewer", run_dir, 2, 1000, tmp_path=tmp_path)
    assert ran.returncode == 0, ran.stderr.decode()
    assert not HEAVY & modules
    built = (run_dir / "viewer.html").read_text()
    generated = re.compile(r'"generated": "[^"]*"')
    assert generated.search(built)
    assert generated.sub("", built) == generated.sub("", build_viewer(run_dir, 2, 1000).read_text())


def test_the_callback_rebuilds_the_page_every_n_steps_without_holding_a_step(run_dir):
    from types import SimpleNamespace

    from canopy.callbacks import RolloutViewer

    (run_dir / "viewer.html").unlink(missing_ok=True)
    viewer = RolloutViewer(every_n_steps=2)
    trainer = SimpleNamespace(default_root_dir=str(run_dir), global_step=1, is_global_zero=True)
    viewer.on_train_batch_end(trainer, None, None, None, 0)
    assert viewer.process is None  # not a multiple of 2
    trainer.global_step = 2
    viewer.on_train_batch_end(trainer, None, None, None, 0)
    building = viewer.process
    trainer.global_step = 4
    viewer.on_train_batch_end(trainer, None, None, None, 0)  # while the first build runs, none is stacked on it
    assert viewer.process is building or building.poll() == 0
    assert building.wait() == 0 and (run_dir / "viewer.html").stat().st_size > 10_000  # built by the process
    (run_dir / "viewer.html").unlink()
    assert viewer.final(run_dir) == run_dir / "viewer.html" and viewer.process.poll() == 0
    assert (run_dir / "viewer.html").stat().st_size > 10_000
    follower = RolloutViewer(every_n_steps=1)
    follower.on_train_batch_end(SimpleNamespace(default_root_dir=str(run_dir), global_step=3, is_global_zero=False),
                                None, None, None, 0)  # fmt: skip
    assert follower.process is None  # only the generating rank builds


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE is Linux's")
def test_the_callback_builds_in_a_process_at_idle_priority(run_dir):
    from types import SimpleNamespace

    from canopy.callbacks import RolloutViewer

    viewer = RolloutViewer(every_n_steps=1)
    viewer.on_train_batch_end(SimpleNamespace(default_root_dir=str(run_dir), global_step=1, is_global_zero=True),
                              None, None, None, 0)  # fmt: skip
    policy = os.sched_getscheduler(viewer.process.pid)  # while it imports or builds
    assert viewer.process.wait() == 0 and policy == os.SCHED_IDLE and os.sched_getscheduler(0) == os.SCHED_OTHER
