"""The shape of the code: no import circle anywhere in canopy/ (function-level and type-checking imports counted),
on top of the layer contract `make lint` checks (pyproject.toml); and a new engine and a new environment, defined
here, train through their protocols alone."""

import contextlib
from collections.abc import Mapping
from types import MappingProxyType

import grimp
import lightning as L
import torch
from transformers import AutoModelForCausalLM

from canopy.callbacks import OnPolicyAudit
from canopy.envs.base import Environment, Episode, StepResult, Task, Verdict
from canopy.envs.embedded import VOCABULARY
from canopy.protocols import mismatches
from canopy.rollout.budget import Budget
from canopy.rollout.engine import Engine, Generation
from tests.helpers import canopy_module, datamodule_over


def import_circles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, imported = work[-1]
            for other in imported:
                if other not in index:
                    index[other] = low[other] = len(index)
                    stack.append(other)
                    on_stack.add(other)
                    work.append((other, iter(sorted(graph.find_modules_directly_imported_by(other)))))
                    break
                if other in on_stack:
                    low[module] = min(low[module], index[other])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == index[module]:
                    component = []
                    while True:
                        other = stack.pop()
                        on_stack.discard(other)
                        component.append(other)
                        if other == module:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
    return circles


def test_the_circle_finder_finds_a_circle():
    class Graph:
        modules = {"a", "b", "c", "d"}
        edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}

        def find_modules_directly_imported_by(self, module):
            return self.edges[module]

    assert import_circles(Graph()) == [["a", "b", "c"]]


def test_no_module_of_canopy_imports_itself_through_a_chain():
    graph = grimp.build_graph("canopy", exclude_type_checking_imports=False, cache_dir=None)
    assert "canopy.step" in graph.modules  # this tree's canopy
    assert import_circles(graph) == []


# Adding an engine and an environment, done once (docs/architecture.md#adding-things): each is one class that
# declares every member of its protocol, and a run trains with them as with Canopy's own.


class SayTheWordEnvironment:
    """A toy environment: each task names a word of the vault world's vocabulary; saying it is success."""

    name = "say_the_word"
    max_concurrent_episodes = None  # in-process

    def tasks(self, split: str) -> list[Task]:
        return [Task(f"say-{word}", 1 + i % 2, "words", {"word": word}) for i, word in enumerate(VOCABULARY[:6])]

    def start(self, task: Task, seed: int) -> "SayEpisode":
        return SayEpisode(task)

    def close(self) -> None:
        """Nothing is held between episodes."""


class SayEpisode:
    def __init__(self, task: Task):
        self.task, self.said = task, ""

    def messages(self) -> list[dict]:
        return [{"role": "user", "content": f"say {self.task.spec['word']}"}]

    def step(self, action_text: str) -> StepResult:
        self.said = action_text
        return StepResult("ok", done=True)

    def verdict(self) -> Verdict:
        return Verdict(int(self.task.spec["word"] in self.said.split()), 1)

    def close(self) -> None:
        pass


class TokenByTokenEngine:
    """A toy engine: the HF model at `path` in float32 on the CPU, sampled token by token with no cache and no
    filter, its weights replaced in place by each sync."""

    weight_version: int
    dtype, concurrent, can_relaunch = "float32", False, False
    counters: Mapping[str, int] = MappingProxyType({})

    def __init__(self, path, stop_token_ids: list[int], seed: int):
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.stop, self.generator, self.weight_version = set(stop_token_ids), torch.Generator().manual_seed(seed), 0

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens, sampling, keys=None):
        assert sampling.top_k == -1 and sampling.top_p == 1.0, "this engine samples the whole distribution"
        completions = []
        for prompt, limit in zip(prompts, max_new_tokens):
            ids, logprobs, reason = list(prompt), [], "length"
            for _ in range(limit):
                logits = self.model(torch.tensor([ids])).logits[0, -1].float() / sampling.temperature
                distribution = torch.log_softmax(logits, -1)
                token = int(torch.multinomial(distribution.exp(), 1, generator=self.generator))
                ids.append(token)
                logprobs.append(float(distribution[token]))
                if token in self.stop:
                    reason = "stop"
                    break
            completions.append(Generation(ids[len(prompt) :], logprobs, reason, self.weight_version))
        return completions

    def release(self, keys):
        """Nothing is kept between turns."""

    def update_weights(self, named_tensors, version):
        parameters = dict(self.model.named_parameters())
        updated = {name: tensor for name, tensor in named_tensors}
        assert updated.keys() == parameters.keys(), "all of them, or none"
        for name, tensor in updated.items():
            parameters[name].data.copy_(tensor)
        self.weight_version = version

    def at_budget(self, context_length, rope_scaling):
        return self if rope_scaling is None else None

    def relaunched(self, context_length, rope_scaling):
        raise RuntimeError("no servers to relaunch")

    def evaluation_seed(self, seed):
        return contextlib.nullcontext()

    def rng_state(self):
        return self.generator.get_state()

    def load_rng_state(self, state):
        self.generator.set_state(state)

    def close(self):
        """Nothing was started."""


def test_a_new_engine_and_a_new_environment_train_through_their_protocols_alone(tiny_path, tokenizer):
    """Each declares every member of its protocol (the load-time check a user's environment passes), and the
    module and data module train with them as they are: the weights reach the engine every step, every token is
    stamped with the version that sampled it, and the engine's logprobs are the trainer's (the on-policy audit's
    float32 bounds hold from the first update on)."""
    assert mismatches(SayTheWordEnvironment, Environment) == [] and mismatches(SayEpisode, Episode) == []
    assert mismatches(TokenByTokenEngine, Engine) == []
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    engine = TokenByTokenEngine(tiny_path, stop, seed=0)
    budget = Budget(max_turns=1, max_response_tokens=6, max_prompt_tokens=64, max_observation_tokens=8,
                    max_context_tokens=128)  # fmt: skip
    dm = datamodule_over(SayTheWordEnvironment(), engine, tokenizer, budget=budget, tasks_per_step=2, group_size=4)
    module = canopy_module(tiny_path, engine=dm.engine_handle, lr=1e-3)
    gaps = []

    class Gaps(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            gaps.append(pl_module.update_stats["mismatch/logprob_gap"])

    audit = OnPolicyAudit({"float32": {"parity": 1e-3, "warn": 1e-4, "stop": 1e-3}})
    trainer = L.Trainer(
        accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[audit, Gaps()],
    )  # fmt: skip
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 3 and engine.weight_version == module.weight_version == 3
    assert len(gaps) == 3 and max(gaps) < 1e-4
    state = dm.state_dict()["engine_rng"]  # the engine's sampler, saved for an exact resume
    assert torch.equal(state, engine.generator.get_state())
