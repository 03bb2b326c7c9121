"""What a tensor-parallel group can split, and the flags it goes with. The weights are split by the model's own
tensor-parallel plan (transformers' ``base_model_tp_plan``: column-wise projections into the heads and the MLP's
inner width, row-wise out of them with an all-reduce, the vocabulary split across the embedding and the head), so each
rank holds its share of every layer's attention heads, and of the KV cache with them (Gated DeltaNet layers, which
transformers' plans gather back whole, are split by heads by ``features/state/heads.py``)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from .quantization import method_of

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


def stage_problem(model_config: Any, stages: int) -> str | None:
    """Why this model's decoder layers cannot be split into ``stages`` pipeline stages (one line, naming the sizes
    that would work), or ``None``. The split is transformers' own (``base_model_pp_plan``: the embeddings on the
    first stage, contiguous layers on each, the norm and the head on the last)."""
    text = model_config.get_text_config()
    if text is not model_config or not getattr(text, "base_model_pp_plan", None):
        return (
            f"it cannot be split into {stages} pipeline stages: its config declares no pipeline plan for its own "
            "layers (base_model_pp_plan); serve it with --pipeline-parallel-size 1"
        )
    layers = int(text.num_hidden_layers)
    if layers >= stages:
        return None
    return (
        f"its {layers} decoder layers cannot be split into {stages} pipeline stages (a layer each at least); "
        f"--pipeline-parallel-size {', '.join(map(str, range(1, layers + 1)))} would work"
    )


def shard_kwargs(config: EngineConfig, model_config: Any) -> dict[str, Any]:
    """``from_pretrained``'s arguments that load this rank's shard alone (transformers' distributed loading: each
    parameter of this rank's stage is read from the checkpoint as the slice this rank holds; the other stages'
    modules are never built); ``ModelNotSupported`` in one line if the model cannot be split that way."""
    from transformers.distributed.configuration_utils import DistributedConfig

    from ..errors import ModelNotSupported

    size, stages, experts = config.tensor_parallel_size, config.pipeline_parallel_size, config.enable_expert_parallel
    problem = split_problem(model_config, size, experts) if size > 1 else None
    if problem is None and stages > 1:
        problem = stage_problem(model_config, stages)
    if problem is None and (method := method_of(model_config)) is not None:
        problem = (
            f"its checkpoint is quantized ({method}) and {config.split_flags} is asked for: quantized shards are "
            "not served yet; serve it on one device, or a float checkpoint split"
        )
    if problem:
        architecture = next(iter(getattr(model_config, "architectures", None) or []), model_config.model_type)
        raise ModelNotSupported(architecture, problem)
    # Expert parallelism: the experts' own plan on a mesh as wide as the heads' (each rank runs its experts on the
    # tokens every rank shares, and the outputs are summed: transformers' all-reduce implementation). The mesh is
    # (pp, tp): rank r is stage r // tp, and within it TP rank r % tp.
    distributed = DistributedConfig(tp_size=size, pp_size=stages, ep_size=size if experts else None)
    return {"distributed_config": distributed}


def check_split(config: EngineConfig, path: str) -> None:
    """Refuse the model at ``path`` if it cannot be split as the flags ask, before any rank starts
    (its config alone is read); a config that cannot be read is left to the loader's own message."""
    from transformers import AutoConfig

    try:
        model_config = AutoConfig.from_pretrained(
            path, revision=config.revision, trust_remote_code=config.trust_remote_code
        )
    except (OSError, ValueError):
        return
    shard_kwargs(config, model_config)


@contextmanager
def loading(config: EngineConfig) -> Iterator[None]:
    """Around ``from_pretrained`` with ``shard_kwargs``. transformers 5.24 expands the tensor-parallel plan over every
    layer, then makes the other stages' layers identities, then shards by the expanded names (a ``KeyError`` on the
    first layer this stage does not hold): with both TP and PP, its sharding is given the plan's entries this stage
    holds (an identity's hooks would never run anyway: the stage does not call it)."""
    if config.tensor_parallel_size == 1 or config.pipeline_parallel_size == 1:
        yield
        return
    from transformers.distributed import mixin
    from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

    shard: Any = getattr(mixin, "apply_tensor_parallelism")  # noqa: B009 (not re-exported: typed as private)

    def held_only(model: Any, mesh: Any, plan: dict[str, str]) -> Any:
        modules, parameters = dict(model.named_modules()), dict(model.named_parameters())
        held = {
            name: style
            for name, style in plan.items()
            if name in parameters or (name in modules and not isinstance(modules[name], PipelineIdentityLayer))
        }
        return shard(model, mesh, held)

    setattr(mixin, "apply_tensor_parallelism", held_only)  # noqa: B010
    try:
        yield
    finally:
        setattr(mixin, "apply_tensor_parallelism", shard)  # noqa: B010


WHOLE_OUTPUT_STYLES = ("colwise_gather_output", "replicated_with_grad_allreduce")
"""Tensor-parallel styles after which every rank holds a layer's whole output: a state layer split only so (Gated
DeltaNet's projections in transformers' plans, where ``state/heads.py`` does not split it by heads) runs its whole
recurrence on every rank, over a whole state."""


def split_state_problem(model: Any, layers: Any, config: EngineConfig) -> str | None:
    """Why a split model's state layers cannot run (one line), or ``None``: a state layer the engine does not split
    by heads (``state/heads.py``) runs whole on every rank of its stage, over its own copy of the whole state, so the
    plan may split it only where its projections' outputs are gathered back."""
    plan: dict[str, str] = getattr(model, "_tp_plan", None) or {}
    patterns = [(re.compile(_regex(key)), key, style) for key, style in plan.items()]
    names = {module: name for name, module in model.named_modules()}
    for layer in layers:
        for name, _ in layer.module.named_modules(prefix=names[layer.module]):
            for regex, key, style in patterns:
                if style not in WHOLE_OUTPUT_STYLES and regex.fullmatch(name):
                    return (
                        f"its state layer's {name} is split by its tensor-parallel plan ({key}: {style}), which "
                        "the engine's state cache cannot follow; serve it with --tensor-parallel-size 1"
                    )
    return None


def _regex(key: str) -> str:
    """A plan entry (``layers.*.linear_attn.in_proj_qkv``) as a pattern of the full module names it names."""
    return "(.*\\.)?" + re.escape(key).replace("\\*", "[0-9]+")
