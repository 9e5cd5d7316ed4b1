"""Trajectory logs: what each record holds, which episodes are sampled, whole files, bounded disk."""

import gzip
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from canopy.envs.base import Task
from canopy.envs.embedded import EmbeddedEnvironment
from canopy.errors import ConfigError
from canopy.trajectories import (
    TrajectoryLog,
    expand_runs,
    lower_to_idle_priority,
    mask_runs,
    read_index,
    read_step,
    sampling_of,
)
from tests.helpers import HEAVY, datamodule, imports_of, logged_episodes, trajectory
from tests.scripted import ScriptedEngine


def test_mask_runs_start_with_zeros_and_invert():
    for mask in ([], [1], [0, 0, 1, 1, 1, 0], [1, 1, 0, 1], [0] * 7):
        runs = mask_runs(mask)
        assert expand_runs(runs) == mask and sum(runs) == len(mask)
    assert mask_runs([0, 0, 1, 1, 1, 0]) == [2, 3, 1] and mask_runs([1, 0]) == [0, 1, 1]


def logged_step(tokenizer, tmp_path, replies, **sampling):
    """One datamodule step of the vault world with a trajectory log; returns (batch, the step's records)."""
    log = TrajectoryLog(tmp_path / "trajectories", tokenizer, "model/path", logged_episodes(**sampling), "sparse")
    dm = datamodule(tokenizer, ScriptedEngine(tokenizer, replies), trajectory_log=log)
    batch = dm.next_batch()
    dm.teardown("fit")
    path = tmp_path / "trajectories" / "train" / "step_000000.jsonl.gz"
    return batch, read_step(path) if path.exists() else []


def test_a_training_step_is_logged_turn_by_turn_with_its_advantages(tokenizer, tmp_path):
    batch, records = logged_step(tokenizer, tmp_path, ["guest login", "keyless key", "locked unlock"])
    assert len(records) == 12  # 3 tasks x 4 rollouts, in job order
    assert [r["group"] for r in records] == [0] * 4 + [1] * 4 + [2] * 4
    first = records[0]
    decode = lambda text: tokenizer.decode(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    assert first["prompt"].startswith(decode("<|im_start|>system\nyou operate a vault"))
    assert first["weight_versions"] == [0] and first["turns"][0]["action_tokens"] == 3
    assert first["turns"][0]["action"] == decode("guest login<|im_end|>")
    assert first["turns"][0]["observation"].startswith(decode("\n<|im_start|>user\nok : login . status :"))
    assert len(first["turns"]) == first["num_turns"]
    assert first["prompt_tokens"] + sum(t["action_tokens"] + t["observation_tokens"] for t in first["turns"]) == len(
        first["token_ids"]
    )
    assert sum(t["action_tokens"] for t in first["turns"]) == first["response_tokens"]
    assert sum(expand_runs(first["mask_runs"])) == first["response_tokens"]
    # the advantages are the batch's, episode by episode (no quarantine here: the same order)
    assert [r["advantage"] for r in records] == pytest.approx(batch.advantages.tolist())
    for record in records:
        assert record["reward"] == float(record["verdict"]["success"]) and record["ending"] in ("done", "turn_limit")
    assert json.loads((tmp_path / "trajectories" / "meta.json").read_text()) == {"tokenizer": "model/path"}
    (summary,) = read_index(tmp_path / "trajectories" / "train")  # the step in one line, for the viewer's curves
    assert summary["step"] == 0 and summary["episodes"] == 12 and summary["quarantined"] == 0
    for tier, (successes, scored) in summary["success_by_tier"].items():
        assert successes == sum(r["verdict"]["success"] for r in records if r["tier"] == int(tier))
        assert scored == sum(r["tier"] == int(tier) for r in records)
    groups = [[r["verdict"]["success"] for r in records if r["group"] == g] for g in range(3)]
    kinds = ["all_success" if all(g) else "all_fail" if not any(g) else "mixed" for g in groups]
    assert summary["groups"] == {kind: kinds.count(kind) for kind in set(kinds)}
    assert 0 < summary["write_cpu_ms"] < 10_000  # what writing the step cost the writer process (the logs' own cost)


def test_each_episode_keeps_its_invalid_turns_and_the_index_the_steps_share(tokenizer, tmp_path):
    """Format health in the logs: each record, the actions its environment answered and the turns whose action was
    invalid (the viewer marks them); the index line, the step's invalid and answered actions (the viewer's curve),
    which give the step's logged health/invalid_action_frac."""
    batch, records = logged_step(tokenizer, tmp_path, ["hello", "guest login", "vault", "keyless key"])
    for record in records:  # done after a login at turn 2, else at the turn limit (4)
        assert record["invalid_turns"] == {2: [1], 4: [1, 3]}[record["num_turns"]]
        assert record["actions"] == record["num_turns"]
    (summary,) = read_index(tmp_path / "trajectories" / "train")
    invalid, answered = summary["invalid_actions"]
    assert (invalid, answered) == (sum(len(r["invalid_turns"]) for r in records), sum(r["actions"] for r in records))
    assert invalid / answered == pytest.approx(batch.metrics["health/invalid_action_frac"]) and invalid > 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE is Linux's")
def test_the_writer_is_a_process_at_idle_priority_and_the_training_thread_keeps_its_own(tokenizer, tmp_path):
    seen = []
    probe = threading.Thread(target=lambda: (lower_to_idle_priority(), seen.append(os.sched_getscheduler(0))))
    probe.start()
    probe.join()
    assert seen == [os.SCHED_IDLE] and os.sched_getscheduler(0) == os.SCHED_OTHER  # per thread, not the process
    log = TrajectoryLog(tmp_path, tokenizer, "m", logged_episodes(), "sparse")
    dm = datamodule(tokenizer, ScriptedEngine(tokenizer, ["login", "key", "unlock"]), trajectory_log=log)
    dm.next_batch()
    written = tmp_path / "train" / "step_000000.jsonl.gz"
    deadline = time.monotonic() + 60
    while not written.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert log.process.pid != os.getpid() and os.sched_getscheduler(log.process.pid) == os.SCHED_IDLE
    log.close()
    assert len(read_step(written)) == 12 and os.sched_getscheduler(0) == os.SCHED_OTHER


KILLED_TRAINER = """
import os, signal, sys
from transformers import AutoTokenizer
from canopy.envs.base import Task
from canopy.trajectories import TrajectoryLog
from tests.helpers import logged_episodes, trajectory
log = TrajectoryLog(sys.argv[2], AutoTokenizer.from_pretrained(sys.argv[1]), "m", logged_episodes(), "sparse")
for step in range(3):
    log.log_step("train", step, [[trajectory(Task("a", 1, "s"), i, success=True, length=50) for i in range(8)]])
log.queue.join()  # the three steps are in the pipe (a step still in the trainer's queue dies with it)
print(log.process.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_trainer_leaves_its_steps_written_and_no_writer_behind(tiny_path, tmp_path):
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_TRAINER, str(tiny_path), str(tmp_path)],
        capture_output=True,  # returns only once every process holding its pipes is gone: the writer too
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[1],
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    stat = Path(f"/proc/{int(killed.stdout.split()[0])}/stat")
    assert not stat.exists() or stat.read_text().split()[2] == "Z"  # the writer exited (reaped, or a zombie)
    assert sorted(p.name for p in (tmp_path / "train").glob("step_*")) == [f"step_00000{i}.jsonl.gz" for i in range(3)]


def test_the_writer_entry_point_writes_what_it_is_handed_without_torch(tokenizer, tmp_path):
    """`python -m canopy.trajectory_writer` writes the records built here, says what it could not write, and
    imports neither torch nor the training code."""
    from canopy.trajectories import Writer, episode_records, plain_episode, writer_decoder

    a = Task("a", 1, "s")
    episodes = [plain_episode(0, trajectory(a, i, success=i == 0, length=30), 0.5, "sparse") for i in range(3)]
    (tmp_path / "blocked").write_text("a file where the stream's folder should be")
    handed = [
        Writer(tmp_path, writer_decoder(tokenizer), logged_episodes()),
        ("train", 4, episodes),
        ("blocked", 5, []),
    ]
    modules, ran = imports_of(
        "canopy.trajectory_writer", tmp_path=tmp_path, input=b"".join(map(pickle.dumps, [*handed, None]))
    )
    assert ran.returncode == 0, ran.stderr.decode()
    assert not HEAVY & modules and "tokenizers" in modules
    records = episode_records(episodes, writer_decoder(tokenizer), step=4, token_ids=True)
    assert read_step(tmp_path / "train" / "step_000004.jsonl.gz") == json.loads(json.dumps(records))
    (said,) = ran.stdout.decode().splitlines()
    assert json.loads(said)[0] == "failed" and "step 5 of blocked was not written" in json.loads(said)[1]


def test_a_dead_writer_stops_the_step_with_its_cause(tokenizer, tmp_path):
    a = Task("a", 1, "s")
    log = TrajectoryLog(tmp_path, tokenizer, "m", logged_episodes(), "sparse")
    log.log_step("train", 0, [[trajectory(a, 0, success=True)]])
    log.process.kill()
    log.process.wait()
    with pytest.raises(RuntimeError, match=r"trajectory writer process died \(exit code -9\); trajectories.enabled"):
        log.log_step("train", 1, [[trajectory(a, 0, success=True)]])
    with pytest.warns(UserWarning, match=r"died \(exit code -9\): what it had queued was not written"):
        log.close()


def test_the_index_keeps_the_last_line_of_a_step_and_skips_a_torn_one(tmp_path):
    lines = [{"step": 0, "v": 1}, {"step": 1, "v": 1}, {"step": 0, "v": 2}]  # step 0 again: a resumed run
    (tmp_path / "index.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 2, "v"')
    assert read_index(tmp_path) == [{"step": 0, "v": 2}, {"step": 1, "v": 1}]
    assert read_index(tmp_path / "missing") == []


def test_quarantined_episodes_are_logged_with_their_fault_and_no_reward(tokenizer, tmp_path):
    log = TrajectoryLog(tmp_path, tokenizer, "m", logged_episodes(), "sparse")
    dm = datamodule(tokenizer, ScriptedEngine(tokenizer, ["login", "key", "unlock"]), trajectory_log=log)
    dm.env = EmbeddedEnvironment(fault_rate=0.15)
    batch = dm.next_batch()
    log.close()
    records = read_step(tmp_path / "train" / "step_000000.jsonl.gz")
    faulted = [r for r in records if r["quarantine"]]
    assert faulted and len(records) == 12 and len(records) - len(faulted) == len(batch.lengths)  # none is lost
    for r in faulted:
        assert r["quarantine"] == "injected_fault" and "env.fault_rate=0.15" in r["fault"]
        assert r["reward"] is None and r["advantage"] is None and r["ending"] == "quarantined"
    scored = [r["advantage"] for r in records if not r["quarantine"]]
    assert scored == pytest.approx(batch.advantages.tolist())


def test_sampling_keeps_the_named_tasks_or_k_groups_per_tier_every_nth_step():
    tasks = [Task(f"t{i}", tier, "s") for i, tier in enumerate([1, 3, 1, 3, 1, 2])]
    groups = [[trajectory(task, i, success=True) for i in range(2)] for task in tasks]
    assert logged_episodes().groups("train", 0, groups) == list(range(6))
    assert logged_episodes(every_n_steps=5).groups("train", 3, groups) == []
    assert logged_episodes(every_n_steps=5).groups("train", 10, groups) == list(range(6))
    assert logged_episodes(every_n_steps=5).groups("eval_dev", 3, groups) == list(range(6))  # evaluations: every one
    assert logged_episodes(tasks=("t1", "t4")).groups("train", 0, groups) == [1, 4]
    assert logged_episodes(groups_per_tier=1).groups("train", 0, groups) == [0, 1, 5]
    assert logged_episodes(groups_per_tier=2, tasks=("t0", "t2", "t4")).groups("train", 0, groups) == [0, 2]


def test_text_only_logs_leave_out_the_ids(tokenizer, tmp_path):
    _, records = logged_step(tokenizer, tmp_path, ["login"], token_ids=False, groups_per_tier=1)
    assert records and all("token_ids" not in r and "mask_runs" not in r for r in records)
    assert len({r["tier"] for r in records}) == len(records) // 4  # one group of 4 per tier present


def test_disk_bound_removes_the_oldest_steps_and_says_so_once(tokenizer, tmp_path):
    a = Task("a", 1, "s")
    group = [[trajectory(a, i, success=i % 2 == 0, length=400) for i in range(8)]]
    probe = TrajectoryLog(tmp_path / "probe", tokenizer, "m", logged_episodes(), "sparse")
    probe.log_step("train", 0, group)
    probe.close()
    size = (tmp_path / "probe" / "train" / "step_000000.jsonl.gz").stat().st_size
    log = TrajectoryLog(tmp_path / "run", tokenizer, "m", logged_episodes(max_disk_mb=2.5 * size / 2**20), "sparse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6):
            log.log_step("train", step, group)
            log.log_step("eval_dev", step, group) if step == 1 else None
        log.close()
    left = sorted(p.name for p in (tmp_path / "run").glob("*/step_*"))
    assert left == ["step_000004.jsonl.gz", "step_000005.jsonl.gz"]  # within 2.5 files, newest kept
    assert [str(w.message).count("removing the oldest step files") for w in caught] == [1]
    assert not list((tmp_path / "run").rglob("*.tmp"))  # nothing half-written
    resumed = TrajectoryLog(tmp_path / "run", tokenizer, "m", logged_episodes(max_disk_mb=2.5 * size / 2**20), "sparse")
    with pytest.warns(UserWarning, match="from train/step_000004.jsonl.gz on"):
        resumed.log_step("train", 6, group)  # a resumed run counts the files already there
        resumed.close()
    assert sorted(p.name for p in (tmp_path / "run").glob("*/step_*")) == [
        "step_000005.jsonl.gz",
        "step_000006.jsonl.gz",
    ]


def test_a_write_failure_is_said_and_later_steps_still_written(tokenizer, tmp_path):
    a = Task("a", 1, "s")
    log = TrajectoryLog(tmp_path, tokenizer, "m", logged_episodes(), "sparse")
    log.log_step("train", 0, [[trajectory(a, 0, success=True)]])
    log.close()
    (tmp_path / "blocked").write_text("a file where the stream's folder should be")
    with pytest.warns(UserWarning, match="trajectory log: step 1 of blocked was not written"):
        log.log_step("blocked", 1, [[trajectory(a, 0, success=True)]])
        log.log_step("train", 2, [[trajectory(a, 0, success=True)]])
        log.close()
    written = sorted(p.name for p in (tmp_path / "train").glob("step_*"))
    assert written == ["step_000000.jsonl.gz", "step_000002.jsonl.gz"]
    with gzip.open(tmp_path / "train" / "step_000002.jsonl.gz", "rt") as f:
        assert json.loads(f.readline())["step"] == 2


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("every_n_steps", 0, "trajectories.every_n_steps=0 must be a positive integer"),
        ("groups_per_tier", 0, "trajectories.groups_per_tier=0 must be null"),
        ("tasks", "vault0_s0_t1", "must be null or a list of task ids"),
        ("max_disk_mb", 0, "trajectories.max_disk_mb=0 must be > 0"),
        ("max_disk_mb", "lots", "must be a number of megabytes"),
    ],
)
def test_bad_trajectory_settings_are_one_line_with_the_fix(key, value, message):
    section = {"enabled": True, "every_n_steps": 1, "tasks": None, "groups_per_tier": None, "token_ids": True}
    section = OmegaConf.create({**section, "max_disk_mb": 10, key: value})
    with pytest.raises(ConfigError, match=message):
        sampling_of(section)
    assert sampling_of(OmegaConf.create({**section, "enabled": False})) is None


def replay_output(capsys, *argv) -> str:
    from canopy.tools.episodes import main

    main(["replay", *map(str, argv)])
    return capsys.readouterr().out


def test_replay_prints_the_episode_token_exact_with_its_masks(tokenizer, tiny_path, tmp_path, capsys):
    log = TrajectoryLog(tmp_path / "trajectories", tokenizer, tiny_path, logged_episodes(), "sparse")
    dm = datamodule(tokenizer, ScriptedEngine(tokenizer, ["guest login", "keyless key"]), trajectory_log=log)
    dm.next_batch()
    log.close()
    record = read_step(tmp_path / "trajectories" / "train" / "step_000000.jsonl.gz")[5]
    out = replay_output(capsys, tmp_path, "--step", 0, "--task", record["task_id"], "--sample", 1)
    assert out.startswith(f"task {record['task_id']} (tier {record['tier']}), step 0, sample 1 of group 1: ending ")
    assert f"{len(record['token_ids'])} tokens, {record['response_tokens']} of them actions" in out
    assert f"[prompt: {record['prompt_tokens']} tokens, mask 0]\n<|im_start|>|system|\\n|you|" in out  # \\n: a token
    assert "[action 1: 3 tokens, mask 1]\nguest|login|<|im_end|>\n" in out
    assert "[observation 1: " in out and "every segment survives decode -> encode" in out
    lines = replay_output(capsys, tmp_path, "--step", 0, "--task", record["task_id"], "--sample", 1, "--tokens")
    first_action = record["prompt_tokens"]
    guest = tokenizer.convert_tokens_to_ids("guest")
    assert f"{first_action:6d} {guest:8d}  1  'guest'" in lines.splitlines()


def test_replay_flags_a_segment_that_re_tokenizes_differently(tmp_path):
    """BPE merges `a b` -> `ab`: an engine that sampled `a`, `b` produced text that re-encodes as one token."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    from canopy.tools.episodes import replay

    vocab = {"<|im_end|>": 0, "a": 1, "b": 2, "ab": 3, "c": 4}
    bpe = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(BPE(vocab=vocab, merges=[("a", "b")])))
    bpe.add_special_tokens({"eos_token": "<|im_end|>"})
    record = {
        "task_id": "t", "tier": 1, "step": 0, "sample_index": 0, "group": 0, "ending": "done", "quarantine": None,
        "verdict": {"success": True}, "reward": 1.0, "advantage": 0.5, "weight_versions": [0],
        "prompt_tokens": 1, "token_ids": [4, 1, 2, 0], "mask_runs": [1, 3],
    }  # fmt: skip
    out = replay(record, bpe)
    assert "[action 1: 3 tokens, mask 1]\na|b|<|im_end|>\n!! its text re-encodes to 2 tokens, not these 3" in out
    assert out.endswith("1 segment(s) do not survive decode -> encode: re-tokenizing this conversation would change it")


def test_replay_names_what_is_there_when_asked_for_what_is_not(tokenizer, tiny_path, tmp_path, capsys):
    log = TrajectoryLog(tmp_path / "trajectories", tokenizer, tiny_path, logged_episodes(groups_per_tier=1), "sparse")
    a = Task("a", 1, "s")
    log.log_step("train", 3, [[trajectory(a, i, success=True) for i in range(2)]])
    log.close()
    text_only = TrajectoryLog(
        tmp_path / "trajectories", tokenizer, tiny_path, logged_episodes(token_ids=False), "sparse"
    )
    text_only.log_step("train", 4, [[trajectory(a, 0, success=True)]])
    text_only.close()
    cases = [
        (["--stream", "eval_dev"], "no trajectory logs of stream 'eval_dev' under .*: streams logged: \\['train'\\]"),
        (["--step", "2"], "step 2 of train was not logged \\(sampled out, or pruned\\): logged steps: 3, 4"),
        (["--task", "b"], "task 'b' is not in step 3 of train: its tasks are a"),
        (["--sample", "5"], "task a has no sample 5 in step 3: its samples are \\[0, 1\\]"),
        (["--step", "4"], "step 4 of train was logged without token ids \\(trajectories.token_ids=false\\)"),
        (["--tokenizer", str(tmp_path / "gone")], "no tokenizer found at .*gone: pass --tokenizer"),
    ]
    for extra, message in cases:
        args = {"--step": "3", "--task": "a", **dict(zip(extra[::2], extra[1::2]))}
        with pytest.raises(SystemExit, match=f"^replay: {message}"):
            replay_output(capsys, tmp_path, *[x for pair in args.items() for x in pair])


def test_decode_all_gives_the_text_of_decode_piece_by_piece(tokenizer):
    """The writer decodes a step's pieces in one call, with the decoder it is handed (pickled); the text is what
    `decode` gives for each (the word-level and the byte-level tokenizers), and a tokenizer that cleans up spaces
    keeps its own `decode`."""
    from tokenizers import Tokenizer

    from canopy.tiny_model import build_byte_tokenizer
    from canopy.trajectories import decode_all, writer_decoder

    byte_level = build_byte_tokenizer()
    for tok, texts in (
        (tokenizer, ["guest login<|im_end|>", "\n<|im_start|>user\nok : login . status : keyless", ""]),
        (byte_level, ["print('é')\n<|im_end|>", "  two  spaces , and a comma .", "<think>\n\n</think>"]),
    ):
        pieces = [tok.encode(text, add_special_tokens=False) for text in texts]
        decoder = pickle.loads(pickle.dumps(writer_decoder(tok)))
        assert isinstance(decoder, Tokenizer)  # the Rust backend: the writer needs no transformers
        assert decode_all(decoder, pieces) == [tok.decode(p, skip_special_tokens=False) for p in pieces]
    tokenizer.clean_up_tokenization_spaces = True  # decode's clean-up: " ." -> "."
    try:
        piece = tokenizer.encode("ok : done .", add_special_tokens=False)
        assert writer_decoder(tokenizer) is tokenizer
        assert decode_all(tokenizer, [piece]) == [tokenizer.decode(piece, skip_special_tokens=False)] == ["ok : done."]
    finally:
        tokenizer.clean_up_tokenization_spaces = False
