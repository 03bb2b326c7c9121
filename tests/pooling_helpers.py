"""Tiny random pooling models built in code, saved as their libraries save them: sentence-transformers embedding
models on decoders, decoder classifiers and reward models, a Qwen3-Reranker-shaped causal LM, and cross-encoders
(BERT, XLM-R, ModernBERT). Each builder writes a directory that ``from_pretrained`` (and sentence-transformers) loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from batchgen.server.engine.loading.demo_model import build_tokenizer

WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "ran", "far", "and", "big", "red", "blue", "house", "tree"]
BERT_VOCAB = ["[UNK]", "[PAD]", "[CLS]", "[SEP]", "[MASK]", *WORDS] + [chr(c) for c in range(97, 123)]
BERT_VOCAB += [f"##{chr(c)}" for c in range(97, 123)]
SIZES = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}


def decoder_tokenizer(*extra: str) -> Any:
    """The demo's byte-level tokenizer, no chat template (an embedding model's), with ``extra`` whole-word tokens."""
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    if extra:
        tokenizer.add_tokens(list(extra))
    return tokenizer


def _decoder_config(kind: str, tokenizer: Any, **extra: Any) -> Any:
    from transformers import LlamaConfig, Qwen3Config

    config_class = Qwen3Config if kind == "qwen3" else LlamaConfig
    head = {"head_dim": 8} if kind == "qwen3" else {}
    return config_class(
        vocab_size=len(tokenizer),
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
        **SIZES,
        **head,
        **extra,
    )


def build_st_embedding(
    path: Path, kind: str = "qwen3", pooling: str = "lasttoken", normalize: bool = True, prompts: Any = None
) -> Path:
    """A sentence-transformers embedding model on a tiny decoder, in the files Qwen3-Embedding ships (written as
    sentence-transformers 3-5 wrote them: legacy module types and ``pooling_mode_*`` keys; sentence-transformers 6
    loads them, tests/engine/test_pooling_models.py checks against it)."""
    from transformers import AutoModel

    tokenizer = decoder_tokenizer()
    torch.manual_seed(3)
    AutoModel.from_config(_decoder_config(kind, tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    modules = [("", "Transformer"), ("1_Pooling", "Pooling"), *([("2_Normalize", "Normalize")] if normalize else [])]
    entries = [
        {"idx": i, "name": str(i), "path": where, "type": f"sentence_transformers.models.{name}"}
        for i, (where, name) in enumerate(modules)
    ]
    (path / "modules.json").write_text(json.dumps(entries))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}))
    modes = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "lasttoken"}
    settings = {
        "word_embedding_dimension": SIZES["hidden_size"],
        **{key: mode == pooling for key, mode in modes.items()},
    }
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({**settings, "include_prompt": True}))
    if normalize:
        (path / "2_Normalize").mkdir()
    st_config = {"prompts": prompts or {}, "default_prompt_name": None, "similarity_fn_name": "cosine"}
    (path / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    return path


def build_decoder_classifier(path: Path, kind: str, labels: list[str]) -> Path:
    """``Qwen3ForSequenceClassification`` / ``LlamaForSequenceClassification`` with ``labels``."""
    from transformers import AutoModelForSequenceClassification

    tokenizer = decoder_tokenizer()
    id2label = dict(enumerate(labels))
    config = _decoder_config(kind, tokenizer, id2label=id2label, label2id={v: k for k, v in id2label.items()})
    torch.manual_seed(5)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        model.score.weight.mul_(20.0)  # scores that differ visibly
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_yes_no_reranker(path: Path) -> Path:
    """A Qwen3-Reranker-shaped causal LM: its tokenizer has "yes" and "no" tokens."""
    from transformers import Qwen3ForCausalLM

    tokenizer = decoder_tokenizer("yes", "no")
    torch.manual_seed(7)
    model = Qwen3ForCausalLM(_decoder_config("qwen3", tokenizer))
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_cross_encoder(path: Path, kind: str) -> Path:
    """A cross-encoder of one label (ms-marco's shape) on BERT, XLM-R or ModernBERT, with a WordPiece tokenizer
    (token types only where the model has two)."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        BertTokenizer,
        ModernBertConfig,
        ModernBertForSequenceClassification,
        XLMRobertaConfig,
        XLMRobertaForSequenceClassification,
    )

    torch.manual_seed(11)
    common = {"vocab_size": len(BERT_VOCAB), "num_labels": 1, "pad_token_id": 1, **SIZES}
    model: Any
    if kind == "bert":
        model = BertForSequenceClassification(BertConfig(max_position_embeddings=128, **common))
    elif kind == "xlmr":
        model = XLMRobertaForSequenceClassification(
            XLMRobertaConfig(max_position_embeddings=130, type_vocab_size=1, **common)
        )
    else:
        model = ModernBertForSequenceClassification(
            ModernBertConfig(
                max_position_embeddings=128, cls_token_id=2, sep_token_id=3, bos_token_id=2, eos_token_id=3,
                global_attn_every_n_layers=1, **common,
            )
        )  # fmt: skip
    model.save_pretrained(path)
    names = {} if kind == "bert" else {"model_input_names": ["input_ids", "attention_mask"]}
    BertTokenizer(vocab={token: i for i, token in enumerate(BERT_VOCAB)}, **names).save_pretrained(path)
    return path
