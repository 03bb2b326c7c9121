"""The model runner (vLLM v1's GPU model runner): owns the model, its paged KV cache, the batch state (the running
sequences' sampling rows) and the LoRA slots; turns the scheduler's step into its inputs, one packed forward (or a
CUDA graph replay) and the sampler's draws, launched on the device."""

from __future__ import annotations

import dataclasses
import inspect
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from transformers import PreTrainedModel

from ..attention import (
    AttentionBackend,
    LayerProbe,
    PagedStep,
    Selections,
    active,
    dsa,
    make_backend,
)
from ..attention.kv_cache import KVCache, LayerShape
from ..config import EngineConfig
from ..errors import ModelLoadError, ModelNotSupported
from ..features.adapters import LoRARequest
from ..features.lora import LoRASlots, build_slots, detach
from ..features.multimodal.vision_step import (
    NO_EXTRA,
    StepImages,
    VisionStep,
    both_ways_refused,
    vision_step_for,
)
from ..features.state.discovery import StateLayer
from ..features.state.heads import split_state_heads
from ..features.state.runtime import States
from ..loading.loader import model_weight
from ..loading.quantization import kv_cache_dtype
from ..loading.split import split_state_problem
from ..ops.fast_forward import FastForward
from ..ops.fast_paths import FastPath
from ..ops.transfer import indices
from ..sampling.batch_state import BatchState
from ..sampling.grammar import GrammarCompiler, MaskFill
from ..sampling.prompt_logprobs import PromptLogprobs
from ..sampling.sampler import Sampler
from ..scheduler_output import ScheduledSeq, SchedulerOutput
from .capacity import CacheSizes, cache_sizes
from .collectives import smallest_across_ranks
from .cuda_graphs import CudaGraph, DecodeGraphs, batch_buckets
from .inputs import InputBuffers, PackedInputs
from .launched import Launched
from .probing import ModelProbe
from .profile import cache_budget, peak_bytes
from .stages import stages_of

EAGER_BELOW_PARAMETERS = 10_000_000
"""Smaller models run eagerly whatever the config: compiling costs seconds, and their steps gain nothing from it."""


def uses_graphs(compiled: bool, device: torch.device, config: EngineConfig) -> bool:
    """CUDA graphs for decode steps: on a single CUDA device, unless everything runs eagerly."""
    return compiled and device.type == "cuda" and config.device_map is None


class StepMirror(Protocol):
    """The driver's side of a tensor-parallel group (``distributed/group.py``): every forward the driver runs, the
    other ranks run too, on their shards."""

    @property
    def broken(self) -> bool:
        """A rank died or a mirrored forward failed: the group must be started again (``restarted``)."""
        ...

    def send_step(
        self,
        packed: PackedInputs,
        sample_rows: list[int],
        want_hidden: bool,
        adapter_slots: list[int] | None = None,
        images: StepImages | None = None,
    ) -> None: ...

    def send_reference(self, tokens: torch.Tensor, adapter: LoRARequest | None = None) -> None: ...

    def send_adapter(self, slot: int, adapter: LoRARequest) -> None: ...

    def send_copy_block(self, src: int, dst: int) -> None: ...

    def send_copy_state(self, src: int, dst: int) -> None: ...

    def failed(self, exc: BaseException) -> Exception:
        """The group is broken by ``exc`` (raised within a mirrored forward): the ``GroupFailed`` to raise."""
        ...

    def stop(self) -> None:
        """Stop the other ranks and leave the process group (another may start in this process)."""
        ...

    def restarted(self, grammars: GrammarCompiler) -> ModelRunner:
        """Every rank started again, its shard loaded: the driver's new runner."""
        ...


@dataclass(slots=True)
class StepOutput:
    hidden: torch.Tensor | None
    """Last hidden state of every packed token ``[tokens, hidden]``, when asked for (embeddings)."""
    logits: torch.Tensor
    """Logits of the sampled rows only, ``[sampled, vocab]``, in the model's dtype (the sampler makes them float32),
    as the model's own head makes them (its scaling and soft-capping included)."""


class ModelRunner:
    pooling_only: bool
    """Every step only pools: the base model's forward (no LM or classifier head: the pooler applies one on the
    pooled rows), which any ``*Model``, ``*ForCausalLM`` or ``*ForSequenceClassification`` has."""
    grammars: GrammarCompiler
    """Fills the constrained rows' token masks while the forward runs."""
    stages: Any
    """A pipeline stage's forward (``runner/stages.py``): the model's calls run its layers alone."""
    probed: LayerProbe
    """Its attention layers as the probe found them."""
    step_bytes = 0
    """The largest step's peak, measured where a budget sizes the caches (``profile.py``)."""

    def __init__(
        self,
        model: PreTrainedModel,
        config: EngineConfig,
        grammars: GrammarCompiler,
        group: StepMirror | None = None,
        pooling_only: bool = False,
    ) -> None:
        """``group``: on the driver of a tensor-parallel group, the other ranks, which run every forward with it;
        ``pooling_only``: the model only pools, through its base model's forward."""
        # No autograd, whatever thread steps (grad mode is per thread): with trainable weights the in-place K/V writes
        # made the cache part of a graph that kept every step's activations (gigabytes per few thousand requests).
        model.requires_grad_(False)
        self.model, self.group, self.grammars, self.pooling_only = model, group, grammars, pooling_only
        self.architecture = type(model).__name__
        if not pooling_only and "logits_to_keep" not in inspect.signature(model.forward).parameters:
            raise ModelNotSupported(self.architecture, "its forward takes no `logits_to_keep`")
        self.device, self.stages, self.block_size = model_weight(model).device, stages_of(model), config.block_size
        self.split_heads = split_state_heads(model) if config.tensor_parallel_size > 1 else 0  # (each rank's state)
        self.sparse = self._sparse_layers(config)
        self.probing = ModelProbe(model, self.device, pooling_only, self._masks)
        self.probed = probe = self.probing.layers()
        state_layers, stateful = self.probing.state_layers(probe, config)
        self.vision = self._build_vision(config)
        self.compiled, graphs = self._compiled(config, stateful)
        layers = [*probe.modules, *(layer.module for layer in state_layers)]  # mixer-only layers compile too
        self.lora = self._build_lora(config, layers, graphs)  # before the caches: its slots take from their budget
        shapes = self._cache_shapes(probe.shapes, config)
        sizes = self._cache_sizes(shapes, probe.indexers, state_layers, stateful, config)
        self.num_blocks = sizes.blocks
        self.states = self._build_states(state_layers, sizes, config) if stateful else None
        # With graphs, one more block than the block manager hands out: the scratch block of padding rows.
        self.cache = KVCache(shapes, self.num_blocks + graphs, self.block_size, probe.indexers)
        self.inputs = InputBuffers(config.max_num_batched_tokens, self.block_size, self.device)
        self.graphs = self._build_fast_paths(config, layers, probe.windows, graphs)
        self.vocab_size: int = model.config.get_text_config().vocab_size
        live = self.states.slots.live if self.states is not None else config.max_num_seqs  # a running sequence's slot
        self.max_num_seqs = min(config.max_num_seqs, live)
        self.batch, self.sampler = BatchState(self.vocab_size, self.device, capacity=self.max_num_seqs), Sampler()

    def _sparse_layers(self, config: EngineConfig) -> bool:
        """DSA layers (``attention/dsa.py``) installed: their indexers run per sequence, so the model runs eagerly
        (no compiled layers, no CUDA graphs) and without LoRA slots (the indexer's projections run on parts of the
        packed row)."""
        sparse = dsa.install(self.model)
        if sparse and config.enable_lora:
            raise ModelNotSupported(self.architecture, "LoRA adapters on DSA sparse-attention layers are not served")
        self._masks: dict[str, Any] = {"attention_mask": Selections()} if sparse else {}
        return sparse

    def _cache_sizes(
        self,
        shapes: list[LayerShape],
        indexers: Any,
        state_layers: list[StateLayer],
        stateful: bool,
        config: EngineConfig,
    ) -> CacheSizes:
        """The KV blocks and state slots the budget holds; on a split model as many as the fullest rank has room
        for (each rank holds its share of the same blocks, its heads' or its stage's layers', and the same slots:
        a stage without state layers leaves their number to the stages with them)."""
        self.block_bytes = KVCache.block_bytes(shapes, self.block_size, indexers)
        budget = None if config.num_kv_blocks else self._cache_budget(config)
        context = config.max_model_len or getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        sizes = cache_sizes(budget, self.block_bytes, States.slot_bytes_of(state_layers), config, context)
        if stateful and not state_layers:
            sizes = dataclasses.replace(sizes, live_slots=config.max_num_seqs, checkpoint_slots=sizes.blocks)
        if config.world_size > 1:
            sizes = CacheSizes(*smallest_across_ranks(list(dataclasses.astuple(sizes)), self.device))
        return sizes

    def _build_states(self, layers: list[StateLayer], sizes: CacheSizes, config: EngineConfig) -> States:
        """The state layers' cache and slots (models with recurrent mixers or short convolutions; a pipeline stage
        without state layers of its own keeps the slots' books, which the stages with them follow)."""
        if config.state_checkpoint_interval % self.block_size:
            raise ModelLoadError("--state-checkpoint-interval must be a multiple of --block-size")
        if config.world_size > 1 and (problem := split_state_problem(self.model, layers, config)):
            raise ModelNotSupported(self.architecture, problem)
        states = States(
            layers, sizes.live_slots, sizes.checkpoint_slots, self.block_size, config.state_checkpoint_interval
        )
        if self.group is not None:  # every rank holds a slot's share of its stage's state: copied there when here
            states.slots.copy = self._copy_state
        if self.lora is not None:  # a state layer's own forward runs on some of the rows: their slots
            states.mixers.token_rows = self.lora
        return states

    def _build_vision(self, config: EngineConfig) -> VisionStep | None:
        """A vision-language model's vision step (``features/multimodal/``): its steps may run on embeddings."""
        vision = vision_step_for(self.model, config.encoder_cache_mib * 2**20)
        if vision is not None and vision.family.bidirectional:
            both_ways_refused(self.architecture, config)
        return vision

    def _compiled(self, config: EngineConfig, stateful: bool) -> tuple[bool, bool]:
        """Whether the layers are compiled, and decode steps run as CUDA graphs (``stateful``: it has state
        layers)."""
        # A split model runs eagerly: its collectives sit between the layers' ops, and every rank must run alike.
        big = self.model.num_parameters() >= EAGER_BELOW_PARAMETERS
        compiled = not config.enforce_eager and big and not self.sparse and config.world_size == 1
        # No decode graphs with state layers yet: their mixers run per call from Python lists of rows and slots. Nor
        # for vision-language models: graphs replay a decode's token ids and plain positions, M-RoPE's are not those.
        # Nor for pooling models, which never decode.
        special = stateful or self.vision is not None or self.pooling_only
        return compiled, uses_graphs(compiled, self.device, config) and not special

    def _build_fast_paths(
        self, config: EngineConfig, layers: list[torch.nn.Module], windows: Any, graphs: bool
    ) -> DecodeGraphs | None:
        """The attention backends, the compiled layers, the CUDA graphs of decode steps: its fast paths
        (``ops/fast_paths.py``; none for a model that runs eagerly); returns the graphs."""
        # The eager retry's attention: what any device runs without compiling (eager flex is a dense reference over
        # the whole cache, far too large for a real one).
        self.eager_backend = make_backend("gather", self.device, compiled=False)
        self.backend = self.eager_backend
        if self.compiled or config.attention_backend == "flex":
            self.backend = make_backend(config.attention_backend, self.device, self.compiled)
        self.fast = FastForward(self.model, layers, on_off=self._eager_from_now_on) if self.compiled else None
        decode_graphs = None
        if graphs:
            decode_graphs = DecodeGraphs(
                self.model, self.cache, self.num_blocks, windows, config.max_num_seqs, CudaGraph.maker()
            )
        self.graph_path = FastPath("CUDA graphs")
        self.paths: list[FastPath] = [
            *(self.fast.paths if self.fast else []),
            *self.backend.paths,
            *([self.graph_path] if decode_graphs else []),
            *(self.states.mixers.paths if self.states else []),
        ]
        return decode_graphs

    def _build_lora(self, config: EngineConfig, layers: list[torch.nn.Module], graphs: bool) -> LoRASlots | None:
        """The LoRA adapters' slots over the layers' linears (``features/lora.py``), with LoRA on."""
        if not config.enable_lora:
            detach(self.model)  # an earlier engine's slots, on a model shared with it
            return None
        lora = build_slots(self.model, layers, batch_buckets(config.max_num_seqs)[-1] if graphs else 0, config)
        lora.find_unreached(self.probing.forward)
        if self.group is not None:  # the other ranks copy each adapter into the same slot, and run with the same mask
            lora.on_load = self.group.send_adapter
        return lora

    @property
    def windows(self) -> set[int | None]:
        """The layers' sliding windows (``None``: full attention), which the self-check reaches past."""
        return self.probed.windows

    @property
    def seats(self) -> list[LoRASlots]:
        """What a running sequence of this runner holds besides its blocks (the scheduler's ``Seats``)."""
        return [self.lora] if self.lora is not None else []

    def _cache_shapes(self, shapes: list[LayerShape], config: EngineConfig) -> list[LayerShape]:
        """The probed layers' K/V shapes, in ``--kv-cache-dtype``'s dtype where it names one (the attention reads a
        16-bit cache into the query's dtype)."""
        dtype = kv_cache_dtype(config.kv_cache_dtype, self.device)
        if dtype is None:
            return shapes
        if config.attention_backend == "flex":  # it reads the cache in place, in the query's dtype
            raise ModelLoadError(f"--kv-cache-dtype {config.kv_cache_dtype} needs --attention-backend gather")
        return [dataclasses.replace(shape, dtype=dtype) for shape in shapes]

    def _cache_budget(self, config: EngineConfig) -> float:
        """The bytes the caches may take (the KV blocks and, with state layers, the state slots): what is left once
        the largest step has run, measured (``profile.py``), beside the LoRA slots (allocated already) and the
        encoder cache's reservation."""
        self.step_bytes = peak_bytes(lambda: self.probing.largest_step(config), self.device)
        reserved = config.encoder_cache_mib * 2**20 if self.vision is not None else 0
        return cache_budget(config, self.device, self.step_bytes, reserved)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache's dtype (a model without attention layers: its own, which its state is in)."""
        return self.cache.k[0].dtype if self.cache.k else model_weight(self.model).dtype

    def copy_block(self, src: int, dst: int) -> None:
        """Block ``src``'s K/V into ``dst`` (a fork's partly filled block), on every rank of a group."""
        if self.group is not None:
            self.group.send_copy_block(src, dst)
        self.cache.copy_block(src, dst)

    def _copy_state(self, src: int, dst: int) -> None:
        assert self.group is not None and self.states is not None
        self.group.send_copy_state(src, dst)
        self.states.cache.copy_slot(src, dst)

    def reset(self) -> None:
        """No sequence runs (the engine reset): a fresh batch state."""
        self.batch = BatchState(self.vocab_size, self.device, capacity=self.max_num_seqs)

    def update_states(self, output: SchedulerOutput) -> None:
        """The batch state follows the sequences the scheduler started and stopped since the last step."""
        self.batch.update(output.started, output.stopped)

    def execute(
        self, scheduled: list[ScheduledSeq], block_tables: np.ndarray, previous: Launched | None = None
    ) -> Launched:
        """Prepare the step's inputs (its sequences' blocks in ``block_tables``: ``block_tables.py``; ``previous``:
        the step in flight, whose tokens the host has not read), run its forward and sample it, leaving it on the
        device. The only state it changes is the penalised rows' counts catching up with tokens already committed,
        so a step computed again (the engine's fault isolation) reads what the first attempt read."""
        slot_of = self.lora.slot_of if self.lora is not None else None
        step = self.inputs.prepare(scheduled, block_tables, self.batch, previous, slot_of)
        if self.states is not None:
            step.packed = dataclasses.replace(step.packed, states=self.states.step(scheduled, step.packed.seqs))
        if self.lora is not None:  # each token runs with its sequence's adapter slot
            self.lora.prepare(step.adapter_slots)
        masks = None
        if step.matchers:  # the constrained rows' masks are filled while the forward runs
            masks = MaskFill(self.grammars, step.matchers, np.array(step.owners, dtype=np.int64), self.device)
        images = self.vision.gather(scheduled) if self.vision is not None else None
        output = self.forward(step.packed, step.sample_rows, step.want_hidden, images)
        launched = step.launched
        launched.hidden = output.hidden
        if step.spans:
            launched.prompt = PromptLogprobs(output.logits, step.prompt_index, step.spans)
        if step.sampling is not None:
            if masks is not None:
                step.sampling.masks = np.array(step.constrained, dtype=np.int64), masks.result()
            logits = output.logits
            if not step.direct:  # prompt rows kept, or a completed prompt feeds its n choices from one row
                logits = logits[indices(step.logits_rows, logits.device)]
            launched.sampled = self.sampler.launch(logits, step.sampling)
        return launched

    @torch.no_grad()
    def forward(
        self, packed: PackedInputs, sample_rows: list[int], want_hidden: bool, images: StepImages | None = None
    ) -> StepOutput:
        """Run the packed step in one forward; logits at ``sample_rows`` only; the last hidden state of every token if
        ``want_hidden`` (embeddings).

        A step of decodes alone, each sampled, replays a CUDA graph where there are graphs and a bucket holds it
        (n > 1 forks may outgrow the largest); any other step runs the model, its layers compiled where they are. The
        graphs and the compiled forward are fast paths (``fast_paths.py``): the eager forward serves where one
        fails, and that path is off for good; if the eager forward fails too, the fault is the inputs', and the
        engine's own fault isolation deals with it."""
        if self.group is not None:  # every rank runs it; any failure leaves the ranks out of step
            try:
                slots = self.lora.token_slots if self.lora else None
                self.group.send_step(packed, sample_rows, want_hidden, slots, images)
                return self._forward(packed, sample_rows, want_hidden, images)
            except Exception as exc:
                raise self.group.failed(exc) from exc
        graphs = self.graphs
        eager = lambda: self._eager_forward(packed, sample_rows, want_hidden, images)  # noqa: E731
        # A graph returns every row's logits: only for steps where every row is sampled (not a 1-token prefill chunk).
        if (
            graphs is not None
            and self.graph_path.on
            and packed.all_decodes
            and not want_hidden
            and len(sample_rows) == len(packed.seqs)
            and len(packed.seqs) <= graphs.buckets[-1]
        ):
            return self.graph_path.run(lambda: StepOutput(None, graphs.run(packed)), eager)
        if self.fast is not None:  # state layers advance in place: a failed step is computed again from scratch
            fast = lambda: self._forward(packed, sample_rows, want_hidden, images)  # noqa: E731
            return self.fast.paths[0].run(fast, eager, retry=self.states is None)
        return self._forward(packed, sample_rows, want_hidden, images)

    def _eager_from_now_on(self, reason: str) -> None:
        """The compiled forward failed where the eager one served: the model's own forwards, eager attention."""
        assert self.fast is not None
        self.fast.revert(reason)
        self.fast = None
        for path in self.backend.paths:
            path.switch_off(f"with the compiled forward ({reason})")
        self.backend = self.eager_backend

    def _eager_forward(
        self, packed: PackedInputs, sample_rows: list[int], want_hidden: bool, images: StepImages | None
    ) -> StepOutput:
        with torch.compiler.set_stance("force_eager"), self.fast.off() if self.fast else nullcontext():
            return self._forward(packed, sample_rows, want_hidden, images, self.eager_backend)

    def _forward(
        self,
        packed: PackedInputs,
        sample_rows: list[int],
        want_hidden: bool,
        images: StepImages | None = None,
        backend: AttentionBackend | None = None,
    ) -> StepOutput:
        step = PagedStep(
            self.cache, backend or self.backend, packed.seqs, packed.block_tables, packed.slots, self.device,
            packed.states, spans_on_sliding_only=self.vision is not None and self.vision.family.sliding_only,
        )  # fmt: skip
        if packed.states is not None:
            packed.states.layers_run = 0
        if self.pooling_only:
            return self._pool_forward(step, packed)
        every_row = len(sample_rows) == packed.input_ids.shape[0]
        keep = 0 if every_row else indices(sample_rows, self.device)  # 0: all
        hidden: list[torch.Tensor] = []

        def keep_hidden(module: torch.nn.Module, args: Any, output: Any) -> None:
            hidden.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

        # The base model's output, for embeddings: the model's forward returns only the logits asked for. The hook
        # lives for this forward only (the model may be shared with other engines).
        handle = self.model.base_model.register_forward_hook(keep_hidden) if want_hidden else None
        extra = None
        if images is not None and self.vision is not None:  # every rank: the embeddings are looked up together
            extra = self.vision.assemble(images, packed.input_ids)
        try:
            with active(step), (extra or NO_EXTRA).around(self.model):
                # A vision-language step with images runs on embeddings (their rows in place: ``multimodal/``).
                tokens: dict[str, torch.Tensor] = {"input_ids": packed.input_ids.unsqueeze(0)}
                positions = packed.positions.unsqueeze(0)
                if extra is not None:
                    if extra.embeds is not None:
                        tokens = {"inputs_embeds": extra.embeds}
                    if extra.positions is not None:
                        positions = extra.positions
                out = self.model(**tokens, position_ids=positions, use_cache=False, logits_to_keep=keep, **self._masks)
        finally:
            if handle is not None:
                handle.remove()
        if hidden and self.stages is not None:  # the last stage's, on every stage
            hidden = [self.stages.from_last(hidden[0])]
        if step.layers_attended != len(self.cache.k):
            raise RuntimeError(f"the forward ran {step.layers_attended} attention layers, not {len(self.cache.k)}")
        ran, states = packed.states, self.states
        if states is not None and ran is not None and ran.layers_run != len(states.layers):
            raise RuntimeError(f"the forward ran {ran.layers_run} state layers, not {len(states.layers)}")
        return StepOutput(hidden[0][0] if hidden else None, out.logits[0])

    def _pool_forward(self, step: PagedStep, packed: PackedInputs) -> StepOutput:
        """The base model alone: every packed token's last hidden state, no logits."""
        with active(step):
            out = self.model.base_model(
                input_ids=packed.input_ids.unsqueeze(0), position_ids=packed.positions.unsqueeze(0), use_cache=False
            )
        if step.layers_attended != len(self.cache.k):
            raise RuntimeError(f"the forward ran {step.layers_attended} attention layers, not {len(self.cache.k)}")
        hidden = out.last_hidden_state[0]
        return StepOutput(hidden, hidden.new_empty((0, self.vocab_size)))
