"""The multi-turn agent loop (Section 3.1), token-in / token-out.

Each episode's sequence is built from ids only: the rendered prompt (mask 0), then per turn the ids the
engine generated (mask 1, stop token included) and the rendered observation (mask 0). The past is never
re-tokenized, so the trainer scores exactly the tokens the engine sampled. Each episode runs its own
generate -> step loop (`run_episodes`), so environment steps overlap generation.
"""

import functools
import itertools
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any

from tqdm.auto import tqdm

from canopy.envs.base import AgentFailure, Environment, EnvironmentFault, Episode, Task, Verdict
from canopy.errors import require
from canopy.models import DEFAULT_FAMILY, MODEL_FAMILIES
from canopy.models.spec import ChatMarkers
from canopy.rollout.engine import EngineFault, SamplingParams

_rollouts = itertools.count()  # numbers each rollout, so that episode keys never repeat in a process


@dataclass(frozen=True)
class Budget:
    """Interaction budget of one episode (Tables A1/A3; `per_turn_generation_cap=None` means uncapped)."""

    max_turns: int
    max_response_tokens: int
    max_prompt_tokens: int
    max_observation_tokens: int
    max_context_tokens: int
    per_turn_generation_cap: int | None = None

    @classmethod
    def of(cls, budget) -> "Budget":
        """From the `budget` config group (its other keys, such as its name, are not the episode's)."""
        return cls(**{key.name: getattr(budget, key.name) for key in fields(cls)})


@dataclass
class BudgetSettings:
    """A `budget` config group (conf/budget/*.yaml, each a whole budget of Table 2 / A3): the schema. The episode
    reads its `Budget`; `rope_scaling` is the engine's (the enlarged budget's YaRN)."""

    name: str
    max_turns: int
    max_response_tokens: int
    max_prompt_tokens: int
    max_observation_tokens: int
    max_context_tokens: int
    per_turn_generation_cap: int | None  # null: uncapped
    rope_scaling: dict[str, Any] | None

    def validate(self, key: str = "budget") -> None:
        for name in ("max_turns", "max_response_tokens", "max_prompt_tokens", "max_observation_tokens"):
            require(getattr(self, name) >= 1, f"{key}.{name}={getattr(self, name)} must be a positive integer")
        require(
            self.per_turn_generation_cap is None or self.per_turn_generation_cap >= 1,
            f"{key}.per_turn_generation_cap={self.per_turn_generation_cap} must be null (uncapped) or a positive "
            "integer",
        )
        require(
            self.max_prompt_tokens < self.max_context_tokens,
            f"{key}.max_prompt_tokens={self.max_prompt_tokens} must be below "
            f"{key}.max_context_tokens={self.max_context_tokens}",
        )

    def check_context(self, native: int, key: str = "budget") -> None:
        """The context fits the model's `native` positions, or the budget's RoPE scaling (YaRN) stretches that
        model's positions to cover it: a budget past what the model was built for is refused, never run."""
        context, scaling = self.max_context_tokens, self.rope_scaling
        group = "budget" if key == "budget" else f"budget@{key.removesuffix('.budget')}"  # its config group
        if scaling is None:
            require(
                context <= native,
                f"{key}={self.name} asks for a {context:,}-token context, past the model's {native:,} positions: pick "
                f"a budget within them (the embedded model's enlarged one is {group}=embedded_enlarged), or one whose "
                "rope_scaling (YaRN) covers it, as conf/budget/enlarged.yaml has",
            )
            return
        original, factor = scaling.get("original_max_position_embeddings", native), scaling.get("factor", 1.0)
        require(
            original == native,
            f"{key}={self.name}'s rope_scaling stretches {original:,} positions, but the model has {native:,}: it was "
            f"written for another model; pick a budget for this one (the embedded model's: {group}=embedded_enlarged)",
        )
        require(
            context <= original * factor,
            f"{key}={self.name} asks for a {context:,}-token context, past the {original * factor:,.0f} positions its "
            f"rope_scaling (x{factor} over {original:,}) covers: raise {key}.rope_scaling.factor to at least "
            f"{context / original:.2f} or shorten {key}.max_context_tokens",
        )


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
    actions: int = 0  # actions the environment answered (a `StepResult`)
    invalid_turns: list[int] = field(default_factory=list)  # the turns (from 1) whose action was invalid for it
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


def invalid_action_fracs(actions_by_tier: dict[int, list[int]]) -> dict[str, float]:
    """Format health from {tier: [invalid actions, actions answered]}: {"all" | "tier<K>": invalid / answered},
    where any action was answered (the training step's log, evaluations and the end-of-run summary)."""
    total = [sum(counts[i] for counts in actions_by_tier.values()) for i in (0, 1)]
    rows = [("all", total), *((f"tier{tier}", counts) for tier, counts in sorted(actions_by_tier.items()))]
    return {name: invalid / answered for name, (invalid, answered) in rows if answered}


class _Live:
    """An episode in progress: its environment handle and growing trajectory."""

    def __init__(self, episode: Episode, trajectory: Trajectory):
        self.episode, self.trajectory = episode, trajectory


class ChatTokenizer:
    """A tokenizer whose chat template is always applied with the experiment's options (`model.chat_template_kwargs`,
    e.g. `enable_thinking: false` for Table A3's Qwen3.5), so that the prompt and every rendered observation follow
    them, and which carries its model family's chat `markers` (`canopy.models`; default: the default family's).
    Everything else is the wrapped tokenizer's (saving it saves the tokenizer unchanged)."""

    def __init__(self, tokenizer, markers: ChatMarkers | None = None, **template_kwargs):
        self.tokenizer, self.template_kwargs = tokenizer, template_kwargs
        self.markers = markers or MODEL_FAMILIES[DEFAULT_FAMILY].chat

    def __getattr__(self, name: str):
        if name == "tokenizer":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def apply_chat_template(self, conversation, **kwargs):
        return self.tokenizer.apply_chat_template(conversation, **{**self.template_kwargs, **kwargs})


def chat_markers(tokenizer) -> ChatMarkers:
    """The chat markers of `tokenizer`'s model family: a `ChatTokenizer`'s own, else the default family's."""
    return tokenizer.markers if isinstance(tokenizer, ChatTokenizer) else MODEL_FAMILIES[DEFAULT_FAMILY].chat


def render_prompt(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


@functools.lru_cache(maxsize=8)
def assistant_opening(tokenizer) -> str:
    """What the chat template appends to open an assistant turn, with its options (e.g. Qwen's turn start +
    `assistant\\n`, plus an empty think block when thinking is disabled)."""
    probe = [{"role": "user", "content": "?"}]
    closed = tokenizer.apply_chat_template(probe, add_generation_prompt=False, tokenize=False)
    opened = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    if not opened.startswith(closed):
        raise ValueError("the chat template's generation prompt does not extend the conversation it follows")
    return opened[len(closed) :]


def render_observation(tokenizer, observation: str, cap: int, close_turn: bool) -> list[int]:
    """Ids of `{turn_end}`? + `\\n{turn_start}user\\n{obs}{turn_end}\\n` + the template's assistant opening (the
    family's `chat_markers`), obs capped to `cap` tokens."""
    chat = chat_markers(tokenizer)
    content = tokenizer.encode(observation, add_special_tokens=False)[:cap]
    head = (chat.turn_end if close_turn else "") + f"\n{chat.turn_start}user\n"
    tail = chat.turn_end + "\n" + assistant_opening(tokenizer)
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
    concurrency: int | None = None,
) -> tuple[list[Trajectory], dict[str, float]]:
    """Run one episode per (task, sample_index) job to its end; returns trajectories in job order and timings.

    Each episode runs its own loop (`_episode`: start, then generate -> step until it ends), at most `concurrency`
    at once (default: the pool's `max_concurrent_episodes`, else every job). How the loops meet the engine:
    - an environment behind a pool, or an engine serving concurrent requests (`engine.concurrent`, SGLang): each
      episode in a thread of its own, so the environment steps of some overlap the generation of others; SGLang gets
      each request as its episode makes it, keyed by the episode (sticky routing), a batch-at-a-time engine (the
      local one) gets whatever requests are pending when it is free (`_Gatherer`, run in this thread);
    - an in-process environment with a batch-at-a-time engine: in this thread, every live episode's request in one
      batch per turn, in job order, as before (a seeded run samples exactly as it did).
    Requests carry their episode's key (`keys=`): SGLang routes an episode's turns to one server, the local engine
    keeps its cache between them; `engine.release` drops what the engine keeps of an episode once it has ended.
    The first error of any episode stops the others and is raised.
    """
    started = time.perf_counter()
    rollout = next(_rollouts)
    keys = [f"rollout{rollout}-episode{i}" for i in range(len(jobs))]
    turn_end = tokenizer.convert_tokens_to_ids(chat_markers(tokenizer).turn_end)
    trajectories = [Trajectory(task, sample_index, [], [], [], 0) for task, sample_index in jobs]
    pooled = env.max_concurrent_episodes
    limit = max(1, min(concurrency or pooled or len(jobs), len(jobs)))
    progress = tqdm(total=len(jobs), desc=description, unit="ep", leave=False, dynamic_ncols=True,
                    disable=not interactive())  # fmt: skip

    def episode(index: int):
        return _episode(env, tokenizer, trajectories[index], seed + index, budget, turn_end)

    try:
        if pooled is None and not getattr(engine, "concurrent", False):
            generation_seconds = _run_in_turns(engine, sampling, episode, keys, limit, progress)
        else:
            generation_seconds = _run_in_threads(engine, sampling, episode, keys, limit, progress)
    finally:
        progress.close()
        engine.release(keys)  # what an episode that failed left behind
    wall = time.perf_counter() - started
    return trajectories, {"generation": generation_seconds, "env": wall - generation_seconds}


def _episode(env, tokenizer, trajectory: Trajectory, seed: int, budget: Budget, turn_end: int):
    """One episode's own loop, as a coroutine: it yields each request (prompt ids, new-token limit) and is sent the
    generation; it returns once the episode has ended. Closed early, it hands its environment back."""
    item = _begin(env, tokenizer, trajectory, seed, budget)
    try:
        while item is not None:
            generation = yield item.trajectory.token_ids, _limit(item.trajectory, budget)
            item = _advance(item, generation, tokenizer, budget, turn_end)
    except BaseException:
        if item is not None:
            item.episode.close()  # a pool worker, a server
        raise


def interactive() -> bool:
    """Whether the console is a terminal, where progress bars redraw in place (piped to a file, they are off)."""
    return sys.stderr.isatty()


def show_live(progress, live: int, turns: list[int], refresh: bool = False) -> None:
    """The rollout bar's `live N, turn T`: episodes under way and the furthest turn any of them has reached."""
    progress.set_postfix_str(f"live {live}, turn {max(turns, default=0)}", refresh=refresh)


def _run_in_turns(engine, sampling: SamplingParams, episode, keys: list[str], limit: int, progress) -> float:
    """Drive the episodes in this thread: one engine call per turn with every live episode's request, in job
    order; an ended episode's place goes to the next job. Returns the seconds spent generating."""
    waiting: dict[int, tuple] = {}  # index -> (its coroutine, its request)
    queue, busy = deque(range(len(keys))), 0.0

    def admit():
        while queue and len(waiting) < limit:
            index = queue.popleft()
            coroutine = episode(index)
            try:
                waiting[index] = (coroutine, next(coroutine))
            except StopIteration:
                progress.update(1)

    turns = [0] * len(keys)
    try:
        admit()
        while waiting:
            order = sorted(waiting)
            for index in order:
                turns[index] += 1
            show_live(progress, len(order), turns, refresh=True)  # once a turn
            began = time.perf_counter()
            prompts, limits = [waiting[i][1][0] for i in order], [waiting[i][1][1] for i in order]
            outputs = engine.generate(prompts, limits, sampling, keys=[keys[i] for i in order])
            busy += time.perf_counter() - began
            for index, output in zip(order, outputs):
                coroutine = waiting[index][0]
                try:
                    waiting[index] = (coroutine, coroutine.send(output))
                except StopIteration:
                    del waiting[index]
                    engine.release([keys[index]])
                    progress.update(1)
            admit()
    finally:
        for coroutine, _ in waiting.values():
            coroutine.close()
    return busy


def _run_in_threads(engine, sampling: SamplingParams, episode, keys: list[str], limit: int, progress) -> float:
    """Drive each episode in a thread of its own (at most `limit` at once). Returns the seconds during which a
    generation was under way."""
    if getattr(engine, "concurrent", False):
        requests = _Direct(engine, sampling, keys)
    else:
        requests = _Gatherer(engine, sampling, keys)

    turns, live = [0] * len(keys), [0]

    def drive(index: int) -> None:
        coroutine = episode(index)
        live[0] += 1
        try:
            request = next(coroutine)
            while True:
                turns[index] += 1
                show_live(progress, live[0], turns)
                request = coroutine.send(requests.generate(index, *request))
        except StopIteration:
            pass
        except BaseException:
            requests.stop()
            coroutine.close()
            raise
        finally:
            live[0] -= 1
            engine.release([keys[index]])
            requests.finished()
            progress.update(1)

    with ThreadPoolExecutor(max_workers=limit, thread_name_prefix="episode") as executor:
        futures = [executor.submit(drive, i) for i in range(len(keys))]
        requests.serve()
    errors = [f.exception() for f in futures if f.exception() is not None]
    first = next((e for e in errors if not isinstance(e, _Stopped)), errors[0] if errors else None)
    if first is not None:
        raise first
    return requests.busy_seconds


class _Stopped(RuntimeError):
    """Another episode of the rollout failed: this one stops at its next request."""


class _Direct:
    """Each episode's request straight to a concurrent engine, keyed by the episode for sticky routing; tracks the
    wall time during which at least one request was in flight."""

    def __init__(self, engine, sampling: SamplingParams, keys: list[str]):
        self.engine, self.sampling, self.keys, self.stopped = engine, sampling, keys, threading.Event()
        self.lock, self.in_flight, self.since, self.busy_seconds = threading.Lock(), 0, 0.0, 0.0

    def generate(self, index: int, prompt: list[int], limit: int):
        if self.stopped.is_set():
            raise _Stopped("stopped: another episode of the rollout failed")
        with self.lock:
            if self.in_flight == 0:
                self.since = time.perf_counter()
            self.in_flight += 1
        try:
            (generation,) = self.engine.generate([prompt], [limit], self.sampling, keys=[self.keys[index]])
            return generation
        finally:
            with self.lock:
                self.in_flight -= 1
                if self.in_flight == 0:
                    self.busy_seconds += time.perf_counter() - self.since

    def serve(self) -> None:
        """Nothing to run here: the engine serves the requests itself."""

    def finished(self) -> None:
        pass

    def stop(self) -> None:
        self.stopped.set()


class _Gatherer:
    """Gathers the episodes' requests for an engine that generates a batch at a time (the local one): whatever is
    pending when the engine is free makes a batch, run in the caller's thread (`serve`; torch keeps its thread
    pool)."""

    def __init__(self, engine, sampling: SamplingParams, keys: list[str]):
        self.engine, self.sampling, self.keys, self.remaining = engine, sampling, keys, len(keys)
        self.lock = threading.Lock()
        self.work = threading.Condition(self.lock)  # `serve` waits here for requests
        self.delivered = threading.Condition(self.lock)  # the episodes wait here for their results
        self.pending: dict[int, tuple[list[int], int]] = {}
        self.results: dict[int, object] = {}
        self.stopped, self.busy_seconds = False, 0.0

    def generate(self, index: int, prompt: list[int], limit: int):
        with self.lock:
            self.pending[index] = (prompt, limit)
            self.work.notify()
            while index not in self.results and not self.stopped:
                self.delivered.wait()
            if index not in self.results:
                raise _Stopped("stopped: another episode of the rollout failed")
            result = self.results.pop(index)
        if isinstance(result, BaseException):
            raise result
        return result

    def serve(self) -> None:
        """Run batches until every episode has ended (or one failed)."""
        with self.lock:
            while True:
                while not self.pending and self.remaining > 0 and not self.stopped:
                    self.work.wait()
                if self.remaining == 0 or self.stopped:
                    return
                batch = sorted(self.pending.items())  # job order
                self.pending.clear()
                self.lock.release()
                began = time.perf_counter()
                try:
                    prompts, limits = [p for _, (p, _) in batch], [n for _, (_, n) in batch]
                    keys = [self.keys[i] for i, _ in batch]
                    outputs = self.engine.generate(prompts, limits, self.sampling, keys=keys)
                except BaseException as error:
                    outputs = [error] * len(batch)
                finally:
                    self.lock.acquire()
                self.busy_seconds += time.perf_counter() - began
                self.results.update((i, output) for (i, _), output in zip(batch, outputs))
                self.delivered.notify_all()

    def finished(self) -> None:
        with self.lock:
            self.remaining -= 1
            self.work.notify()

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            self.work.notify()
            self.delivered.notify_all()


def _limit(t: Trajectory, budget: Budget) -> int:
    """New-token limit of the episode's next turn: what is left of its response and context budgets."""
    limit = min(budget.max_response_tokens - t.response_tokens, budget.max_context_tokens - len(t.token_ids))
    if budget.per_turn_generation_cap is not None:
        limit = min(limit, budget.per_turn_generation_cap)
    return limit


def _begin(env: Environment, tokenizer, trajectory: Trajectory, seed: int, budget: Budget) -> _Live | None:
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
    return _Live(episode, trajectory)


def _advance(item: _Live, generation, tokenizer, budget: Budget, turn_end: int) -> _Live | None:
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
    ending = _step(item, generation, tokenizer, budget, turn_end)
    if ending is None:
        return item
    t.ending = ending
    if ending not in ("quarantined", "agent_failure"):
        _judge(item)
    item.episode.close()
    return None


def _step(item: _Live, generation, tokenizer, budget: Budget, turn_end: int) -> str | None:
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
    t.actions += 1
    if not result.valid:
        t.invalid_turns.append(t.num_turns)
    if result.done:
        return "done"
    if t.num_turns >= budget.max_turns:
        return "turn_limit"
    closes_turn = not generation.token_ids or generation.token_ids[-1] != turn_end
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
