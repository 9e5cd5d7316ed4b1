"""The multi-turn agent loop (Section 3.1), token-in / token-out.

Each episode's sequence is built from ids only: the rendered prompt (mask 0), then per turn the ids the
engine generated (mask 1, stop token included) and the rendered observation (mask 0). The past is never
re-tokenized, so the trainer scores exactly the tokens the engine sampled. All live episodes of a rollout
step generate together, one batched engine call per turn.
"""

import functools
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from canopy.envs.base import AgentFailure, Environment, EnvironmentFault, Episode, Task, Verdict
from canopy.rollout.engine import EngineFault, SamplingParams


@dataclass(frozen=True)
class Budget:
    """Interaction budget of one episode (Tables A1/A3; `per_turn_generation_cap=None` means uncapped)."""

    max_turns: int
    max_response_tokens: int
    max_prompt_tokens: int
    max_observation_tokens: int
    max_context_tokens: int
    per_turn_generation_cap: int | None = None


@dataclass
class Trajectory:
    """One finished episode. Exactly one of `verdict`, `agent_failure`, `quarantine` describes its outcome."""

    task: Task
    sample_index: int
    token_ids: list[int]
    action_mask: list[int]
    engine_logprobs: list[float]  # aligned with token_ids; 0.0 where action_mask is 0
    prompt_length: int
    token_versions: list[int] = field(default_factory=list)  # aligned: the weight version that sampled it, else -1
    num_turns: int = 0
    response_tokens: int = 0
    ending: str = ""  # done | turn_limit | token_budget | context_limit | agent_failure | quarantined
    verdict: Verdict | None = None
    agent_failure: str | None = None
    quarantine: str | None = None
    fault: EnvironmentFault | EngineFault | None = None  # the serving-layer fault behind `quarantine`

    def quarantine_for(self, fault: EnvironmentFault | EngineFault) -> str:
        """Mark the episode quarantined by `fault` (Appendix G); returns its ending."""
        self.ending, self.quarantine, self.fault = "quarantined", fault.reason, fault
        return self.ending

    @property
    def weight_versions(self) -> set[int]:
        """The weight versions its tokens were sampled with (one, when strictly on-policy)."""
        return set(self.token_versions) - {-1}

    @property
    def truncated(self) -> bool:
        return self.ending in ("token_budget", "context_limit")

    def reward(self, kind: str) -> float:
        """Scored outcome; agent failures score 0. Quarantined episodes have no reward (see `quarantine`)."""
        if self.quarantine is not None:
            raise ValueError(f"episode {self.task.task_id}#{self.sample_index} is quarantined and has no reward")
        return self.verdict.reward(kind) if self.verdict is not None else 0.0


class _Live:
    """An episode in progress: its environment handle and growing trajectory."""

    def __init__(self, index: int, episode: Episode, trajectory: Trajectory):
        self.index, self.episode, self.trajectory = index, episode, trajectory


class ChatTokenizer:
    """A tokenizer whose chat template is always applied with the experiment's options (`model.chat_template_kwargs`,
    e.g. `enable_thinking: false` for Table A3's Qwen3.5), so that the prompt and every rendered observation follow
    them. Everything else is the wrapped tokenizer's (saving it saves the tokenizer unchanged)."""

    def __init__(self, tokenizer, **template_kwargs):
        self.tokenizer, self.template_kwargs = tokenizer, template_kwargs

    def __getattr__(self, name: str):
        if name == "tokenizer":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def apply_chat_template(self, conversation, **kwargs):
        return self.tokenizer.apply_chat_template(conversation, **{**self.template_kwargs, **kwargs})


def render_prompt(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


@functools.lru_cache(maxsize=8)
def assistant_opening(tokenizer) -> str:
    """What the chat template appends to open an assistant turn, with its options (Qwen's `<|im_start|>assistant\\n`,
    plus an empty think block when thinking is disabled)."""
    probe = [{"role": "user", "content": "?"}]
    closed = tokenizer.apply_chat_template(probe, add_generation_prompt=False, tokenize=False)
    opened = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    if not opened.startswith(closed):
        raise ValueError("the chat template's generation prompt does not extend the conversation it follows")
    return opened[len(closed) :]


def render_observation(tokenizer, observation: str, cap: int, close_turn: bool) -> list[int]:
    """Ids of `<|im_end|>`? + `\\n<|im_start|>user\\n{obs}<|im_end|>\\n` + the template's assistant opening, obs
    capped to `cap` tokens."""
    content = tokenizer.encode(observation, add_special_tokens=False)[:cap]
    head = ("<|im_end|>" if close_turn else "") + "\n<|im_start|>user\n"
    tail = "<|im_end|>\n" + assistant_opening(tokenizer)
    return tokenizer.encode(head, add_special_tokens=False) + content + tokenizer.encode(tail, add_special_tokens=False)


def run_episodes(
    engine,
    env: Environment,
    tokenizer,
    jobs: list[tuple[Task, int]],
    budget: Budget,
    sampling: SamplingParams,
    seed: int = 0,
    description: str = "rollout",
) -> tuple[list[Trajectory], dict[str, float]]:
    """Run one episode per (task, sample_index) job to its end; returns trajectories in job order and timings.

    Episodes waiting for an action are generated together, in job order. An environment served by worker
    processes (`max_concurrent_episodes` set) runs at most that many episodes at once and its calls run in
    threads, so a slow episode holds back only itself; an in-process environment runs every job at once and
    its calls run inline, turn by turn.
    """
    started = time.perf_counter()
    timings = {"generation": 0.0, "env": 0.0}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    trajectories = [Trajectory(task, sample_index, [], [], [], 0) for task, sample_index in jobs]
    pooled = getattr(env, "max_concurrent_episodes", None)
    concurrency = pooled or len(jobs)
    executor = ThreadPoolExecutor(max_workers=pooled) if pooled else _Inline()
    pending = deque(range(len(jobs)))
    in_flight: dict[Future, int] = {}  # environment calls under way
    progress = tqdm(total=len(jobs), desc=description, unit="ep", leave=False, dynamic_ncols=True)
    try:
        while pending or in_flight:
            while pending and len(in_flight) < concurrency:
                i = pending.popleft()
                in_flight[executor.submit(_begin, env, tokenizer, trajectories[i], i, seed + i, budget)] = i
            done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            ready: list[_Live] = []  # episodes waiting for their next action
            for future in done:
                del in_flight[future]
                item = future.result()
                if item is None:
                    progress.update(1)
                else:
                    ready.append(item)
            if not ready:
                continue
            ready.sort(key=lambda item: item.index)
            generation_started = time.perf_counter()
            generations = engine.generate(
                [item.trajectory.token_ids for item in ready], _limits(ready, budget), sampling
            )
            timings["generation"] += time.perf_counter() - generation_started
            for item, generation in zip(ready, generations):
                in_flight[executor.submit(_advance, item, generation, tokenizer, budget, im_end)] = item.index
            progress.set_postfix(
                live=len(in_flight), turn=max((trajectories[i].num_turns for i in in_flight.values()), default=0)
            )
    finally:
        progress.close()
        executor.shutdown()
    timings["env"] = time.perf_counter() - started - timings["generation"]
    return trajectories, timings


class _Inline:
    """Runs each call when it is submitted: in-process environments need no threads."""

    def submit(self, fn, *args) -> Future:
        future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as error:
            future.set_exception(error)
        return future

    def shutdown(self) -> None:
        pass


def _limits(ready: list[_Live], budget: Budget) -> list[int]:
    """New-token limit of each episode's next turn: what is left of its response and context budgets."""
    limits = []
    for item in ready:
        t = item.trajectory
        limit = min(budget.max_response_tokens - t.response_tokens, budget.max_context_tokens - len(t.token_ids))
        if budget.per_turn_generation_cap is not None:
            limit = min(limit, budget.per_turn_generation_cap)
        limits.append(limit)
    return limits


def _begin(env: Environment, tokenizer, trajectory: Trajectory, index: int, seed: int, budget: Budget) -> _Live | None:
    """Start the episode and render its prompt; None if the serving layer failed to start it (quarantined)."""
    try:
        episode = env.start(trajectory.task, seed=seed)
        prompt = render_prompt(tokenizer, episode.messages())
    except EnvironmentFault as fault:
        trajectory.quarantine_for(fault)
        return None
    if len(prompt) > budget.max_prompt_tokens:
        episode.close()
        raise ValueError(
            f"task {trajectory.task.task_id}: prompt has {len(prompt)} tokens > budget.max_prompt_tokens="
            f"{budget.max_prompt_tokens}; raise the cap or drop the task"
        )
    trajectory.token_ids, trajectory.action_mask = list(prompt), [0] * len(prompt)
    trajectory.engine_logprobs, trajectory.prompt_length = [0.0] * len(prompt), len(prompt)
    trajectory.token_versions = [-1] * len(prompt)
    return _Live(index, episode, trajectory)


def _advance(item: _Live, generation, tokenizer, budget: Budget, im_end: int) -> _Live | None:
    """Append one generated turn and act on it; returns the episode if it goes on, None once it ended (closed)."""
    t = item.trajectory
    if isinstance(generation, EngineFault):  # the engine failed this request on every try: not the agent's doing
        t.quarantine_for(generation)
        item.episode.close()
        return None
    t.token_ids += generation.token_ids
    t.action_mask += [1] * len(generation.token_ids)
    t.engine_logprobs += generation.logprobs
    t.token_versions += [generation.weight_version] * len(generation.token_ids)
    t.response_tokens += len(generation.token_ids)
    t.num_turns += 1
    ending = _step(item, generation, tokenizer, budget, im_end)
    if ending is None:
        return item
    t.ending = ending
    if ending not in ("quarantined", "agent_failure"):
        _judge(item)
    item.episode.close()
    return None


def _step(item: _Live, generation, tokenizer, budget: Budget, im_end: int) -> str | None:
    """Feed the action to the environment; return the episode's ending, or None if it goes on."""
    t = item.trajectory
    if generation.finish_reason == "length":  # else the per-turn cap cut the turn: the episode goes on
        if t.response_tokens >= budget.max_response_tokens:
            return "token_budget"
        if len(t.token_ids) >= budget.max_context_tokens:
            return "context_limit"
    action_text = tokenizer.decode(generation.token_ids, skip_special_tokens=True)
    try:
        result = item.episode.step(action_text)
    except EnvironmentFault as fault:
        return t.quarantine_for(fault)
    except AgentFailure as failure:
        t.agent_failure = failure.reason
        return "agent_failure"
    if result.done:
        return "done"
    if t.num_turns >= budget.max_turns:
        return "turn_limit"
    closes_turn = not generation.token_ids or generation.token_ids[-1] != im_end
    observation = render_observation(tokenizer, result.observation, budget.max_observation_tokens, closes_turn)
    if len(t.token_ids) + len(observation) >= budget.max_context_tokens:
        return "context_limit"
    t.token_ids += observation
    t.action_mask += [0] * len(observation)
    t.engine_logprobs += [0.0] * len(observation)
    t.token_versions += [-1] * len(observation)
    return None


def _judge(item: _Live) -> None:
    """Run the task's unit tests on the final state; a serving-layer fault here quarantines the episode."""
    try:
        item.trajectory.verdict = item.episode.verdict()
    except EnvironmentFault as fault:
        item.trajectory.quarantine_for(fault)
