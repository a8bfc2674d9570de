"""Builds a tiny Llama model offline, for running real vLLM without a model hub.

Run it with the Python of the vLLM install (tests/vllm/install-vllm.sh), which ships ``tokenizers``,
``transformers`` and ``torch``::

    python tests/vllm/tinymodel.py [--out DIR]    # prints the model directory

Nothing is downloaded. The tokenizer is a byte-level BPE trained on a fixed list of the Python
standard library's own sources; the weights are random, from a fixed seed. The result is cached under
``$KVFENCE_CACHE/models/`` (default ``~/.cache/kvfence``), keyed by :data:`VERSION` and the versions of
the libraries that write it, and built into a scratch directory that is renamed into place only when
complete.

Sizes follow what vLLM's CPU backend accepts: the attention head size must be at least 32 (hidden 128
with 4 heads); 2 layers and a 4096-token vocabulary make about 1.4 M parameters (5.6 MB).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

#: Bump when the model or tokenizer changes: it is part of the cache key.
VERSION = "1"
SEED = 20261201
VOCAB_SIZE = 4096
HIDDEN = 128
HEADS = 4
LAYERS = 2
MAX_POSITIONS = 4096
#: Standard-library modules the tokenizer learns from (fixed, so every machine trains the same one).
CORPUS_MODULES = (
    "argparse", "ast", "asyncio/base_events", "collections/__init__", "configparser", "csv",
    "dataclasses", "datetime", "email/message", "enum", "functools", "http/client", "inspect",
    "json/decoder", "logging/__init__", "pathlib", "pickle", "random", "shutil", "string",
    "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest/case", "urllib/parse",
    "zipfile",
)  # fmt: skip
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]


def cache_dir() -> Path:
    import tokenizers
    import torch
    import transformers

    root = Path(os.environ.get("KVFENCE_CACHE", Path.home() / ".cache" / "kvfence"))
    key = f"tiny-llama-v{VERSION}-tf{transformers.__version__}-tok{tokenizers.__version__}"
    key += f"-torch{torch.__version__.split('+')[0]}"
    return root / "models" / key


def corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for name in CORPUS_MODULES:
        texts.append((stdlib / f"{name}.py").read_text(encoding="utf-8"))
    return texts


def build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = MAX_POSITIONS
    fast.save_pretrained(out)

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    # Random weights with a larger spread than the default init, so that greedy decoding of
    # different prompts gives different continuations (a flat model answers everything alike).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    (out / "kvfence-tiny.json").write_text(json.dumps({"version": VERSION, "seed": SEED}) + "\n")


def ensure(out: Path | None = None) -> Path:
    target = out or cache_dir()
    if (target / "kvfence-tiny.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        scratch.chmod(0o755)
        build(scratch)
        if target.exists():
            shutil.rmtree(target)
        scratch.rename(target)
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="build here instead of the cache")
    args = ap.parse_args()
    print(ensure(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
