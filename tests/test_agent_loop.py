import pytest

from canopy.envs.base import AgentFailure, EnvironmentFault, StepResult, Task, Verdict
from canopy.envs.embedded import EmbeddedEnvironment
from canopy.rollout.agent_loop import run_episodes
from canopy.rollout.budget import Budget
from canopy.rollout.chat import ChatTokenizer, render_observation, render_prompt
from tests.helpers import UNFILTERED
from tests.scripted import ScriptedEngine

BUDGET = Budget(
    max_turns=6, max_response_tokens=256, max_prompt_tokens=128, max_observation_tokens=32, max_context_tokens=1024
)


def task(start, tier, vault=0):
    return Task(
        f"vault{vault}_s{start}_t{tier}",
        tier,
        f"vault{vault}",
        {"vault": vault, "start": start, "goal_end": start + tier},
    )


def test_masks_and_token_in_token_out(tokenizer):
    env = EmbeddedEnvironment()
    engine = ScriptedEngine(tokenizer, ["key", "unlock"])
    [t], _ = run_episodes(engine, env, tokenizer, [(task(1, 2), 0)], BUDGET, UNFILTERED)
    assert t.ending == "done" and t.verdict == Verdict(2, 2) and t.num_turns == 2
    prompt = render_prompt(tokenizer, env.start(task(1, 2), 0).messages())
    assert t.token_ids[: len(prompt)] == prompt and t.prompt_length == len(prompt)
    assert t.action_mask[: len(prompt)] == [0] * len(prompt)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    key = tokenizer.convert_tokens_to_ids("key")
    unlock = tokenizer.convert_tokens_to_ids("unlock")
    first = len(prompt)
    assert t.token_ids[first : first + 2] == [key, im_end] and t.action_mask[first : first + 2] == [1, 1]
    # the observation that follows is environment text: mask 0, ending in the assistant header
    observation_end = len(t.token_ids) - 2
    assert set(t.action_mask[first + 2 : observation_end]) == {0}
    assert t.token_ids[-2:] == [unlock, im_end] and t.action_mask[-2:] == [1, 1]
    assert tokenizer.convert_ids_to_tokens(t.token_ids[first + 2 : first + 5]) == ["\n", "<|im_start|>", "user"]
    # the second engine call saw exactly the ids built so far: the past is never re-tokenized
    assert engine.calls[1][0][0] == t.token_ids[:observation_end]
    assert len(t.engine_logprobs) == len(t.token_ids) and t.response_tokens == 4


def test_turn_limit_is_an_agent_ending_with_a_verdict(tokenizer):
    engine = ScriptedEngine(tokenizer, ["hello"])
    budget = Budget(**{**BUDGET.__dict__, "max_turns": 3})
    [t], _ = run_episodes(engine, EmbeddedEnvironment(), tokenizer, [(task(0, 1), 0)], budget, UNFILTERED)
    assert t.ending == "turn_limit" and t.num_turns == 3
    assert t.verdict == Verdict(0, 1) and t.reward("sparse") == 0.0 and t.quarantine is None


def test_response_budget_and_uncapped_turns(tokenizer):
    engine = ScriptedEngine(tokenizer, ["a " * 40])
    budget = Budget(**{**BUDGET.__dict__, "max_response_tokens": 100})
    [t], _ = run_episodes(engine, EmbeddedEnvironment(), tokenizer, [(task(0, 1), 0)], budget, UNFILTERED)
    assert engine.calls[0][1] == [100]  # no per-turn cap: a turn may use the whole remaining budget
    assert engine.calls[1][1] == [100 - 41] and engine.calls[2][1] == [100 - 82]
    assert t.ending == "token_budget" and t.truncated and t.response_tokens == 100


def test_per_turn_cap_cuts_turns_without_ending_the_episode(tokenizer):
    engine = ScriptedEngine(tokenizer, ["a a a a a a a a login"])
    budget = Budget(**{**BUDGET.__dict__, "per_turn_generation_cap": 4, "max_turns": 2})
    [t], _ = run_episodes(engine, EmbeddedEnvironment(), tokenizer, [(task(0, 1), 0)], budget, UNFILTERED)
    assert [limits for _, limits in engine.calls] == [[4], [4]]
    assert t.ending == "turn_limit" and t.response_tokens == 8


def test_observation_is_capped(tokenizer):
    class Chatty:
        name = "chatty"
        max_concurrent_episodes = None

        def start(self, task, seed):
            return self

        def messages(self):
            return [{"role": "user", "content": "task : vault 1"}]

        def step(self, action):
            return StepResult("ok " * 50, done=False)

        def verdict(self):
            return Verdict(0, 1)

        def close(self):
            pass

    engine = ScriptedEngine(tokenizer, ["login"])
    budget = Budget(**{**BUDGET.__dict__, "max_observation_tokens": 5, "max_turns": 2})
    [t], _ = run_episodes(engine, Chatty(), tokenizer, [(task(0, 1), 0)], budget, UNFILTERED)
    ok = tokenizer.convert_tokens_to_ids("ok")
    assert t.token_ids.count(ok) == 5


def test_prompt_over_cap_is_a_clear_error(tokenizer):
    budget = Budget(**{**BUDGET.__dict__, "max_prompt_tokens": 5})
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        run_episodes(
            ScriptedEngine(tokenizer, ["x"]), EmbeddedEnvironment(), tokenizer, [(task(0, 1), 0)], budget, UNFILTERED
        )


def test_invalid_actions_are_counted_by_turn(tokenizer):
    """Each action the environment answers counts; those it found invalid (`StepResult.valid`) by their turn. A turn
    cut by the response budget is never answered."""
    engine = ScriptedEngine(tokenizer, ["hello", "login", "vault", "key"])
    [t], _ = run_episodes(engine, EmbeddedEnvironment(), tokenizer, [(task(0, 2), 0)], BUDGET, UNFILTERED)
    assert (t.ending, t.num_turns, t.actions, t.invalid_turns) == ("done", 4, 4, [1, 3])
    budget = Budget(**{**BUDGET.__dict__, "max_response_tokens": 100})
    [t], _ = run_episodes(
        ScriptedEngine(tokenizer, ["a " * 40]), EmbeddedEnvironment(), tokenizer, [(task(0, 1), 0)], budget, UNFILTERED
    )
    assert (t.ending, t.num_turns, t.actions, t.invalid_turns) == ("token_budget", 3, 2, [1, 2])


class FaultyEnv(EmbeddedEnvironment):
    """Raises the given exception on the first step of every episode."""

    def __init__(self, exception):
        super().__init__()
        self.exception = exception

    def start(self, task, seed):
        episode = super().start(task, seed)
        exception = self.exception

        def step(action):
            raise exception

        episode.step = step
        return episode


def test_environment_fault_quarantines_and_agent_failure_scores_zero(tokenizer):
    engine = ScriptedEngine(tokenizer, ["login"])
    [q], _ = run_episodes(
        engine, FaultyEnv(EnvironmentFault("worker_dead")), tokenizer, [(task(0, 1), 0)], BUDGET, UNFILTERED
    )
    assert q.ending == "quarantined" and q.quarantine == "worker_dead" and q.verdict is None
    with pytest.raises(ValueError, match="quarantined"):
        q.reward("sparse")
    [f], _ = run_episodes(
        engine, FaultyEnv(AgentFailure("memory_blowup")), tokenizer, [(task(0, 1), 0)], BUDGET, UNFILTERED
    )
    assert f.ending == "agent_failure" and f.agent_failure == "memory_blowup" and f.reward("sparse") == 0.0


def test_episodes_are_batched_per_turn_and_returned_in_job_order(tokenizer):
    jobs = [(task(0, 1), 0), (task(3, 1), 1), (task(0, 1), 2)]
    engine = ScriptedEngine(tokenizer, ["login"])
    trajectories, timings = run_episodes(engine, EmbeddedEnvironment(), tokenizer, jobs, BUDGET, UNFILTERED)
    assert [t.sample_index for t in trajectories] == [0, 1, 2]
    assert len(engine.calls[0][0]) == 3  # one batched call for all live episodes
    assert [t.ending for t in trajectories] == ["done", "turn_limit", "done"]
    assert set(timings) == {"generation", "env"}


@pytest.mark.parametrize("thinking", [None, False])
def test_chat_template_options_reach_the_prompt_and_every_observation(tokenizer, thinking):
    """Token for token: prompt + generated turn + rendered observation equal the chat template's own rendering of
    the conversation, with the experiment's options (Table A3: enable_thinking=False opens every assistant turn
    with an empty think block), and the episode's tokens carry them."""
    chat = ChatTokenizer(tokenizer) if thinking is None else ChatTokenizer(tokenizer, enable_thinking=thinking)
    think = "" if thinking is None else "<think>\n\n</think>\n\n"
    messages = [{"role": "system", "content": "vault world"}, {"role": "user", "content": "task : vault 1"}]
    prompt = render_prompt(chat, messages)
    turn = tokenizer.encode("login", add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    observation = render_observation(chat, "status : guest", cap=32, close_turn=False)
    conversation = messages + [
        {"role": "assistant", "content": think + "login"},
        {"role": "user", "content": "status : guest"},
    ]
    text = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=False, enable_thinking=thinking
    )
    assert prompt + turn + observation == tokenizer.encode(text, add_special_tokens=False)
    block = tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    for ids in (prompt, observation):
        assert (ids[-len(block) :] == block) == (thinking is False)
    engine = ScriptedEngine(tokenizer, ["open"])  # never solves it: two turns, one observation between
    task = EmbeddedEnvironment().tasks("train")[0]
    budget = Budget(
        max_turns=2, max_response_tokens=64, max_prompt_tokens=256, max_observation_tokens=32, max_context_tokens=512
    )
    (episode,), _ = run_episodes(engine, EmbeddedEnvironment(), chat, [(task, 0)], budget, UNFILTERED)
    first_prompt = engine.calls[0][0][0]
    assert (first_prompt[-len(block) :] == block) == (thinking is False)
    assert episode.num_turns == 2 and episode.token_ids.count(block[0]) == (2 if thinking is False else 0)


def test_remembered_renderings_are_the_tokenizers_own(tokenizer):
    """The chat tokenizer remembers rendered prompts and short texts' ids: the same ids as the tokenizer renders and
    encodes afresh, a caller's edit of a returned list reaches no later call, other template options render anew, a
    long text is not remembered, and a pickled copy renders the same."""
    import pickle

    chat = ChatTokenizer(tokenizer)
    messages = [{"role": "system", "content": "vault world"}, {"role": "user", "content": "task : vault 1"}]
    fresh = tokenizer.encode(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    first = render_prompt(chat, messages)
    first.append(-1)  # the agent loop extends its episode's token list
    assert render_prompt(chat, messages) == fresh
    messages[1]["content"] = "task : vault 2"
    assert render_prompt(chat, messages) != fresh  # the key is the conversation itself, not its object
    assert chat.apply_chat_template(messages, tokenize=False) != chat.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    observation = render_observation(chat, "status : guest", cap=32, close_turn=True)
    assert observation == render_observation(tokenizer, "status : guest", cap=32, close_turn=True)
    assert render_observation(chat, "status : guest", cap=2, close_turn=True) != observation  # capped anew
    long = "status : guest " * 100
    assert chat.encode(long, add_special_tokens=False) == tokenizer.encode(long, add_special_tokens=False)
    assert (long, False) not in chat.texts.results and ("status : guest", False) in chat.texts.results
    pair = chat.encode("status", "guest")  # a text pair, positionally as the tokenizer takes it: not remembered
    assert pair == tokenizer.encode("status", "guest") and ("status", True) not in chat.texts.results
    copy = pickle.loads(pickle.dumps(chat))  # the memos (and their locks) are not pickled: the copy starts afresh
    assert not copy.texts.results and not copy.templates.results
    assert render_observation(copy, "status : guest", cap=32, close_turn=True) == observation


def test_in_a_terminal_the_rollout_bar_shows_live_episodes_and_their_furthest_turn(tokenizer, monkeypatch, capsys):
    """Three episodes of two turns (`key`, then `unlock` solves a tier-2 task from 1): the bar says `live 3, turn 1`
    for the first turn and `live 3, turn 2` for the second; piped, there is no bar at all."""
    import canopy.rollout.agent_loop as agent_loop

    jobs = [(task(1, 2), i) for i in range(3)]
    monkeypatch.setattr(agent_loop, "interactive", lambda: True)
    run_episodes(
        ScriptedEngine(tokenizer, ["key", "unlock"]), EmbeddedEnvironment(), tokenizer, jobs, BUDGET, UNFILTERED
    )
    bar = capsys.readouterr().err
    assert "live 3, turn 1" in bar and "live 3, turn 2" in bar and "rollout" in bar
    monkeypatch.setattr(agent_loop, "interactive", lambda: False)
    run_episodes(
        ScriptedEngine(tokenizer, ["key", "unlock"]), EmbeddedEnvironment(), tokenizer, jobs, BUDGET, UNFILTERED
    )
    assert capsys.readouterr().err == ""
