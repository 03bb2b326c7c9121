"""The serving layer as its callers hold it (the batch loop, run-batch, the online endpoints): built for the served
model, it prepares request bodies into engine requests (``preparing``) and answers them from their results
(``answers``); a stream says those results as events (``streaming``, ``response_stream``) with its ``logprobs``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from batchgen.schemas import BatchOutputLine, RequestBody

from ..engine.features.adapters import Adapters, ServedNames
from ..engine.loading.pooling_spec import Kind, PoolingSpec
from ..engine.request import EngineResult, Task
from ..media.fetcher import Fetched
from .answers import Answers, ResponseBody
from .config import ServingConfig
from .images import ImagePrompter, image_processor_for, media_of
from .logprobs import LogprobFormatter
from .preparing import PreparedRequest, RequestPreparer
from .sampling import BatchDefaults
from .structured import set_grammar_timeout

if TYPE_CHECKING:
    from concurrent.futures import Future

    from ..engine.config import EngineConfig
    from ..engine.interface import ServedModel

DEFAULT_MAX_SEQUENCES = 256


class OpenAIServing:
    def __init__(
        self,
        tokenizer: Any,
        model_names: tuple[str, ...],
        max_context_length: int,
        vocab_size: int,
        tasks: frozenset[Task] = frozenset({"generate", "embed"}),
        max_sequences: int = DEFAULT_MAX_SEQUENCES,
        generation_defaults: Mapping[str, Any] | None = None,
        config: ServingConfig = ServingConfig(),  # noqa: B008 (frozen)
        adapters: Adapters | None = None,
        images: ImagePrompter | None = None,
        spec: PoolingSpec | None = None,
    ) -> None:
        """``spec``: what the model is served as besides a generator (``pooling_spec.py``); by default a causal LM
        that embeds by the mean, or an encoder that only embeds."""
        if spec is None:
            kind: Kind = "generate" if "generate" in tasks else "embed"
            spec = PoolingSpec(kind, "model", encoder=kind == "embed")
        self.model_names = model_names
        """The names requests may use for the model, its id first (``--served-model-name``)."""
        self.adapters = adapters
        """The LoRA adapters served beside the model, which a request's ``model`` may name (``--lora-modules``)."""
        self.served_names = ServedNames(model_names, adapters)
        self.preparer = RequestPreparer(
            tokenizer,
            self.served_names,
            max_context_length=max_context_length,
            vocab_size=vocab_size,
            tasks=tasks,
            max_sequences=max_sequences,
            generation_defaults=dict(generation_defaults or {}),
            config=config,
            images=images,
            spec=spec,
        )
        self.logprobs = LogprobFormatter(tokenizer)
        self.answers = Answers(tokenizer, self.logprobs, self.preparer.pooling)

    @classmethod
    def for_engine(
        cls,
        engine: ServedModel,
        config: EngineConfig,
        serving: ServingConfig = ServingConfig(),  # noqa: B008 (frozen)
        max_sequences: int = DEFAULT_MAX_SEQUENCES,
    ) -> OpenAIServing:
        """The serving of a loaded engine: under the names ``config`` serves it by, with its generation config's
        defaults, reading chat outputs as ``serving`` says."""
        from ..engine.loading.loader import load_generation_defaults  # transformers: only once a model is loaded
        from ..engine.loading.pooling_spec import spec_of

        set_grammar_timeout(config.grammar_timeout_s)
        return cls(
            engine.tokenizer,
            config.served_model_names,
            engine.max_context_length,
            engine.vocab_size,
            engine.tasks,
            max_sequences,
            load_generation_defaults(config),
            serving,
            Adapters.of(config) if config.enable_lora else None,
            media_of(serving, image_processor_for(config, engine.tokenizer)),
            spec_of(config),
        )

    def prepare(
        self,
        body: RequestBody,
        *,
        request_id: str,
        defaults: BatchDefaults,
        online: bool = False,
        fetched: Fetched | None = None,
    ) -> PreparedRequest:
        """``body`` as engine requests, with what its answer is made from (``RequestPreparer.prepare``)."""
        return self.preparer.prepare(body, request_id=request_id, defaults=defaults, online=online, fetched=fetched)

    def fetch_images(self, body: RequestBody, owner: str) -> Future[Fetched] | None:
        """``body``'s remote images fetched, for ``owner``, off the caller's thread (``None``: it names none), to
        be handed to ``prepare``: a slow host then holds no thread that prepares requests."""
        urls = self.preparer.remote_images(body)
        return self.preparer.images.sources.fetch(urls, owner) if urls else None

    def check_endpoint(self, path: str) -> None:
        """400 ``unsupported_endpoint`` where the model serves no request to ``path`` (``RequestPreparer``)."""
        self.preparer.check_endpoint(path)

    def response_body(self, prepared: PreparedRequest, results: list[EngineResult]) -> ResponseBody:
        """The 200 body of a prepared request whose results (in the order of its engine requests) all succeeded."""
        return self.answers.response_body(prepared, results)

    def output_line(self, custom_id: str, prepared: PreparedRequest, results: list[EngineResult]) -> BatchOutputLine:
        """A batch line's output line (an error line if any result failed)."""
        return self.answers.output_line(custom_id, prepared, results)
