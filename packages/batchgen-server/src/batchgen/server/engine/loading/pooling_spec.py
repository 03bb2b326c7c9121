"""What a checkpoint is served as when it is not (only) a generator: an embedding model, a classifier or reward model,
a cross-encoder, or a causal LM that reranks by its "yes"/"no" logits; and how its hidden states are pooled, read
from its sentence-transformers config (``modules.json``, ``1_Pooling/config.json``, ``config_sentence_transformers
.json``) as sentence-transformers reads it. Pure data, read from the model's directory (or the hub's cache) by the
loader and by the serving layer alike."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any, Literal

from ..errors import ModelNotSupported

if TYPE_CHECKING:
    from ..config import EngineConfig

PoolingMode = Literal["mean", "last", "cls"]
Kind = Literal["generate", "embed", "classify", "reward", "yes_no"]
"""``generate``: a causal LM (which also embeds, pooled as its sentence-transformers config says, else by the mean);
``embed``: an embedding model (no LM head); ``classify``/``reward``: a ``*ForSequenceClassification`` head on the
pooled state (a reward model's values are raw); ``yes_no``: a causal LM whose relevance score is
``sigmoid(logit("yes") - logit("no"))`` at the last token (Qwen3-Reranker)."""

ST_POOLING = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
"""sentence-transformers' pooling modes that batchgen runs, by their names there."""
ST_LEGACY_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "lasttoken",
}
ST_OTHER_KEYS = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
ST_MODULES = ("Transformer", "Pooling", "Normalize")

QWEN3_RERANKER_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_RERANKER_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
"""Qwen3-Reranker's recipe (its model card): ``prefix + "<Instruct>: {i}\\n<Query>: {q}\\n<Document>: {d}" +
suffix``, each part tokenized on its own."""


@dataclass(frozen=True, slots=True)
class PoolingSpec:
    kind: Kind
    architecture: str
    encoder: bool = False
    """A BERT-style encoder (run in padded batches by ``EncoderEngine``), else a decoder through the paged engine."""
    mode: PoolingMode = "mean"
    normalize: bool = True
    include_prompt: bool = True
    prompts: dict[str, str] = field(default_factory=dict)
    """sentence-transformers' named instruction prefixes (``config_sentence_transformers.json``)."""
    default_prompt_name: str | None = None
    labels: tuple[str, ...] = ()
    """The classifier's ``id2label`` in index order (``yes_no``: one score)."""
    activation: Literal["sigmoid", "softmax", "identity"] = "identity"
    """What a score is made with from the head's values: sigmoid for one label (sentence-transformers' CrossEncoder
    default), softmax over several (``/classify``'s probabilities)."""
    matryoshka_dimensions: tuple[int, ...] | None = None
    """The dimensions a request may truncate to, where the config lists them; any up to the size otherwise."""
    embedding_size: int | None = None
    """An embedding's length (the hidden size: the sentence-transformers modules run add no dense layer)."""

    @property
    def pooling_only(self) -> bool:
        """Served by the pooling runner: no generation, no LM head (vLLM's ``--runner pooling``)."""
        return self.kind != "generate"

    @property
    def scores_pairs(self) -> bool:
        """Serves ``/v1/score`` and ``/v1/rerank``: a cross-encoder or classifier of one label, or a yes/no reranker."""
        return self.kind == "yes_no" or (self.kind == "classify" and len(self.labels) == 1)

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The pooling endpoints it serves, as they are named in refusals."""
        if self.kind in ("generate", "embed"):
            return ("/v1/embeddings", "/pooling")
        named = ("/v1/score", "/v1/rerank") if self.scores_pairs else ()
        return (*named, "/classify", "/pooling") if self.kind != "yes_no" else (*named, "/pooling")


def spec_of(config: EngineConfig) -> PoolingSpec:
    """The spec of ``config.model`` served as ``--task``/``--runner`` say; ``ModelNotSupported`` (one line) where
    they cannot go together."""
    return _spec(config.model, config.revision, config.trust_remote_code, config.task, config.runner)


@cache
def _spec(model: str, revision: str | None, trust_remote_code: bool, task: str, runner: str) -> PoolingSpec:
    from transformers import AutoConfig

    from .loader import is_encoder_only, resolve_model_path

    path = resolve_model_path(model)
    config = AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    architecture = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    classifier = architecture.endswith("ForSequenceClassification")
    st = _read_st(path, revision)
    encoder = is_encoder_only(config)
    if classifier:
        if task in ("generate", "embed", "score") and not (task == "score" and _one_label(config)):
            raise ModelNotSupported(architecture, f"a sequence classifier cannot be served with --task {task}")
        labels = _labels(config)
        kind: Kind = "reward" if task == "reward" else "classify"
        activation = _activation(config, labels) if kind == "classify" else "identity"
        return PoolingSpec(kind, architecture, encoder, "cls" if encoder else "last", False, labels=labels,
                           activation=activation)  # fmt: skip
    if encoder:
        if task not in ("auto", "embed"):
            raise ModelNotSupported(
                architecture, f"an encoder without a classifier head only embeds, not --task {task}"
            )
        return dataclasses.replace(_embedding(architecture, st, True, "mean"), embedding_size=_hidden_size(config))
    if task in ("classify", "reward"):
        raise ModelNotSupported(
            architecture, f"--task {task} needs a *ForSequenceClassification checkpoint (a causal LM has no score head)"
        )
    if task == "score":
        return PoolingSpec("yes_no", architecture, mode="last", normalize=False, labels=("yes",), activation="sigmoid")
    spec = dataclasses.replace(_embedding(architecture, st, False, "mean"), embedding_size=_hidden_size(config))
    if (dimensions := getattr(config, "matryoshka_dimensions", None)) is not None:  # vLLM's config field
        spec = dataclasses.replace(spec, matryoshka_dimensions=tuple(int(d) for d in dimensions))
    if task == "embed" or runner == "pooling":
        return spec
    return PoolingSpec("generate", architecture, **{k: getattr(spec, k) for k in _POOLING_FIELDS})


_POOLING_FIELDS = (
    "mode", "normalize", "include_prompt", "prompts", "default_prompt_name", "matryoshka_dimensions", "embedding_size"
)  # fmt: skip


def _hidden_size(config: Any) -> int | None:
    size = getattr(config.get_text_config(), "hidden_size", None)
    return None if size is None else int(size)


def _embedding(architecture: str, st: dict[str, Any] | None, encoder: bool, default: PoolingMode) -> PoolingSpec:
    """An embedding model's pooling: its sentence-transformers config's, else ``default`` and L2-normalized."""
    if st is None:
        return PoolingSpec("embed", architecture, encoder, default, True)
    return PoolingSpec("embed", architecture, encoder, **st)


def _read_st(path: str, revision: str | None) -> dict[str, Any] | None:
    """The pooling a sentence-transformers checkpoint declares, or ``None`` where it has no ``modules.json``."""
    modules = _json(path, "modules.json", revision)
    if modules is None:
        return None
    names = [str(module.get("type", "")).rsplit(".", 1)[-1] for module in modules]
    if other := [name for name in names if name not in ST_MODULES]:
        raise ModelNotSupported(
            "SentenceTransformer", f"its modules.json has {other[0]!r} (batchgen runs {', '.join(ST_MODULES)})"
        )
    transformer: dict[str, Any] = next(
        (module for module, name in zip(modules, names, strict=True) if name == "Transformer"), {}
    )
    prefix = f"{transformer.get('path') or ''}/".lstrip("/")
    if "message" in ((_json(path, f"{prefix}sentence_bert_config.json", revision) or {}).get("modality_config") or {}):
        raise ModelNotSupported(
            "SentenceTransformer",
            "its Transformer module renders texts through the chat template (sentence-transformers' 'message' "
            "modality); batchgen embeds plain texts",
        )
    mode: PoolingMode = "mean"
    include_prompt = True
    pooling = next((module for module, name in zip(modules, names, strict=True) if name == "Pooling"), None)
    if pooling is not None:
        settings = _json(path, f"{pooling.get('path', '1_Pooling')}/config.json", revision) or {}
        mode = _st_pooling_mode(settings)
        include_prompt = bool(settings.get("include_prompt", True))
    st_config = _json(path, "config_sentence_transformers.json", revision) or {}
    prompts = {str(k): str(v) for k, v in (st_config.get("prompts") or {}).items()}
    return {
        "mode": mode,
        "normalize": "Normalize" in names,
        "include_prompt": include_prompt,
        "prompts": prompts,
        "default_prompt_name": st_config.get("default_prompt_name") or None,
    }


def _st_pooling_mode(settings: dict[str, Any]) -> PoolingMode:
    modes = settings.get("pooling_mode")
    if modes is None:
        modes = [mode for key, mode in ST_LEGACY_KEYS.items() if settings.get(key)]
        modes += [key for key in ST_OTHER_KEYS if settings.get(key)]
        modes = modes or ["mean"]
    if isinstance(modes, str):
        modes = [modes]
    if len(modes) != 1 or modes[0] not in ST_POOLING:
        raise ModelNotSupported(
            "SentenceTransformer", f"its pooling {'+'.join(map(str, modes))} (batchgen pools by mean, cls or lasttoken)"
        )
    mode: PoolingMode = ST_POOLING[modes[0]]  # type: ignore[assignment]
    return mode


def _json(path: str, name: str, revision: str | None) -> Any:
    from transformers.utils.hub import cached_file

    try:
        found = cached_file(path, name, revision=revision, _raise_exceptions_for_missing_entries=False)
    except OSError:
        return None
    if found is None:
        return None
    with open(found, encoding="utf-8") as file:
        return json.load(file)


def _one_label(config: Any) -> bool:
    return int(getattr(config, "num_labels", 0)) == 1


def _labels(config: Any) -> tuple[str, ...]:
    id2label = getattr(config, "id2label", None) or {}
    return tuple(str(id2label.get(i, f"LABEL_{i}")) for i in range(int(config.num_labels)))


def _activation(config: Any, labels: tuple[str, ...]) -> Literal["sigmoid", "softmax", "identity"]:
    """A score's: sentence-transformers' CrossEncoder's (its config's ``activation_fn``, else sigmoid for one label);
    ``/classify`` always reports softmax probabilities over several labels."""
    declared = (getattr(config, "sentence_transformers", None) or {}).get("activation_fn")
    if len(labels) > 1:
        return "softmax"
    if declared is not None and declared.endswith("Identity"):
        return "identity"
    return "sigmoid"
