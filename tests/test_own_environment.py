"""Bringing your own environment: a package outside Canopy's tree, named by import path or by entry point, loaded
only when chosen; its missing dependency stops only it, in one line; a float verifier's verdict; the byte-level
tiny model reads its prompts; and reasoning-gym, the worked example (docs/environments.md)."""

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from canopy.envs import available, environment_kwargs, environment_module
from canopy.envs.base import Verdict
from canopy.errors import ConfigError
from canopy.rollout.agent_loop import run_episodes
from canopy.rollout.budget import Budget
from canopy.tiny_model import build_byte_tokenizer, build_tokenizer
from canopy.trajectories import read_step
from tests.helpers import LETTERS_ENV, UNFILTERED, config
from tests.scripted import ScriptedEngine

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def own_package(tmp_path, monkeypatch):
    """`mypkg` on sys.path, outside Canopy's tree: `mypkg.letters`, `mypkg.needs_missing` (imports a package that
    is not installed), `mypkg.no_environment`, and an installed distribution whose entry point names `mypkg.letters`
    as `letters`."""
    package = tmp_path / "site" / "mypkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "letters.py").write_text(LETTERS_ENV)
    (package / "needs_missing.py").write_text("import surely_not_installed_pkg\nENVIRONMENT = object\n")
    (package / "no_environment.py").write_text("X = 1\n")
    dist = tmp_path / "site" / "mypkg-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mypkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[canopy.environments]\nletters = mypkg.letters\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    yield tmp_path / "site"
    for name in [name for name in sys.modules if name == "mypkg" or name.startswith("mypkg.")]:
        del sys.modules[name]  # the next test's package is another folder's


def test_an_environment_outside_the_tree_is_found_by_import_path_or_entry_point(own_package):
    assert "letters" in available() and "mypkg.letters" not in available()
    by_path, by_entry_point = environment_module("mypkg.letters"), environment_module("letters")
    assert by_path is by_entry_point and by_path.__file__ == str(own_package / "mypkg" / "letters.py")
    assert environment_kwargs(OmegaConf.create({"name": "mypkg.letters"})) == {}
    (own_package / "mypkg" / "keyed.py").write_text(
        LETTERS_ENV + "\ndef environment_kwargs(env):\n    return {'letters': env.letters, 'n': 2}\n"
    )
    kwargs = environment_kwargs(OmegaConf.create({"name": "mypkg.keyed", "letters": ["e", "t"]}))
    assert kwargs == {"letters": ["e", "t"], "n": 2} and type(kwargs["letters"]) is list  # plain, for the workers
    with pytest.raises(ConfigError) as missing:
        environment_module("mypkg.needs_missing")
    assert str(missing.value) == (
        f"env.name=mypkg.needs_missing: its module mypkg.needs_missing imports 'surely_not_installed_pkg', which is "
        f"not installed in {sys.prefix}: pip install surely_not_installed_pkg (the package's pip name may differ; "
        "declare it in env.requires)"
    )
    with pytest.raises(ConfigError, match=r"^env.name=mypkg.no_environment: module mypkg.no_environment defines no "):
        environment_module("mypkg.no_environment")
    with pytest.raises(ConfigError, match=r"^env.name=mypkg.typo: no module 'mypkg.typo' on sys.path: check the name"):
        environment_module("mypkg.typo")
    with pytest.raises(ConfigError, match=r"^env.name='lettrs' has no environment in this build yet: use one of "):
        environment_module("lettrs")
    # a broken environment breaks only itself: everything else still composes and validates
    from canopy.config import validate

    validate(config())


def test_env_requires_is_checked_before_the_module_is_imported(own_package):
    with pytest.raises(ConfigError) as missing:
        environment_module("mypkg.letters", ["surely-not-installed-pkg>=2"])
    assert str(missing.value) == (
        f"env.name=mypkg.letters needs surely-not-installed-pkg>=2, which is not installed in {sys.prefix}: "
        "pip install 'surely-not-installed-pkg>=2'"
    )
    with pytest.raises(ConfigError, match=r"needs mypkg>=1, which is at 0.1 in .*: pip install 'mypkg>=1'"):
        environment_module("mypkg.letters", ["mypkg>=1"])
    with pytest.raises(ConfigError, match=r"^env.requires: 'mypkg ==' is not a pip requirement"):
        environment_module("mypkg.letters", ["mypkg =="])
    assert environment_module("mypkg.letters", ["mypkg==0.1", "torch"]).ENVIRONMENT.name == "letters"


def test_a_float_verifier_gives_the_dense_reward_and_success_at_its_threshold():
    half = Verdict.from_score(0.5)
    assert (half.success, half.reward("sparse"), half.reward("dense")) == (False, 0.0, 0.5)
    assert Verdict.from_score(0.5, solved_at=0.5).reward("sparse") == 1.0
    assert Verdict.from_score(1).success and Verdict.from_score(0.0).reward("dense") == 0.0
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match="a verifier's score must lie in \\[0, 1\\]"):
            Verdict.from_score(bad)


def test_a_scripted_policy_scores_on_the_environment_and_reads_its_prompt(own_package):
    env = environment_module("mypkg.letters").ENVIRONMENT()
    tasks = env.tasks("train")
    tokenizer = build_byte_tokenizer()
    budget = Budget(max_turns=2, max_response_tokens=64, max_prompt_tokens=128, max_observation_tokens=16,
                    max_context_tokens=512)  # fmt: skip
    jobs = [(task, 0) for task in tasks]
    trajectories, _ = run_episodes(
        ScriptedEngine(tokenizer, ["eta"]),
        env,
        tokenizer,
        jobs,
        budget,
        UNFILTERED,
    )
    assert [t.verdict.success for t in trajectories] == [c in "eta" for c in "etaoinsh"]
    prompt = tokenizer.decode(trajectories[0].token_ids[: trajectories[0].prompt_length])
    assert "Write any text that contains the letter e." in prompt
    # the word-level tokenizer of the vault world reads none of it
    words = build_tokenizer()
    unread = words.encode("Write any text that contains the letter e.", add_special_tokens=False)
    assert set(unread) == {words.unk_token_id}


@pytest.mark.slow
def test_train_py_trains_an_environment_from_outside_the_tree_with_the_byte_level_tiny_model(own_package, tmp_path):
    """`python train.py env.name=mypkg.letters model.tiny.tokenizer=byte`: its tasks reach the policy as text (no
    `<unk>`), the random byte-level policy is rewarded on some episodes, and the episodes run in pool workers that
    import the package too; `evaluate.py` on the run's export evaluates on the same environment."""
    run_dir = tmp_path / "run"
    args = [
        f"hydra.run.dir={run_dir}",
        "env.name=mypkg.letters",
        "env.pool.workers=2",
        "model.tiny.tokenizer=byte",
        "model.tiny.format_warmup_steps=0",
        f"model.tiny.dir={tmp_path / 'tiny-byte'}",
        "trainer.max_steps=2",
        "data.tasks_per_step=4",
        "algorithm.group_size=4",
        "report.eval_samples_per_task=0",
        "budget.max_response_tokens=48",
    ]
    environ = {"PYTHONPATH": str(own_package), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=600, env=environ
    )
    assert run.returncode == 0, run.stderr[-3000:]
    logs = run_dir / "trajectories" / "train"
    episodes = [e for step in (0, 1) for e in read_step(logs / f"step_{step:06d}.jsonl.gz")]
    assert len(episodes) == 32 and all(e["quarantine"] is None for e in episodes)
    prompts = [e["prompt"] for e in episodes]
    assert all("Write any text that contains the letter" in p and "<unk>" not in p for p in prompts)
    assert 0 < sum(e["reward"] for e in episodes) < 32
    assert "unknown token" not in run.stderr
    assert json.loads((run_dir / "final_hf" / "config.json").read_text())["vocab_size"] == len(build_byte_tokenizer())

    # evaluating its policy, without naming the environment again, evaluates on that environment
    out = tmp_path / "eval"
    evaluate = [sys.executable, "evaluate.py", f"checkpoint={run_dir}/final_hf", "k=1", f"hydra.run.dir={out}"]
    evaluate.append("env.pool.workers=0")  # in-process: the command line's own override wins over the run's
    run = subprocess.run(evaluate, cwd=ROOT, capture_output=True, text=True, timeout=600, env=environ)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"from the run {run_dir}: env.name=mypkg.letters model.tiny.tokenizer=byte" in run.stdout
    [result] = json.loads((out / "eval.json").read_text())
    assert result["env"] == "mypkg.letters" and result["metrics"]["all"]["tasks"] == 8
    assert result["sampling"] == {"temperature": 0.9, "top_p": 1.0, "top_k": -1}
    assert result["budget_config"]["max_context_tokens"] == 1024 and result["budget_config"]["name"] == "embedded"


def test_the_word_level_tiny_model_warns_that_it_cannot_read_another_environment(own_package):
    """The datamodule's readability check: most prompt tokens `<unk>` -> one warning naming the byte tokenizer."""
    from tests.helpers import datamodule_over

    env = environment_module("mypkg.letters").ENVIRONMENT()
    tokenizer = build_tokenizer()
    budget = Budget(max_turns=1, max_response_tokens=8, max_prompt_tokens=128, max_observation_tokens=16,
                    max_context_tokens=512)  # fmt: skip
    args = dict(
        split="train",
        tasks_per_step=2,
        group_size=2,
        budget=budget,
        sampling=UNFILTERED,
    )
    datamodule = datamodule_over(env, ScriptedEngine(tokenizer, ["open"]), tokenizer, **args)
    with pytest.warns(UserWarning, match=r"of the prompts' tokens are the tokenizer's unknown token '<unk>'.*"
                      r"model.tiny.tokenizer=byte"):  # fmt: skip
        batch = datamodule.next_batch()
    assert batch.metrics["health/unknown_prompt_frac"] > 0.5
    byte_tokenizer = build_byte_tokenizer()
    readable = datamodule_over(env, ScriptedEngine(byte_tokenizer, ["e"]), byte_tokenizer, **args)
    assert "health/unknown_prompt_frac" not in readable.next_batch().metrics


def rgym_installed() -> bool:
    try:
        import reasoning_gym  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not rgym_installed(), reason="reasoning-gym is not installed (pip install 'canopy[rgym]')")
def test_reasoning_gym_tasks_are_scored_by_the_datasets_own_verifier():
    cfg = config("env=rgym", "env.rgym.datasets=[basic_arithmetic,leg_counting]", "env.rgym.tasks_per_dataset=3")
    from canopy.build import build_env
    from canopy.config import validate

    validate(cfg)
    env = build_env(cfg)
    tasks = env.tasks("train")
    assert [(t.tier, t.scenario) for t in tasks] == [(1, "basic_arithmetic")] * 3 + [(2, "leg_counting")] * 3
    answers = {t.task_id: env.start(t, 0).entry["answer"] for t in tasks}
    tokenizer = build_byte_tokenizer()
    budget = Budget(max_turns=1, max_response_tokens=64, max_prompt_tokens=512, max_observation_tokens=16,
                    max_context_tokens=1024)  # fmt: skip

    class Answering(ScriptedEngine):  # the right answer to tasks 0, 2, 4; a wrong one, no tag to the others
        def generate(self, prompts, max_new_tokens, sampling, keys=None):
            task = tasks[len(self.calls)]
            self.replies = [f"<answer>{answers[task.task_id]}</answer>" if len(self.calls) % 2 == 0 else "-1"]
            return super().generate(prompts, max_new_tokens, sampling, keys)

    engine = Answering(tokenizer, [""])
    trajectories = [run_episodes(engine, env, tokenizer, [(t, 0)], budget, UNFILTERED)[0][0] for t in tasks]
    assert [t.verdict.success for t in trajectories] == [True, False] * 3
    assert [t.invalid_turns for t in trajectories] == [[], [1]] * 3  # no <answer> tag
    assert tokenizer.decode(trajectories[0].token_ids).count(env.start(tasks[0], 0).entry["question"]) == 1
    with pytest.raises(ConfigError, match=r"'basic_arithmatic' is not a reasoning-gym dataset: did you mean "):
        environment_kwargs(config("env=rgym", "env.rgym.datasets=[basic_arithmatic]").env)


def test_reasoning_gym_missing_or_at_another_version_is_one_line_naming_the_install(monkeypatch):
    from canopy.config import validate

    with pytest.raises(ConfigError, match=r"^env.name=rgym needs reasoning-gym==99, which is (at \S+|not installed) "):
        validate(config("env=rgym", "env.requires=['reasoning-gym==99']"))

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with pytest.raises(ConfigError) as missing:
        validate(config("env=rgym"))
    assert str(missing.value) == (
        f"env.name=rgym needs reasoning-gym==0.1.25, which is not installed in {sys.prefix}: "
        "pip install 'reasoning-gym==0.1.25'"
    )


def test_a_module_of_canopy_envs_that_does_not_import_breaks_only_itself(tmp_path, monkeypatch):
    """A module dropped into canopy/envs/ that imports a missing package at its top, with its config file naming its
    settings schema: every other command still runs, and choosing it says what to install, in one line."""
    import canopy.config
    import canopy.envs

    folder = tmp_path / "envs"
    folder.mkdir()
    (folder / "broken_env.py").write_text("import surely_not_installed_pkg\nENVIRONMENT = SETTINGS = object\n")
    conf = tmp_path / "conf"
    shutil.copytree(canopy.config.CONF, conf)
    (conf / "env" / "broken_env.yaml").write_text(
        "# @package env\ndefaults:\n  - /schema@broken_env: BrokenSettings\n  - _self_\nname: broken_env\n"
    )
    monkeypatch.setattr(canopy.envs, "__path__", [*canopy.envs.__path__, str(folder)])
    monkeypatch.setattr(canopy.config, "CONF", conf)
    canopy.envs.built_in_environments.cache_clear()
    try:
        assert "broken_env" in canopy.envs.built_in() and "broken_env" not in available()
        canopy.config.check_command_line([], "train")
        canopy.config.validate(canopy.config.compose_config([]))
        expected = (
            "env.name=broken_env: its module canopy.envs.broken_env imports 'surely_not_installed_pkg', which is "
            f"not installed in {sys.prefix}: pip install surely_not_installed_pkg"
        )
        with pytest.raises(ConfigError, match=re.escape(expected)):
            canopy.config.check_command_line(["env=broken_env"], "train")
        with pytest.raises(ConfigError, match=re.escape(expected)):
            canopy.config.validate(canopy.config.compose_config(["env.name=broken_env"]))
    finally:
        canopy.envs.built_in_environments.cache_clear()
