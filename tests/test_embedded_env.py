import pytest

from canopy.envs.base import EnvironmentFault
from canopy.envs.embedded import ACTIONS, VOCABULARY, EmbeddedEnvironment, make_tasks


def solve(episode):
    """The optimal policy: always take the chain step the status line names."""
    status_to_action = {"guest": "login", "keyless": "key", "locked": "unlock", "shut": "open"}
    status = episode.messages()[-1]["content"].split()[-1]
    for turn in range(1, 10):
        result = episode.step(f"{status_to_action[status]}")
        if result.done:
            return turn
        status = result.observation.split()[-1]
    raise AssertionError("not solved")


@pytest.mark.parametrize("split", ["train", "dev", "test"])
def test_every_task_is_solvable_in_tier_turns(split):
    env = EmbeddedEnvironment()
    tasks = env.tasks(split)
    assert {t.tier for t in tasks} == {1, 2, 3}
    for task in tasks:
        episode = env.start(task, seed=0)
        assert solve(episode) == task.tier
        verdict = episode.verdict()
        assert verdict.success and verdict.passed == verdict.total == task.tier


def test_splits_are_disjoint_and_scenarios_group_vaults():
    train, dev = {t.task_id for t in make_tasks("train")}, {t.task_id for t in make_tasks("dev")}
    assert train and dev and not train & dev
    assert all(t.scenario in t.task_id for t in make_tasks("train"))
    with pytest.raises(ValueError, match="unknown split"):
        make_tasks("validation")


def test_actions_toggle_so_feedback_matters():
    env = EmbeddedEnvironment()
    task = next(t for t in make_tasks("train") if t.spec["start"] == 1 and t.tier == 3)  # logged in already
    episode = env.start(task, 0)
    assert episode.messages()[-1]["content"].endswith("status : keyless")
    result = episode.step("login")  # a blind script that starts over logs the agent out
    assert result.observation == "ok : login . status : guest" and not result.done
    assert episode.step("key").observation == "error : key . status : guest"  # precondition unmet: no change
    assert episode.step("no command here").observation == "error : no command . status : guest"


def test_dense_and_sparse_rewards_from_state_checks():
    task = next(t for t in make_tasks("train") if t.spec["start"] == 0 and t.tier == 3)
    episode = EmbeddedEnvironment().start(task, 0)
    episode.step("login")
    episode.step("key")
    verdict = episode.verdict()
    assert (verdict.passed, verdict.total) == (2, 3)
    assert verdict.reward("sparse") == 0.0 and verdict.reward("dense") == pytest.approx(2 / 3)


def test_first_command_word_counts():
    task = next(t for t in make_tasks("train") if t.spec["start"] == 0 and t.tier == 1)
    episode = EmbeddedEnvironment().start(task, 0)
    assert episode.step("vault 3 login open key").done


@pytest.mark.parametrize("declare_done", [False, True])
def test_an_unknown_command_is_an_invalid_action_and_any_known_one_valid(declare_done):
    """Format health: a reply with no command word is invalid; a known command is valid even when its prerequisite
    is unmet (a wrong move, not a malformed one)."""
    task = next(t for t in make_tasks("train") if t.spec["start"] == 0 and t.tier == 3)
    episode = EmbeddedEnvironment(declare_done=declare_done).start(task, 0)
    for reply in ("hello vault", "", "status : guest", "logout", "KEY"):
        assert not episode.step(reply).valid, reply
    for reply in ("unlock", "vault 3 key", "login"):  # unlock and key: prerequisite unmet, still commands
        assert episode.step(reply).valid, reply
    assert episode.step("done").valid is declare_done  # a command only where the agent ends the episode


def test_vocabulary_covers_everything_the_env_prints():
    env = EmbeddedEnvironment()
    words = set(VOCABULARY)
    for task in env.tasks("train") + env.tasks("test"):
        episode = env.start(task, 0)
        for message in episode.messages():
            assert set(message["content"].split()) <= words
        for action in ACTIONS + ("junk",):
            assert set(episode.step(action).observation.split()) <= words


def run_to_fault(env, task, seed, turns=8):
    """The turn at which the episode's injected fault came (None if none did within `turns`)."""
    episode = env.start(task, seed)
    for turn in range(1, turns + 1):
        try:
            episode.step("wait")  # no command: the episode never ends by itself
        except EnvironmentFault as fault:
            assert fault.reason == "injected_fault" and f"turn {turn}" in fault.detail
            return turn
    return None


def test_fault_rate_fails_that_fraction_of_turns_the_same_way_every_run():
    env, task = EmbeddedEnvironment(fault_rate=0.1), make_tasks("train")[0]
    first = [run_to_fault(env, task, seed) for seed in range(2000)]
    assert first == [run_to_fault(env, task, seed) for seed in range(2000)]  # fixed by (task, seed, turn)
    faulted = sum(turn is not None for turn in first) / len(first)
    assert abs(faulted - (1 - 0.9**8)) < 0.03  # each of 8 turns fails with probability 0.1
    assert abs(sum(turn == 1 for turn in first) / len(first) - 0.1) < 0.02
    assert all(run_to_fault(EmbeddedEnvironment(), task, seed) is None for seed in range(200))  # off by default


def test_fault_rate_is_checked_with_the_fix():
    from omegaconf import OmegaConf

    from canopy.envs import environment_kwargs
    from canopy.errors import ConfigError

    kwargs = environment_kwargs(OmegaConf.create({"name": "embedded", "fault_rate": 0.05}))
    assert kwargs == {"fault_rate": 0.05, "declare_done": False}
    for bad in (1.0, -0.1, "often", True):
        with pytest.raises(ConfigError, match="env.fault_rate=.* must be a probability in \\[0, 1\\)"):
            environment_kwargs(OmegaConf.create({"name": "embedded", "fault_rate": bad}))


def test_declare_done_makes_the_right_reply_depend_on_the_task():
    """Under declare_done the status covers the whole chain: `locked` calls for `done` when the goal is a held
    key, and for `unlock` when it is an open vault; only `done` ends the episode."""
    env = EmbeddedEnvironment(declare_done=True)
    key_goal = next(t for t in make_tasks("train") if t.spec == {"vault": 0, "start": 1, "goal_end": 2})
    open_goal = next(t for t in make_tasks("train") if t.spec == {"vault": 0, "start": 1, "goal_end": 4})
    for task in (key_goal, open_goal):
        episode = env.start(task, 0)
        assert episode.messages()[0]["content"].endswith("login key unlock open done")
        assert episode.messages()[-1]["content"].endswith("status : keyless")
        assert episode.step("key").observation.endswith(". status : locked")  # the key goal holds; no end
    short, long = env.start(key_goal, 0), env.start(open_goal, 0)
    for episode in (short, long):
        episode.step("key")
    assert short.step("done").done and short.verdict().success
    long_result = long.step("done")
    assert (
        long_result.done and not long.verdict().success and (long.verdict().passed, long.verdict().total) == (2, 4)
    )  # key, and `done` said


def test_declare_done_fails_a_step_past_the_goal_until_it_is_undone():
    task = next(t for t in make_tasks("train") if t.spec["start"] == 0 and t.spec["goal_end"] == 2)
    episode = EmbeddedEnvironment(declare_done=True).start(task, 0)
    episode.step("login")
    episode.step("key")
    # two goal steps, nothing past the goal, and `done` said: the last is still unmet
    assert (episode.verdict().passed, episode.verdict().total) == (3, 4)
    assert episode.step("unlock").observation == "ok : unlock . goal : key held . status : shut"
    assert episode.verdict().reward("dense") == pytest.approx(2 / 4)
    episode.step("unlock")  # toggled back
    assert episode.step("done").done and episode.verdict().success


def test_declare_done_fails_an_episode_that_reaches_the_goal_but_never_says_done():
    """The agent ends the episode: idling at the goal until the turn limit is a failure, as a SWE-bench agent that
    never submits; the dense reward still credits the goal steps."""
    task = next(t for t in make_tasks("train") if t.spec["start"] == 2 and t.spec["goal_end"] == 3)
    episode = EmbeddedEnvironment(declare_done=True).start(task, 0)
    assert episode.step("unlock").observation == "ok : unlock . goal : vault unlocked . status : shut"
    for _ in range(7):
        assert not episode.step("unlocked shut").done  # no command: idles at the goal
    assert not episode.verdict().success and episode.verdict().reward("dense") == pytest.approx(2 / 3)


@pytest.mark.parametrize("split", ["train", "dev"])
def test_declare_done_tasks_are_solvable_in_tier_plus_one_turns(split):
    env = EmbeddedEnvironment(declare_done=True)
    step_for = {"guest": "login", "keyless": "key", "locked": "unlock", "shut": "open"}
    for task in env.tasks(split):
        episode = env.start(task, 0)
        status = episode.messages()[-1]["content"].split()[-1]
        for _ in range(task.tier):
            result = episode.step(step_for[status])
            assert not result.done and set(result.observation.split()) <= set(VOCABULARY)
            status = result.observation.split()[-1]
        assert episode.step("done").done and episode.verdict().success
        assert episode.turn == task.tier + 1


def test_declare_done_is_checked_with_the_fix():
    from omegaconf import OmegaConf

    from canopy.envs import environment_kwargs
    from canopy.errors import ConfigError

    assert environment_kwargs(OmegaConf.create({"name": "embedded", "declare_done": True}))["declare_done"] is True
    with pytest.raises(ConfigError, match="env.declare_done='yes' must be true or false"):
        environment_kwargs(OmegaConf.create({"name": "embedded", "declare_done": "yes"}))


def test_testbed_warmup_transcripts_restate_goal_and_status_then_act(tokenizer):
    """The testbed base model's format: `<goal word> <status> <command>`, `done` one reply in ten, so tier-3
    tasks start starved; the command is what the environment parses."""
    from canopy.tiny_model import random_command_transcripts

    replies = []
    for ids, mask in random_command_transcripts(tokenizer, 300, max_turns=8, seed=0, junk_rate=0.0, declare_done=True):
        words = tokenizer.convert_ids_to_tokens([i for i, m in zip(ids, mask) if m])
        replies += " ".join(words).split(" <|im_end|>")[:-1]
    replies = [reply.split() for reply in replies]
    assert all(len(reply) == 3 and reply[0] in {"in", "held", "unlocked", "open"} for reply in replies)
    assert {reply[1] for reply in replies} <= {"guest", "keyless", "locked", "shut", "ok"}
    assert 0.07 < sum(reply[2] == "done" for reply in replies) / len(replies) < 0.14
