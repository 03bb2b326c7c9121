"""The demo model: a tiny random Llama-style model and a byte-level tokenizer, built once in code and cached.

Its text is meaningless (random weights); it exists so that everything runs offline, fast, on any machine, through
the same ``from_pretrained`` path as a real model.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # transformers loads only when the model is built
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

DEMO_VERSION = "v1"
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def demo_model_dir() -> Path:
    """Where the demo model lives: ``$BATCHGEN_CACHE_DIR`` or ``~/.cache/batchgen``, built on first use."""
    root = Path(os.environ.get("BATCHGEN_CACHE_DIR") or Path.home() / ".cache" / "batchgen")
    path = root / f"demo-model-{DEMO_VERSION}"
    if not (path / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        # Build in a private temp dir and rename atomically, so concurrent builders never see a half-written model.
        tmp = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=root))
        try:
            _build(tmp)
            os.rename(tmp, path)
        except OSError:
            if not (path / "config.json").exists():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Every byte is one token (ids 0-255), then bos, eos and pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=2048
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(vocab_size: int, bos_id: int, eos_id: int, pad_id: int, **sizes: int) -> LlamaForCausalLM:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=sizes.get("hidden_size", 64),
        intermediate_size=sizes.get("intermediate_size", 128),
        num_hidden_layers=sizes.get("num_hidden_layers", 2),
        num_attention_heads=sizes.get("num_attention_heads", 4),
        num_key_value_heads=sizes.get("num_key_value_heads", 2),
        max_position_embeddings=sizes.get("max_position_embeddings", 2048),
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(sizes.get("seed", 1234))
    model = LlamaForCausalLM(config)
    model.to(torch.float32)
    # Random init gives near-uniform logits; widen them so greedy decoding has clear winners.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def _build(path: Path) -> None:
    tokenizer = build_tokenizer()
    vocab = tokenizer.get_vocab()
    bos, eos, pad = vocab[BOS], vocab[EOS], vocab[PAD]
    model = build_model(len(tokenizer), bos, eos, pad)
    model.generation_config.eos_token_id = eos
    model.generation_config.bos_token_id = bos
    model.generation_config.pad_token_id = pad
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, which the ByteLevel pre-tokenizer uses."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}
