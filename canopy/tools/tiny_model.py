"""Build a tiny HF-format Qwen3 checkpoint locally: config.json, model.safetensors and a word-level (the vault
world's words) or byte-level (any text) tokenizer with Qwen's special tokens and chat template (the builder:
canopy/tiny_model.py). Prints its path and vocabulary size as JSON; nothing is downloaded.

    python -m canopy.tools.tiny_model OUT_DIR [--hidden-size 64 --layers 2 --format-warmup-steps 0 --tokenizer word
                                              --seed 0]
"""

import argparse
import json

from canopy.tiny_model import TINY_TOKENIZERS, build_tiny_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--format-warmup-steps", type=int, default=0)
    parser.add_argument("--tokenizer", choices=sorted(TINY_TOKENIZERS), default="word")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = build_tiny_checkpoint(
        args.out_dir,
        hidden_size=args.hidden_size,
        layers=args.layers,
        format_warmup_steps=args.format_warmup_steps,
        tokenizer=args.tokenizer,
        seed=args.seed,
    )
    print(json.dumps({"path": str(path), "vocab_size": len(TINY_TOKENIZERS[args.tokenizer]())}))


if __name__ == "__main__":
    main()
