"""Build a tiny HF-format Qwen3 checkpoint locally: config.json, model.safetensors and a word-level tokenizer
with Qwen's special tokens and chat template. Used by the embedded default and the tests; nothing is downloaded.

    python -m canopy.tiny_checkpoint OUT_DIR [--hidden-size 64 --layers 2 --seed 0]
"""

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from canopy.envs.embedded import VOCABULARY

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHAT_WORDS = ["\n", "system", "user", "assistant", "<unk>"]

# Qwen's chat format, without tools: <|im_start|>{role}\n{content}<|im_end|>\n
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(words=VOCABULARY) -> PreTrainedTokenizerFast:
    """Word-level tokenizer: one id per word, newlines kept as tokens, spaces dropped."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHAT_WORDS + sorted(set(words) - set(CHAT_WORDS)))}
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


def build_tiny_checkpoint(
    out_dir: str | Path,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int = 192,
    max_position_embeddings: int = 2048,
    seed: int = 0,
) -> Path:
    """Write a randomly initialized Qwen3 (HF format) and its tokenizer to `out_dir`, atomically."""
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer()
    config = Qwen3Config(
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
    model = Qwen3ForCausalLM(config)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-qwen3-", dir=out_dir.parent))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(staging, out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = build_tiny_checkpoint(args.out_dir, hidden_size=args.hidden_size, layers=args.layers, seed=args.seed)
    print(json.dumps({"path": str(path), "vocab_size": len(build_tokenizer())}))


if __name__ == "__main__":
    main()
