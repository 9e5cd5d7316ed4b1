"""Test doubles: `FakeEngine`, the `Engine` contract with nothing behind it, and `ScriptedEngine`, which replays
scripted completions (the real engines are tested on their own)."""

import contextlib
from collections.abc import Mapping
from types import MappingProxyType

from canopy.rollout.engine import Generation


class FakeEngine:
    """Every `Engine` member, doing nothing: a batch-at-a-time engine with no servers, no counters and no sampler of
    its own (a checkpoint saves no `engine_rng` for it). A test engine scripts `generate` and what else it needs."""

    weight_version = 0
    dtype = "float32"
    concurrent = False
    can_relaunch = False
    counters: Mapping[str, int] = MappingProxyType({})

    def generate(self, prompts, max_new_tokens, sampling, keys=None):
        raise NotImplementedError("a test engine scripts its completions")

    def release(self, keys):
        """Nothing is kept between turns."""

    def update_weights(self, named_tensors, version):
        self.weight_version = version

    def at_budget(self, context_length, rope_scaling):
        return self

    def relaunched(self, context_length, rope_scaling):
        raise RuntimeError("a fake engine has no servers to relaunch")

    def evaluation_seed(self, seed):
        return contextlib.nullcontext()

    def rng_state(self):
        return None

    def load_rng_state(self, state):
        """No sampler to resume."""

    def close(self):
        """Nothing was started."""


class ScriptedEngine(FakeEngine):
    """At its k-th call every episode gets `replies[k]` (the last reply repeats); records prompts and limits."""

    def __init__(self, tokenizer, replies: list[str], version: int = 0, close_turns: bool = True):
        self.tokenizer, self.replies, self.weight_version = tokenizer, replies, version
        self.dtype = "float32"
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.close_turns = close_turns
        self.calls: list[tuple[list[list[int]], list[int]]] = []

    def generate(self, prompts, max_new_tokens, sampling, keys=None):
        self.calls.append(([list(p) for p in prompts], list(max_new_tokens)))
        text = self.replies[min(len(self.calls) - 1, len(self.replies) - 1)]
        ids = self.tokenizer.encode(text, add_special_tokens=False) + ([self.im_end] if self.close_turns else [])
        out = []
        for limit in max_new_tokens:
            reason = "stop" if self.close_turns and len(ids) <= limit else "length"
            out.append(Generation(ids[:limit], [-0.5] * min(len(ids), limit), reason, self.weight_version))
        return out


class RecordingEngine(FakeEngine):
    """A batch-at-a-time engine (as the local one) that records which episodes each call served."""

    def __init__(self, tokenizer):
        self.tokenizer, self.weight_version, self.batches = tokenizer, 0, []
        self.reply = tokenizer.encode("go", add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]

    def generate(self, prompts, max_new_tokens, sampling, keys=None):
        self.batches.append([self.tokenizer.decode(p).split("episode ")[1].split("<")[0] for p in prompts])
        return [Generation(list(self.reply), [-0.1] * len(self.reply), "stop", 0) for _ in prompts]
