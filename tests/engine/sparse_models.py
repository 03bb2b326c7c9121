"""Tiny random models of the sparse-attention families (DeepSeek-V3.2 and GLM-5's DSA, DeepSeek-V4's compressed
attention), built from transformers' own config classes, saved and loaded back through ``from_pretrained`` as a
user's checkpoint would be."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

COMMON = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
MLA = {"kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16}
MOE = {"moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1}
DSA = {"index_topk": 8, "index_head_dim": 16, "index_n_heads": 8}
"""Eight indexer heads: with fewer, ReLU zeros tie and ``topk`` breaks the ties differently by context length, so
transformers disagrees with itself (``/work/designs/hybrid.md``, 4.1)."""

FAMILIES: dict[str, dict[str, Any]] = {
    "deepseek_v32": {
        **MLA,
        **MOE,
        **DSA,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "first_k_dense_replace": 1,
    },
    "glm_moe_dsa": {
        **MLA,
        **MOE,
        **DSA,
        "num_hidden_layers": 3,
        "intermediate_size": 128,
        "first_k_dense_replace": 1,
        "indexer_types": ["full", "shared", "full"],
    },
    "deepseek_v4": {
        "num_hidden_layers": 3,
        "head_dim": 32,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "moe_intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 4,
        "sliding_window": 8,
        "hc_mult": 2,
        "num_key_value_heads": 1,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        "mlp_layer_types": ["hash_moe", "moe", "moe"],
    },
}


def build(model_type: str, tokenizer: Any, path: Path, **extra: Any) -> Path:
    """A tiny random ``model_type`` with ``tokenizer``, saved at ``path``; its LM head scaled for clear greedy
    margins, no EOS (every request runs to its length, in transformers as in the engine)."""
    special = {name: tokenizer.convert_tokens_to_ids(t) for name, t in (("bos", "<|bos|>"), ("eos", "<|eos|>"))}
    config = AutoConfig.for_model(
        model_type,
        **{**COMMON, **FAMILIES[model_type], "vocab_size": len(tokenizer), **extra},
        bos_token_id=special["bos"],
        eos_token_id=special["eos"],
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
