"""Build a tiny HF-format Qwen3 checkpoint locally: config.json, model.safetensors and a word-level (the vault
world's words) or byte-level (any text) tokenizer with Qwen's special tokens and chat template. Used by the
embedded default and the tests; nothing is downloaded.

The weights are randomly initialized. With `--format-warmup-steps N > 0` the random model is then briefly
"pretrained" on transcripts of the embedded vault world in which every assistant reply first restates the
status (`locked`) and then gives a command drawn uniformly at random, independent of the state. In the testbed's
world (`declare_done`) the reply restates the goal's last word too (`held locked`), and the command is `done` one
time in ten. The base model learns the reply format, as a real base model knows how to reason and write code, but
not which command solves a task: that is what RL has to find, and the base policy's success stays at the
random-policy rates.

The warm-up plays the vault world (canopy.envs.embedded) and renders its transcripts as the agent loop does
(canopy.rollout.agent_loop): the two imports the layer contract exempts (pyproject.toml). The command:
`python -m canopy.tools.tiny_model OUT_DIR` (canopy/tools/tiny_model.py).
"""

import os
import random
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE, WordLevel
from transformers import PreTrainedTokenizerFast

from canopy.envs.embedded import ACTIONS, FINISH, GOAL_TEXT, VOCABULARY, EmbeddedEnvironment
from canopy.models import DEFAULT_FAMILY, get_family

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHAT_WORDS = ["\n", "system", "user", "assistant", "<unk>"]
FINISH_RATE = 0.1  # how often a warm-up reply is `done` in the testbed's world (base success 0.14/0.02/0.01 by tier)

# Qwen's chat format, without tools: <|im_start|>{role}\n{content}<|im_end|>\n; thinking disabled opens each
# assistant turn with an empty think block, as Qwen3's template does
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)


def build_tokenizer(words=VOCABULARY, pad_vocab_multiple: int = 1) -> PreTrainedTokenizerFast:
    """Word-level tokenizer: one id per word, newlines kept as tokens, spaces dropped. Reserved tokens pad the
    vocabulary to a multiple of `pad_vocab_multiple`, as Qwen pads its own, so it shards evenly."""
    tokens = SPECIAL_TOKENS + CHAT_WORDS + sorted(set(words) - set(CHAT_WORDS))
    tokens += [f"<|reserved_{i}|>" for i in range(-len(tokens) % pad_vocab_multiple)]
    vocab = {token: i for i, token in enumerate(tokens)}
    model = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(" ", behavior="removed"), pre_tokenizers.Split("\n", behavior="isolated")]
    )
    model.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=model,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )


def build_byte_tokenizer(pad_vocab_multiple: int = 1) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer (one id per byte, no merges) with Qwen's special tokens and chat template: it
    encodes any text exactly (an environment's prompts, the code actions of the fault soak). Padded as above."""
    tokens = SPECIAL_TOKENS + sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens += [f"<|reserved_{i}|>" for i in range(-len(tokens) % pad_vocab_multiple)]
    vocab = {token: i for i, token in enumerate(tokens)}
    model = Tokenizer(BPE(vocab=vocab, merges=[]))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    model.decoder = decoders.ByteLevel()
    model.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=model, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )


TINY_TOKENIZERS = {"word": build_tokenizer, "byte": build_byte_tokenizer}  # model.tiny.tokenizer


def random_command_transcripts(
    tokenizer, count: int, max_turns: int, seed: int, junk_rate: float = 0.2, declare_done: bool = False
) -> list[tuple[list[int], list[int]]]:
    """(token ids, action mask) of vault-world episodes played by a uniformly random command policy that
    sometimes adds or substitutes a stray word, so the base model keeps some off-format exploration."""
    from canopy.rollout.chat import render_observation, render_prompt

    rng = random.Random(seed)
    env = EmbeddedEnvironment(declare_done=declare_done)
    tasks = env.tasks("train")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    transcripts = []
    for _ in range(count):
        episode = env.start(rng.choice(tasks), seed=0)
        ids = render_prompt(tokenizer, episode.messages())
        mask = [0] * len(ids)
        status = episode.messages()[-1]["content"].split()[-1]
        for _ in range(max_turns):
            reply = [FINISH if declare_done and rng.random() < FINISH_RATE else rng.choice(ACTIONS)]
            if rng.random() < junk_rate:  # a stray word before the command, or instead of it
                reply = [rng.choice(VOCABULARY)] + (reply if rng.random() < 0.5 else [])
            reply = [status] + reply  # restate the status, then act
            if declare_done:  # restate the goal's last word too: the right command depends on both
                reply = [GOAL_TEXT[episode.goal_end - 1].split()[-1]] + reply
            reply_ids = tokenizer.encode(" ".join(reply), add_special_tokens=False) + [im_end]
            ids += reply_ids
            mask += [1] * len(reply_ids)
            result = episode.step(" ".join(reply[1 + declare_done :]))
            if result.done:
                break
            status = result.observation.split()[-1]
            observation = render_observation(tokenizer, result.observation, cap=64, close_turn=False)
            ids += observation
            mask += [0] * len(observation)
        transcripts.append((ids, mask))
    return transcripts


def format_warmup(
    model, tokenizer, steps: int, seed: int, turns: int = 5, declare_done: bool = False, batch_size: int = 32
) -> None:
    """Supervised warm-up on random-command transcripts of up to `turns` turns (loss on the reply tokens only)."""
    data = random_command_transcripts(tokenizer, steps * batch_size, turns, seed, declare_done=declare_done)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for step in range(steps):
        chunk = data[step * batch_size : (step + 1) * batch_size]
        width = max(len(ids) for ids, _ in chunk)
        input_ids = torch.full((len(chunk), width), tokenizer.pad_token_id)
        labels = torch.full((len(chunk), width), -100)
        for row, (ids, mask) in enumerate(chunk):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(ids), -100)
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def build_tiny_checkpoint(
    out_dir: str | Path,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int = 192,
    max_position_embeddings: int = 2048,
    format_warmup_steps: int = 0,
    pad_vocab_multiple: int = 1,
    tokenizer: str = "word",
    family: str = DEFAULT_FAMILY,
    warmup_turns: int = 5,
    declare_done: bool = False,
    seed: int = 0,
) -> Path:
    """Write a randomly initialized (optionally format-warmed) model of `family` (`canopy.models`: its
    `ModelSpec.tiny_model`) in HF format and its tokenizer, atomically. `tokenizer`: `word` reads and writes the
    vault world's words only (any other word is `<unk>`); `byte` reads and writes any text, one token per byte."""
    out_dir = Path(out_dir)
    spec = get_family(family, key="model.tiny.family")
    tokenizer = TINY_TOKENIZERS[tokenizer](pad_vocab_multiple=pad_vocab_multiple)
    shared = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden_size // heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = spec.tiny_model(shared)
    if format_warmup_steps:
        format_warmup(model, tokenizer, format_warmup_steps, seed, warmup_turns, declare_done)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-qwen3-", dir=out_dir.parent))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(staging, out_dir)
    return out_dir
