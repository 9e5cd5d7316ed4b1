"""The multi-turn agent loop (Section 3.1), token-in / token-out.

Each episode's sequence is built from ids only: the rendered prompt (mask 0), then per turn the ids the
engine generated (mask 1, stop token included) and the rendered observation (mask 0). The past is never
re-tokenized, so the trainer scores exactly the tokens the engine sampled. Each episode runs its own
generate -> step loop (`run_episodes`), so environment steps overlap generation. The pieces it uses: the episode's
`Budget` (`budget`), the chat rendering (`chat`) and the finished `Trajectory` (`trajectory`).
"""

import itertools
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from tqdm.auto import tqdm

from canopy.envs.base import AgentFailure, Environment, EnvironmentFault, Episode, Task
from canopy.rollout.budget import Budget
from canopy.rollout.chat import chat_markers, render_observation, render_prompt
from canopy.rollout.engine import Engine, EngineFault, SamplingParams
from canopy.rollout.trajectory import Trajectory

_rollouts = itertools.count()  # numbers each rollout, so that episode keys never repeat in a process


class _Live:
    """An episode in progress: its environment handle and growing trajectory."""

    def __init__(self, episode: Episode, trajectory: Trajectory):
        self.episode, self.trajectory = episode, trajectory


def run_episodes(
    engine: Engine,
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
        if pooled is None and not engine.concurrent:
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
    if engine.concurrent:
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
