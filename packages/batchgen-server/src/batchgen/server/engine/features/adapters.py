"""LoRA adapters by name, without torch (the API, run-batch and the replicas' parent use it): the ``--lora-modules``
spellings, what an adapter's ``adapter_config.json`` asks of the engine (refused by name where the engine cannot
apply it exactly), and the names served beside the base model.

A request for an adapter carries a ``LoRARequest`` (its name, directory and salt) to the engine, which reads the
weights itself (``lora.py``): the same request runs on any replica, and the server process never loads weights.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import threading
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ModelLoadError

if TYPE_CHECKING:
    from ..config import EngineConfig

WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
MAX_NAME_CHARS = 128


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name an adapter (``None``: it can). A name is what requests' ``model`` says and what
    every tenant's ``/v1/models`` lists: printable, no spaces, slashes only between parts (``org/adapter``)."""
    if not 1 <= len(name) <= MAX_NAME_CHARS:
        return f"an adapter's name has 1 to {MAX_NAME_CHARS} characters, not {len(name)}"
    if any(unicodedata.category(char)[0] in "CZ" for char in name):
        return "an adapter's name has no spaces, control or invisible (bidi) characters"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "an adapter's name has no empty, '.' or '..' part between slashes"
    return None


class AdapterRefused(ValueError):
    """An adapter the engine cannot serve exactly; the message names the adapter and what it asks for."""


@dataclass(frozen=True, slots=True)
class LoRARequest:
    name: str
    path: str
    salt: int
    """Tells this adapter's cached KV blocks (``block_manager.py``) and weights (``lora.py``) from the base's and every
    other adapter's: derived from its name, its directory and its weights file's size and time, so every process
    (the server, the engine, each replica) names the same adapter alike, and one loaded again from other files gets
    another (``adapter_salt``)."""


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One ``--lora-modules`` entry: ``name=path``, or vLLM's JSON ``{"name", "path", "base_model_name"}``."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoRAModule:
        text = text.strip()
        if text.startswith("{"):
            try:
                spec = json.loads(text)
                return cls(str(spec["name"]), str(spec["path"]), spec.get("base_model_name"))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {text!r}: the JSON form needs 'name' and 'path'") from None
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {text!r}: use name=path or JSON with 'name' and 'path'")
        return cls(name, path)

    def __post_init__(self) -> None:
        if (problem := name_problem(self.name)) is not None:
            raise ValueError(f"--lora-modules {self.name[:MAX_NAME_CHARS]!r}: {problem}")


MAX_HEADER_BYTES = 100 * 2**20
"""safetensors' own limit on a header's size."""
SAFETENSORS_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
"""The dtypes an adapter's matrices may have, with their sizes in bytes."""


def adapter_config(name: str, path: str | Path, max_rank: int) -> dict[str, Any]:
    """The adapter's ``adapter_config.json``, once checked: a PEFT LoRA whose every part the engine applies exactly
    (plain LoRA on linear layers, ``lora_alpha`` scaling or rsLoRA, rank within ``--max-lora-rank``), whose weights'
    header (safetensors) names matching A and B matrices of its ranks; raises ``AdapterRefused`` naming what it is
    not. A path with no readable adapter is refused in the same words whatever is there (a file, nothing): the
    answer tells nothing of the server's files."""
    directory = Path(path)
    try:
        config = json.loads((directory / "adapter_config.json").read_text())
    except (OSError, ValueError):
        raise AdapterRefused(f"LoRA adapter {name!r}: no PEFT LoRA adapter can be read at that path") from None

    def refuse(why: str) -> AdapterRefused:
        return AdapterRefused(f"LoRA adapter {name!r} cannot be served: {why}")

    if not isinstance(config, dict):
        raise refuse("its adapter_config.json is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(f"it is a {config.get('peft_type')} adapter, not LoRA")
    if config.get("use_dora"):
        raise refuse("it uses DoRA (use_dora), which the engine does not apply")
    if config.get("modules_to_save"):
        raise refuse(f"it replaces whole modules (modules_to_save: {config['modules_to_save']})")
    if config.get("bias", "none") != "none":
        raise refuse(f"it trains biases (bias: {config['bias']!r})")
    if config.get("fan_in_fan_out"):
        raise refuse("it targets Conv1D layers (fan_in_fan_out)")
    if config.get("trainable_token_indices"):
        raise refuse("it trains token embeddings (trainable_token_indices)")
    if config.get("target_parameters"):  # peft's LoRA on a module's weights (MoE experts'), not on a linear
        raise refuse(f"it adapts weights directly (target_parameters: {config['target_parameters']})")
    if config.get("lora_bias"):
        raise refuse("it has a LoRA bias (lora_bias)")
    rank = _number(config, "r", 8, refuse, rank=True)
    _number(config, "lora_alpha", 8, refuse)
    ranks = _pattern_of(config, "rank_pattern", refuse, rank=True)
    _pattern_of(config, "alpha_pattern", refuse)
    if max([rank, *ranks.values()]) > max_rank:
        raise refuse(f"its rank {max([rank, *ranks.values()])} is above --max-lora-rank {max_rank}")
    shapes = _weight_shapes(directory, refuse)
    if shapes is None:
        raise AdapterRefused(f"LoRA adapter {name!r}: its directory holds no {' or '.join(WEIGHT_FILES)}")
    if embedding := next((key for key in shapes if "lora_embedding" in key), None):
        raise refuse(f"it adapts an embedding ({embedding})")
    for key, shape in shapes.items():
        if ".lora_A." not in key and ".lora_B." not in key:
            raise refuse(f"it holds weights other than LoRA's A and B matrices ({key})")
        twin = key.replace(".lora_A.", ".lora_B.") if ".lora_A." in key else key.replace(".lora_B.", ".lora_A.")
        if twin not in shapes:
            raise refuse(f"it has {key} but no {twin}")
        if ".lora_A." in key:
            module = key.split(".lora_A.")[0]
            if len(shape) > 2:  # peft's LoRA on a Conv1d/Conv2d: its A is a convolution (a state layer's, say)
                raise refuse(f"it adapts a convolution ({module}); the engine applies LoRA to linear layers only")
            r = next((v for k, v in ranks.items() if module == k or module.endswith("." + k)), rank)
            if len(shape) != 2 or len(shapes[twin]) != 2 or shape[0] != r or shapes[twin][1] != r:
                raise refuse(f"{module} has A {shape} and B {shapes[twin]}: not the matrices of a rank-{r} LoRA")
    return dict(config)


def _number(config: dict[str, Any], key: str, default: int, refuse: Any, *, rank: bool = False) -> Any:
    """``config[key]``: a positive whole number for a rank, a finite number for a scale."""
    value = config.get(key, default)
    if rank:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise refuse(f"its {key} is {value!r}, not a positive whole number")
    elif isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise refuse(f"its {key} is {value!r}, not a finite number")
    return value


def _pattern_of(config: dict[str, Any], key: str, refuse: Any, *, rank: bool = False) -> dict[str, Any]:
    """PEFT's per-module overrides (``rank_pattern``, ``alpha_pattern``): module name -> number."""
    pattern = config.get(key) or {}
    if not isinstance(pattern, dict):
        raise refuse(f"its {key} is not an object")
    for module in pattern:
        _number(pattern, module, 0, refuse, rank=rank)
    return pattern


def _weight_shapes(directory: Path, refuse: Any) -> dict[str, list[int]] | None:
    """The shape of each of the adapter's weights, by name, from the safetensors header (nothing loaded; every
    entry checked against the file's size and its dtype); ``{}`` for a pickled ``.bin`` (checked when the engine
    loads it); ``None`` if it has none."""
    file = directory / WEIGHT_FILES[0]
    if not file.is_file():
        return {} if (directory / WEIGHT_FILES[1]).is_file() else None
    try:
        with file.open("rb") as stream:
            size = file.stat().st_size
            head = stream.read(8)
            (header_size,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
            if not 0 < header_size <= min(MAX_HEADER_BYTES, size - 8):
                raise refuse(f"{WEIGHT_FILES[0]} is not a safetensors file (a header of {header_size} bytes)")
            header = json.loads(stream.read(header_size))
    except OSError:
        raise refuse(f"{WEIGHT_FILES[0]} cannot be read") from None
    except ValueError:
        raise refuse(f"{WEIGHT_FILES[0]} has a header that is not JSON") from None
    if not isinstance(header, dict):
        raise refuse(f"{WEIGHT_FILES[0]} has a header that is not a JSON object")
    data = size - 8 - header_size
    shapes: dict[str, list[int]] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            numel = math.prod(shape) if all(isinstance(n, int) and n >= 0 for n in shape) else -1
            valid = dtype in SAFETENSORS_DTYPES and 0 <= begin <= end <= data
            valid = valid and numel >= 0 and end - begin == numel * SAFETENSORS_DTYPES[dtype]
        except (KeyError, TypeError, ValueError):
            valid = False
        if not valid:
            raise refuse(f"{WEIGHT_FILES[0]}'s entry {key} is not a float matrix within the file")
        shapes[key] = list(shape)
    return shapes


def lora_names(config: EngineConfig) -> tuple[str, ...]:
    """The names of the LoRA adapters served from the start (``--lora-modules``), their directories not read."""
    return tuple(LoRAModule.parse(text).name for text in config.lora_modules) if config.enable_lora else ()


def adapter_salt(name: str, directory: Path) -> int:
    """A 63-bit number from the adapter's name, directory and weights file (size and modification time)."""
    stamp = ""
    for weights in WEIGHT_FILES:
        if (file := directory / weights).is_file():
            info = file.stat()
            stamp = f"{weights}:{info.st_size}:{info.st_mtime_ns}"
            break
    digest = hashlib.sha256(f"{name}\0{directory}\0{stamp}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1 or 1


class Adapters:
    """The adapters served beside the base model, by name (thread-safe: the API loads and unloads at run time)."""

    def __init__(self, base: str, max_rank: int, modules: tuple[str, ...] = ()) -> None:
        self.base = base
        """The base model's id: each adapter's ``parent`` in ``/v1/models``."""
        self.max_rank = max_rank
        self._lock = threading.Lock()
        self._served: dict[str, LoRARequest] = {}
        for text in modules:
            module = LoRAModule.parse(text)
            self.add(module.name, module.path)

    @classmethod
    def of(cls, config: EngineConfig) -> Adapters:
        """The adapters ``--lora-modules`` serves; one that cannot be served is a ``ModelLoadError`` (one line at
        start-up, not a traceback)."""
        try:
            return cls(config.served_model_names[0], config.max_lora_rank, config.lora_modules)
        except ValueError as exc:  # AdapterRefused, a malformed entry
            raise ModelLoadError(f"--lora-modules: {exc}") from None

    def add(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter in ``path`` as ``name`` (its config checked: ``AdapterRefused``); ``ValueError`` if the
        name is taken."""
        adapter_config(name, path, self.max_rank)
        with self._lock:
            if name in self._served or name == self.base:
                raise ValueError(f"the name {name!r} is already served; unload it first")
            resolved = Path(path).resolve()
            request = self._served[name] = LoRARequest(name, str(resolved), adapter_salt(name, resolved))
        return request

    def remove(self, name: str) -> bool:
        with self._lock:
            return self._served.pop(name, None) is not None

    def get(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._served.get(name)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._served)

    def served(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._served.values())


class ServedNames:
    """Every name a request may use: the base model's, and its adapters' (a batch may mix them, as one model)."""

    def __init__(self, model_names: tuple[str, ...], adapters: Adapters | None) -> None:
        self.model_names, self.adapters = model_names, adapters

    def __contains__(self, name: object) -> bool:
        return name in self.model_names or (
            isinstance(name, str) and self.adapters is not None and self.adapters.get(name) is not None
        )
