"""Test double: an engine that replays scripted completions (the real engines are tested on their own)."""

from canopy.rollout.engine import Generation


class ScriptedEngine:
    """At its k-th call every episode gets `replies[k]` (the last reply repeats); records prompts and limits."""

    def __init__(self, tokenizer, replies: list[str], version: int = 0, close_turns: bool = True):
        self.tokenizer, self.replies, self.weight_version = tokenizer, replies, version
        self.dtype = "float32"
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.close_turns = close_turns
        self.calls: list[tuple[list[list[int]], list[int]]] = []

    def update_weights(self, state, version):
        self.weight_version = version

    def release(self, keys):
        """Nothing is kept between turns."""

    def generate(self, prompts, max_new_tokens, sampling, keys=None):
        self.calls.append(([list(p) for p in prompts], list(max_new_tokens)))
        text = self.replies[min(len(self.calls) - 1, len(self.replies) - 1)]
        ids = self.tokenizer.encode(text, add_special_tokens=False) + ([self.im_end] if self.close_turns else [])
        out = []
        for limit in max_new_tokens:
            reason = "stop" if self.close_turns and len(ids) <= limit else "length"
            out.append(Generation(ids[:limit], [-0.5] * min(len(ids), limit), reason, self.weight_version))
        return out
