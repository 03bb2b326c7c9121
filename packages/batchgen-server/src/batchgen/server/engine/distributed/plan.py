"""What a tensor-parallel group can split, and the flags it goes with. The weights are split by the model's own
tensor-parallel plan (transformers' ``base_model_tp_plan``: column-wise projections into the heads and the MLP's
inner width, row-wise out of them with an all-reduce, the vocabulary split across the embedding and the head), so each
rank holds its share of every layer's attention heads, and of the KV cache with them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import EngineConfig


def split_counts(model_config: Any) -> dict[str, int]:
    """What each rank takes an equal share of: the attention heads and the KV heads (the cache is split by them)."""
    text = model_config.get_text_config()
    heads = int(text.num_attention_heads)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return {"attention heads": heads, "KV heads": int(kv_heads)}


EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Where an MoE config says how many routed experts each layer has."""


def split_problem(model_config: Any, size: int, experts: bool = False) -> str | None:
    """Why this model cannot be split ``size`` ways (one line, naming the sizes that would work), or ``None``;
    ``experts``: with its experts spread over the ranks (expert parallelism)."""
    text = model_config.get_text_config()
    if experts and not getattr(text, "base_model_ep_plan", None):
        return (
            "it declares no expert-parallel plan (base_model_ep_plan: not an MoE model transformers can spread); "
            "drop --enable-expert-parallel"
        )
    if getattr(model_config, "is_encoder_decoder", False) or not getattr(text, "base_model_tp_plan", None):
        return (
            f"it cannot be split over {size} ranks: its config declares no tensor-parallel plan "
            "(base_model_tp_plan); serve it with --tensor-parallel-size 1"
        )
    counts = split_counts(model_config)
    if experts:
        counts["experts"] = next(int(getattr(text, name)) for name in EXPERT_COUNTS if getattr(text, name, None))
    uneven = [f"{count} {what}" for what, count in counts.items() if count % size]
    if not uneven:
        return None
    works = [n for n in range(1, max(counts.values()) + 1) if all(count % n == 0 for count in counts.values())]
    return (
        f"its {' and '.join(uneven)} cannot be split {size} ways; --tensor-parallel-size "
        f"{', '.join(map(str, works))} would work"
    )


def shard_kwargs(config: EngineConfig, model_config: Any) -> dict[str, Any]:
    """``from_pretrained``'s arguments that load this rank's shard alone (transformers' tensor-parallel loading:
    each parameter is read from the checkpoint as the slice this rank holds); ``ModelNotSupported`` in one line if
    the model cannot be split that way."""
    from transformers.distributed.configuration_utils import DistributedConfig

    from ..errors import ModelNotSupported

    size, experts = config.tensor_parallel_size, config.enable_expert_parallel
    if problem := split_problem(model_config, size, experts):
        architecture = next(iter(getattr(model_config, "architectures", None) or []), model_config.model_type)
        raise ModelNotSupported(architecture, problem)
    # Expert parallelism: the experts' own plan on a mesh as wide as the heads' (each rank runs its experts on the
    # tokens every rank shares, and the outputs are summed: transformers' all-reduce implementation).
    return {"distributed_config": DistributedConfig(tp_size=size, ep_size=size if experts else None)}


def check_split(config: EngineConfig, path: str) -> None:
    """Refuse the model at ``path`` if it cannot be split ``--tensor-parallel-size`` ways, before any rank starts
    (its config alone is read); a config that cannot be read is left to the loader's own message."""
    from transformers import AutoConfig

    try:
        model_config = AutoConfig.from_pretrained(
            path, revision=config.revision, trust_remote_code=config.trust_remote_code
        )
    except (OSError, ValueError):
        return
    shard_kwargs(config, model_config)
