"""LoRA adapters by name, without torch (the API, run-batch and the replicas' parent use it): the ``--lora-modules``
spellings, what an adapter's ``adapter_config.json`` asks of the engine (refused by name where the engine cannot
apply it exactly), and the names served beside the base model.

A request for an adapter carries a ``LoRARequest`` (its name, directory and salt) to the engine, which reads the
weights itself (``lora.py``): the same request runs on any replica, and the server process never loads weights.
"""

from __future__ import annotations

import itertools
import json
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_SALTS = itertools.count(1)


class AdapterRefused(ValueError):
    """An adapter the engine cannot serve exactly; the message names the adapter and what it asks for."""


@dataclass(frozen=True, slots=True)
class LoRARequest:
    name: str
    path: str
    salt: int
    """Tells this adapter's cached KV blocks from the base's and every other adapter's (``block_manager.py``): a name
    loaded again from another directory gets another."""


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


def adapter_config(name: str, path: str | Path, max_rank: int) -> dict[str, Any]:
    """The adapter's ``adapter_config.json``, once checked: a PEFT LoRA whose every part the engine applies exactly
    (plain LoRA on linear layers, ``lora_alpha`` scaling or rsLoRA, rank within ``--max-lora-rank``); raises
    ``AdapterRefused`` naming what it is not."""
    directory = Path(path)
    try:
        config = json.loads((directory / "adapter_config.json").read_text())
    except FileNotFoundError:
        raise AdapterRefused(f"LoRA adapter {name!r}: {directory} holds no adapter_config.json") from None
    except (OSError, ValueError) as exc:
        raise AdapterRefused(f"LoRA adapter {name!r}: cannot read {directory}/adapter_config.json ({exc})") from None

    def refuse(why: str) -> AdapterRefused:
        return AdapterRefused(f"LoRA adapter {name!r} cannot be served: {why}")

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
    if config.get("lora_bias"):
        raise refuse("it has a LoRA bias (lora_bias)")
    ranks = [int(config.get("r", 8)), *map(int, dict(config.get("rank_pattern") or {}).values())]
    if max(ranks) > max_rank:
        raise refuse(f"its rank {max(ranks)} is above --max-lora-rank {max_rank}")
    keys = _weight_names(directory)
    if keys is None:
        raise AdapterRefused(f"LoRA adapter {name!r}: {directory} holds no {' or '.join(WEIGHT_FILES)}")
    if embedding := next((key for key in keys if "lora_embedding" in key), None):
        raise refuse(f"it adapts an embedding ({embedding})")
    if other := next((key for key in keys if ".lora_A." not in key and ".lora_B." not in key), None):
        raise refuse(f"it holds weights other than LoRA's A and B matrices ({other})")
    return dict(config)


def _weight_names(directory: Path) -> list[str] | None:
    """The tensor names of the adapter's weights (a safetensors header is read without loading anything); ``[]`` for
    a pickled ``.bin`` (checked when the engine loads it); ``None`` if it has none."""
    file = directory / WEIGHT_FILES[0]
    if file.is_file():
        with file.open("rb") as stream:
            (size,) = struct.unpack("<Q", stream.read(8))
            header = json.loads(stream.read(size))
        return [key for key in header if key != "__metadata__"]
    return [] if (directory / WEIGHT_FILES[1]).is_file() else None


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

    def add(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter in ``path`` as ``name`` (its config checked: ``AdapterRefused``); ``ValueError`` if the
        name is taken."""
        adapter_config(name, path, self.max_rank)
        with self._lock:
            if name in self._served or name == self.base:
                raise ValueError(f"the name {name!r} is already served; unload it first")
            request = self._served[name] = LoRARequest(name, str(Path(path).resolve()), next(_SALTS))
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
