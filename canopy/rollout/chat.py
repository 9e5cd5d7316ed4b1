"""The chat side of the token-in / token-out loop (Sec. 3.1): the tokenizer with the experiment's template options,
its model family's chat markers, and the ids of the rendered prompt and observations (rendered once, never
re-tokenized)."""

import functools
import threading
from collections import OrderedDict

from canopy.models import DEFAULT_FAMILY, MODEL_FAMILIES
from canopy.models.spec import ChatMarkers


class Memo:
    """The `size` most recently used results of a pure function, by key (thread-safe: episodes render in threads)."""

    def __init__(self, size: int):
        self.size, self.results, self.lock = size, OrderedDict(), threading.Lock()

    def get(self, key, compute):
        with self.lock:
            if key in self.results:
                self.results.move_to_end(key)
                return self.results[key]
        result = compute()
        with self.lock:
            self.results[key] = result
            if len(self.results) > self.size:
                self.results.popitem(last=False)
        return result


MEMO_TEXT_CHARS = 1024  # texts encoded at most this long are remembered (observations, the chat markers' frames)
MEMO_TEXTS = 4096  # at most ~300 tokens each: ~20 MB at worst
MEMO_TEMPLATES = 64  # rendered prompts: a step renders each task's prompt for every episode of its group in a row


class ChatTokenizer:
    """A tokenizer whose chat template is always applied with the experiment's options (`model.chat_template_kwargs`,
    e.g. `enable_thinking: false` for Table A3's Qwen3.5), so that the prompt and every rendered observation follow
    them, and which carries its model family's chat `markers` (`canopy.models`; default: the default family's).
    Everything else is the wrapped tokenizer's (saving it saves the tokenizer unchanged).

    A step renders the same prompt for every episode of a group and mostly the same short observations: rendered
    prompts and the ids of short texts are remembered (`Memo`), the same ids the tokenizer gives, without its cost
    (the chat template and the encoding were most of a rollout's time outside generation, docs/step_profile.md)."""

    def __init__(self, tokenizer, markers: ChatMarkers | None = None, **template_kwargs):
        self.tokenizer, self.template_kwargs = tokenizer, template_kwargs
        self.markers = markers or MODEL_FAMILIES[DEFAULT_FAMILY].chat
        self.texts, self.templates = Memo(MEMO_TEXTS), Memo(MEMO_TEMPLATES)

    def __getattr__(self, name: str):
        if name == "tokenizer":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("texts", "templates")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, texts=Memo(MEMO_TEXTS), templates=Memo(MEMO_TEMPLATES))

    def __len__(self) -> int:
        return len(self.tokenizer)

    def apply_chat_template(self, conversation, **kwargs):
        kwargs = {**self.template_kwargs, **kwargs}
        if kwargs.get("tokenize", True):
            return self.tokenizer.apply_chat_template(conversation, **kwargs)
        key = repr((conversation, sorted(kwargs.items())))
        return self.templates.get(key, lambda: self.tokenizer.apply_chat_template(conversation, **kwargs))

    def encode(self, text, *args, add_special_tokens: bool = True, **kwargs):
        """The tokenizer's `encode`; the ids of a short text alone (no pair, no other options) are remembered."""
        if args or kwargs or not isinstance(text, str) or len(text) > MEMO_TEXT_CHARS:
            return self.tokenizer.encode(text, *args, add_special_tokens=add_special_tokens, **kwargs)
        ids = self.texts.get(
            (text, add_special_tokens),
            lambda: tuple(self.tokenizer.encode(text, add_special_tokens=add_special_tokens)),
        )
        return list(ids)


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
