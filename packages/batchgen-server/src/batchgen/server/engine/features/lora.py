"""LoRA adapters applied beside the base model's weights, many in one step.

Every linear of the decoder layers gets ``--max-loras`` fixed adapter slots: its ``lora_a`` stacks the slots' A
matrices (``[slots * rank, in]``), its ``lora_b`` their B matrices with the adapter's scaling folded in (``[out,
slots * rank]``), each padded with zeros to ``--max-lora-rank`` (a smaller rank, or an adapter that does not target
this linear, adds exact zeros). A step's rows each run with one slot (0: the base alone): one ``[tokens, slots *
rank]`` mask, filled once a step, keeps each token's own slot's columns (the others are zeroed, so nothing another
adapter makes of a token reaches it), so a linear's LoRA is two small GEMMs for the whole step, whatever the mix::

    y = base(x) + where(mask[token], x @ lora_a.T, 0) @ lora_b.T

The shapes never depend on the mix, so the compiled layers and the CUDA graphs serve any mix (the mask is a static
buffer refilled before a replay), and loading an adapter into a slot is an in-place copy. The delta is a forward
hook on the linear: it adds to whatever forward the linear runs (the packed CPU linear, or its own), so the fast
paths keep their one rule (``fast_paths.py``) and step aside as before.

Slots go to the adapters of the running sequences; a sequence whose adapter finds none free waits (``scheduler.py``).
Adapters' weights stay in host memory for ``--max-cpu-loras`` adapters, least recently used evicted, read again from
their directory when needed.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ModelNotSupported
from ..ops.fast_forward import decoder_layers
from ..ops.transfer import indices
from .adapters import WEIGHT_FILES, AdapterRefused, LoRARequest, adapter_config
from .lora_split import add_inside, local, other_stages_linears, shard_adapter

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..sequence import Sequence

PEFT_PREFIX = "base_model.model."


@dataclass(slots=True)
class AdapterWeights:
    """An adapter's matrices by the module name they adapt: A ``[r, in]``, and B ``[out, r]`` times its scaling."""

    request: LoRARequest
    matrices: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter(
    request: LoRARequest,
    linears: dict[str, torch.nn.Linear],
    max_rank: int,
    unreached: frozenset[str] = frozenset(),
    elsewhere: Mapping[str, tuple[int, int]] = MappingProxyType({}),
) -> AdapterWeights:
    """The adapter in ``request.path``, checked against the model's decoder linears ``linears`` (by module name; those
    in ``unreached`` are never called as modules, so a delta there would be skipped) and those other pipeline stages
    hold (``elsewhere``: their input and output widths; checked alike, kept by their stage); raises ``AdapterRefused``
    naming what the engine cannot apply exactly, whatever is wrong with its files (the adapter fails alone: never the
    step, nor anyone else's requests)."""
    try:
        return _read_adapter(request, linears, max_rank, unreached, elsewhere)
    except AdapterRefused:
        raise
    except Exception as exc:  # a file cut short, a tensor of another kind, no memory for what a header claims
        raise AdapterRefused(
            f"LoRA adapter {request.name!r} cannot be read: {type(exc).__name__}: {str(exc)[:200]}"
        ) from None


def _read_adapter(
    request: LoRARequest,
    linears: dict[str, torch.nn.Linear],
    max_rank: int,
    unreached: frozenset[str],
    elsewhere: Mapping[str, tuple[int, int]],
) -> AdapterWeights:
    config = adapter_config(request.name, request.path, max_rank)
    directory = Path(request.path)
    if (directory / WEIGHT_FILES[0]).is_file():
        from safetensors.torch import load_file

        state = load_file(directory / WEIGHT_FILES[0])
    else:
        state = torch.load(directory / WEIGHT_FILES[1], map_location="cpu", weights_only=True)
    alpha, rank = float(config.get("lora_alpha", 8)), int(config.get("r", 8))
    alphas, ranks = dict(config.get("alpha_pattern") or {}), dict(config.get("rank_pattern") or {})
    rslora = bool(config.get("use_rslora"))

    def refuse(why: str) -> AdapterRefused:
        return AdapterRefused(f"LoRA adapter {request.name!r} cannot be served: {why}")

    matrices: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key in state:
        if ".lora_A." not in key and ".lora_B." not in key:
            raise refuse(f"it holds weights other than LoRA's A and B matrices ({key})")
        twin = key.replace(".lora_A.", ".lora_B.") if ".lora_A." in key else key.replace(".lora_B.", ".lora_A.")
        if twin not in state:
            raise refuse(f"it has {key} but no {twin}")
    model_dtype = next(iter(linears.values())).weight.dtype
    adapted = 0
    for key, a in state.items():
        if ".lora_A." not in key:
            continue
        module = key.removeprefix(PEFT_PREFIX).split(".lora_A.")[0]
        linear = linears.get(module)
        widths = (linear.in_features, linear.out_features) if linear is not None else elsewhere.get(module)
        if widths is None:
            raise refuse(f"it adapts {module!r}, which is not a linear layer of the model's decoder layers")
        if module in unreached:
            raise refuse(f"it adapts {module!r}, whose weight the model's forward reads without calling the layer")
        b = state[key.replace(".lora_A.", ".lora_B.")]
        r = _pattern(ranks, module, rank)
        if a.shape != (r, widths[0]) or b.shape != (widths[1], r):
            raise AdapterRefused(
                f"LoRA adapter {request.name!r} does not fit the model: {module} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)} for a linear of {widths[0]} -> {widths[1]} at rank {r}"
            )
        a_alpha = float(_pattern(alphas, module, alpha))
        scaling = a_alpha / (r**0.5 if rslora else r)
        dtype = linear.weight.dtype if linear is not None else model_dtype
        a, b = a.to(dtype), (b.double() * scaling).to(dtype)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):  # NaN x 0 is NaN: no mask could contain it
            raise refuse(f"its weights for {module} hold NaN or infinite values (in the model's {dtype})")
        adapted += 1
        # Checked whole, then split (a tensor-parallel rank's share; another stage's linear left to its stage):
        # every rank of a group reaches the same verdict.
        if linear is not None:
            matrices[module] = shard_adapter(linear.weight, a, b)
    if not adapted:
        raise AdapterRefused(f"LoRA adapter {request.name!r} holds no LoRA weights")
    return AdapterWeights(request, matrices)


def _pattern(pattern: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's per-module override: the entry whose key ends the module's name."""
    for key, value in pattern.items():
        if module == key or module.endswith("." + key):
            return value
    return default


def decoder_linears(model: torch.nn.Module, layers: list[torch.nn.Module]) -> dict[str, torch.nn.Linear]:
    """Every linear of the decoder layers (attention and MLP projections, fused ones included) by module name."""
    inside = {id(module) for layer in layers for module in layer.modules()}
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and id(module) in inside
    }


def whole_stacks(model: torch.nn.Module, layers: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Every layer of the ``nn.ModuleList``s that hold ``layers``: a decoder layer with neither attention nor state
    (Nemotron-H's MLP-only layers) has linears too."""
    found = {id(layer) for layer in layers}
    stacks = [module for module in model.modules() if isinstance(module, torch.nn.ModuleList)]
    return [layer for stack in stacks if any(id(child) in found for child in stack) for layer in stack] or layers


def build_slots(
    model: torch.nn.Module, mixer_modules: list[torch.nn.Module], graph_rows: int, config: EngineConfig
) -> LoRASlots:
    """The slots over ``model`` (its attention modules found by the probe and its state layers, which name its
    decoder layers; ``graph_rows``: the rows of its largest CUDA graph, if any), for ``--max-loras`` adapters of rank
    up to ``--max-lora-rank``."""
    linears = decoder_linears(model, whole_stacks(model, decoder_layers(model, mixer_modules)))
    if not linears:
        raise ModelNotSupported(type(model).__name__, "LoRA: no linear layers found in its decoder layers")
    if config.max_loras < 1 or config.max_lora_rank < 1:
        raise ValueError("--max-loras and --max-lora-rank must be at least 1")
    shape = (list(linears.values()), config.max_loras, config.max_lora_rank)
    max_tokens = max(config.max_num_batched_tokens, graph_rows)
    earlier: LoRASlots | None = vars(model).get("_batchgen_lora")
    if earlier is not None and earlier.shape == shape and earlier.off.shape[0] >= max_tokens:
        earlier.reset()  # an earlier engine's on this model, shared as its compiled layers are: none holds an adapter
        earlier.held = [None] * len(earlier.held)
        return earlier
    return LoRASlots(model, linears, *shape[1:], config.max_cpu_loras or config.max_loras, max_tokens)


def detach(model: torch.nn.Module) -> None:
    """Take an earlier engine's slots off ``model`` (an engine without LoRA on a model shared with one that had it).
    Compiled code is dropped with them: dynamo does not guard on a module's hooks."""
    earlier: LoRASlots | None = vars(model).pop("_batchgen_lora", None)
    if earlier is not None:
        earlier.remove()
        torch.compiler.reset()


class LoRASlots:
    """The adapter slots laid over a model's decoder linears (see the module's docstring), and which adapter holds
    which slot. Not thread-safe but for ``weights`` and ``read`` (``LLMEngine.prepare``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        linears: dict[str, torch.nn.Linear],
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
        max_tokens: int,
    ) -> None:
        detach(model)  # an earlier engine's, on a shared model
        self.linears = linears
        self.shape = (list(linears.values()), max_loras, max_rank)
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max(max_cpu_loras, max_loras)
        width = max_loras * max_rank
        first = local(next(iter(linears.values())).weight)
        self.device, self.dtype = first.device, first.dtype
        self.off = torch.ones(max_tokens, width, dtype=torch.bool, device=self.device)
        """Row ``t``: true over every column but token ``t``'s slot's (all of them for the base). Those columns are
        zeroed, not multiplied by 0: what another slot's adapter makes of a token (an overflow to inf, say) never
        reaches it."""
        self._columns = torch.arange(width, device=self.device) // max_rank + 1
        """The slot (from 1) of each column."""
        self.reference: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
        """While set, every token runs with these matrices (an adapter's, or none: the base), computed directly (the
        self-check's reference)."""
        self.unreached: frozenset[str] = frozenset()
        """The linears the model's forward never calls as modules (``find_unreached``): adapters on them are refused."""
        self.elsewhere = other_stages_linears(model)
        """The decoder linears other pipeline stages hold, with their widths: an adapter's matrices for them are
        checked here as there, and left to their stage."""
        self.selected: torch.Tensor | None = None
        """While a state layer's own forward runs on some of the step's rows (``rows``): those rows of the mask."""
        self._handles = []
        self._undo: list[Callable[[], None]] = []
        for name, linear in linears.items():
            weight = local(linear.weight)  # this rank's rows or columns of a split weight (its adapters' likewise)
            linear.register_buffer("lora_a", weight.new_zeros(width, weight.shape[1]), persistent=False)
            linear.register_buffer("lora_b", weight.new_zeros(weight.shape[0], width), persistent=False)
            linear.register_buffer("lora_off", self.off, persistent=False)
            linear.lora_name = name  # type: ignore[assignment]
            undo = add_inside(linear, functools.partial(self._add, linear))
            if undo is not None:  # added inside, to a split linear's local output
                self._undo.append(undo)
            else:
                self._handles.append(linear.register_forward_hook(self._hook))
        model._batchgen_lora = self  # type: ignore[assignment]
        torch.compiler.reset()  # layers compiled before (by another engine on this model) ran without the hooks
        self.held: list[LoRARequest | None] = [None] * (max_loras + 1)
        """The adapter in each slot (slot 0 is the base's)."""
        self.users = [0] * (max_loras + 1)
        """Running rows per slot."""
        self._idle: OrderedDict[int, None] = OrderedDict((slot, None) for slot in range(1, max_loras + 1))
        """Slots no row uses, least recently used first (the one a new adapter takes)."""
        self._seats: dict[Sequence, int] = {}
        """The slot each running sequence of an adapter holds."""
        self._cache: OrderedDict[tuple[str, int], AdapterWeights | AdapterRefused] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._reading: dict[tuple[str, int], threading.Lock] = {}
        """Adapters being read, each behind a lock of its own (taken under ``_cache_lock``)."""
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchgen-lora")
        self.on_load: Callable[[int, LoRARequest], None] | None = None
        """Told of each adapter copied into a slot: a tensor-parallel group's driver sends it to the other ranks,
        which copy in their own shards of it (``distributed/rank.py``)."""
        self.token_slots: list[int] = []
        """The step's tokens' slots (``prepare``), which the other ranks of a group receive with the step."""

    def find_unreached(self, forward: Callable[[], object]) -> None:
        """Run ``forward`` (a probe forward of the model) and keep the linears it never called: a layer that reads a
        linear's weight itself (Mamba's ``dt_proj`` under mamba-ssm's kernels, say) skips the hook, so an adapter on
        that linear would be served as if it were not there."""
        seen: set[str] = set()
        handles = [
            linear.register_forward_hook(lambda module, args, output, name=name: seen.add(name))
            for name, linear in self.linears.items()
        ]
        try:
            forward()
        finally:
            for handle in handles:
                handle.remove()
        self.unreached = frozenset(self.linears) - seen

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for undo in self._undo:
            undo()
        for linear in self.linears.values():
            for buffer in ("lora_a", "lora_b", "lora_off"):
                linear._buffers.pop(buffer, None)

    def _hook(self, module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        return self._add(module, args[0], output)

    def _add(self, module: torch.nn.Module, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        if self.reference is not None:
            matrices = self.reference.get(str(module.lora_name))
            if matrices is None:
                return output
            a, b = matrices
            return output + torch.nn.functional.linear(torch.nn.functional.linear(x, a), b)
        flat = x.reshape(-1, x.shape[-1])
        off = module.lora_off[: flat.shape[0]] if self.selected is None else self.selected  # type: ignore[index]
        if off.shape[0] != flat.shape[0]:  # a linear on something other than the call's tokens: no row to take
            raise RuntimeError(f"LoRA: {module.lora_name} ran on {flat.shape[0]} rows in a call on {off.shape[0]}")
        down = torch.mm(flat, module.lora_a.t()).masked_fill_(off, 0)  # type: ignore[operator]
        # The add inside the GEMM (beta 1): one call, no temporary of the output's size.
        return torch.addmm(output.reshape(-1, output.shape[-1]), down, module.lora_b.t()).view(output.shape)  # type: ignore[operator]

    # ---- adapters' weights in host memory ------------------------------------------------------------------------

    def weights(self, request: LoRARequest) -> AdapterWeights:
        """The adapter's weights, read from its directory unless among the ``--max-cpu-loras`` kept; raises
        ``AdapterRefused`` (kept too: a refused adapter's files are not read for each of its requests)."""
        key = (request.name, request.salt)
        found = self._cached(key)
        if found is None:
            with self._cache_lock:
                reading = self._reading.setdefault(key, threading.Lock())
            with reading:  # read once: a caller that comes meanwhile takes the first one's (not a second copy)
                found = self._cached(key)
                if found is None:
                    try:
                        found = read_adapter(request, self.linears, self.max_rank, self.unreached, self.elsewhere)
                    except AdapterRefused as exc:
                        found = exc
                    finally:  # read or not (its files may fail to read: the next caller tries again)
                        with self._cache_lock:
                            if found is not None:
                                self._cache[key] = found
                                while len(self._cache) > self.max_cpu_loras:
                                    self._cache.popitem(last=False)
                            # Gone already where a caller waiting on it read after it: a failed or evicted read.
                            if self._reading.get(key) is reading:
                                del self._reading[key]
        if isinstance(found, AdapterRefused):
            raise found
        return found

    def _cached(self, key: tuple[str, int]) -> AdapterWeights | AdapterRefused | None:
        with self._cache_lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
            return found

    def read(self, request: LoRARequest) -> Future[AdapterWeights]:
        """``weights``, read in a thread of its own (a request waits for it before it enters the engine)."""
        return self._reader.submit(self.weights, request)

    # ---- slots ---------------------------------------------------------------------------------------------------

    def can_take(self, seq: Sequence) -> bool:
        """Whether ``seq`` (a row of its adapter) can run now: its adapter holds a slot, or one is idle (the base:
        always). The scheduler's ``Seats``."""
        request = seq.state.request.lora
        return request is None or request in self.held or bool(self._idle)

    def take(self, seq: Sequence) -> None:
        """``seq`` runs with its adapter's slot: the one it holds, or the idle slot used least recently, its weights
        copied in (check ``can_take``); the base's slot 0 for none."""
        request = seq.state.request.lora
        if request is None:
            return
        if request in self.held:
            slot = self.held.index(request)
        else:
            slot = next(iter(self._idle))
            self.load(slot, request)
        self._idle.pop(slot, None)
        self.users[slot] += 1
        self._seats[seq] = slot

    def give_back(self, seq: Sequence) -> None:
        slot = self._seats.pop(seq, 0)
        if slot:
            self.users[slot] -= 1
            if not self.users[slot]:
                self._idle[slot] = None  # most recently used: kept loaded the longest

    def slot_of(self, seq: Sequence) -> int:
        """The slot ``seq`` runs with (0: the base)."""
        return self._seats.get(seq, 0)

    def reset(self) -> None:
        """No row runs (the engine reset): every slot idle, the adapters left in them."""
        self._seats.clear()
        self.users = [0] * len(self.users)
        self._idle = OrderedDict((slot, None) for slot in range(1, self.max_loras + 1))

    def load(self, slot: int, request: LoRARequest) -> None:
        """Copy ``request``'s adapter into ``slot`` (its weights read if they are not in host memory)."""
        self._load(slot, self.weights(request))
        self.held[slot] = request
        if self.on_load is not None:
            self.on_load(slot, request)

    @torch.no_grad()
    def _load(self, slot: int, adapter: AdapterWeights) -> None:
        columns = slice((slot - 1) * self.max_rank, slot * self.max_rank)
        for name, linear in self.linears.items():
            lora_a, lora_b = linear.lora_a, linear.lora_b
            assert isinstance(lora_a, torch.Tensor) and isinstance(lora_b, torch.Tensor)
            lora_a[columns] = 0
            lora_b[:, columns] = 0
            if (matrices := adapter.matrices.get(name)) is not None:
                a, b = matrices
                lora_a[columns.start : columns.start + a.shape[0]] = a.to(self.device)
                lora_b[:, columns.start : columns.start + b.shape[1]] = b.to(self.device)

    # ---- a step --------------------------------------------------------------------------------------------------

    def prepare(self, token_slots: list[int]) -> None:
        """The step's tokens, each with its sequence's slot: the mask's first rows (a graph's padding rows beyond
        them keep stale rows, and their outputs are dropped)."""
        self.token_slots = token_slots
        slots = indices(token_slots, self.device)
        self.off[: len(token_slots)] = slots[:, None] != self._columns[None, :]

    @contextmanager
    def rows(self, rows: torch.Tensor | slice) -> Iterator[None]:
        """The linears run on the step's ``rows`` alone (in that order) until the block ends: a state layer's own
        forward on a sequence piece or on the step's decodes (``state/mixers.py``), each token with its own slot."""
        self.selected = self.off[rows]
        try:
            yield
        finally:
            self.selected = None

    @contextmanager
    def referencing(self, adapter: AdapterWeights | None) -> Iterator[None]:
        """Every token through ``adapter`` (``None``: the base alone), computed directly (not through the slots): the
        self-check's reference."""
        self.reference = adapter.matrices if adapter is not None else {}
        try:
            yield
        finally:
            self.reference = None
