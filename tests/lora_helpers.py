"""Random LoRA adapters in PEFT's format, made with peft itself on the demo model (float32): what the engine and
server tests serve, and what peft's own forward answers for them."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

ADAPTERS: dict[str, dict[str, Any]] = {
    "alpha": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "beta": {
        "r": 8,
        "lora_alpha": 16,
        "use_rslora": True,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    },
    "gamma": {"r": 2, "lora_alpha": 4, "target_modules": ["o_proj", "down_proj", "up_proj"]},
}
"""Each adapter's LoRA config: attention and MLP projections, ``lora_alpha`` scaling and rsLoRA, three ranks."""


def make_adapters(model_dir: Path, root: Path, specs: dict[str, dict[str, Any]] = ADAPTERS) -> dict[str, Path]:
    """Each adapter of ``specs`` saved under ``root/<name>``, its B matrices random (non-zero), so that it changes
    the text."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = {}
    for seed, (name, spec) in enumerate(specs.items()):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        torch.manual_seed(100 + seed)
        peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **spec))
        with torch.no_grad():
            for key, param in peft_model.named_parameters():
                if "lora_" in key:
                    param.normal_(0, 0.5 if "lora_A" in key else 0.2)
        paths[name] = root / name
        peft_model.save_pretrained(paths[name])
    return paths


def peft_model(model_dir: Path, adapters: dict[str, Path]) -> Any:
    """One peft model holding every adapter (float32, eager attention), in eval mode."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    names = list(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


def peft_reference(model_dir: Path, adapters: dict[str, Path]) -> Any:
    """``peft_model``'s greedy tokens: ``greedy(prompt, tokens, adapter)``."""
    import torch

    model = peft_model(model_dir, adapters)

    @functools.cache
    @torch.no_grad()
    def generate(prompt: tuple[int, ...], max_new_tokens: int, adapter: str | None) -> list[int]:
        """Greedy through the whole sequence's forward each token, EOS included (the engine runs ``ignore_eos``)."""
        ids = list(prompt)
        with model.disable_adapter() if adapter is None else contextlib.nullcontext():
            if adapter is not None:
                model.set_adapter(adapter)
            for _ in range(max_new_tokens):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt) :]

    return lambda prompt, max_new_tokens, adapter: generate(tuple(prompt), max_new_tokens, adapter)


MALFORMED = (
    "config-a-list", "r-null", "r-zero", "r-1e400", "alpha-not-a-number", "no-lora-B", "file-under-8-bytes",
    "header-of-2^40-bytes", "truncated", "nan-weights", "huge-weights-inf",
)  # fmt: skip
"""The broken adapters ``malformed_adapters`` makes; the last two pass every check of their files' shape."""


def malformed_adapters(good: Path, root: Path) -> dict[str, Path]:
    """Copies of the adapter in ``good``, each broken one way (``MALFORMED``): its config, its weights' header, its
    data, or its values."""
    import json
    import shutil
    import struct

    from safetensors.torch import load_file, save_file

    config = json.loads((good / "adapter_config.json").read_text())
    weights = good / "adapter_model.safetensors"
    made: dict[str, Path] = {}
    for name in MALFORMED:
        path = made[name] = root / name
        shutil.copytree(good, path)
        target = path / "adapter_model.safetensors"
        state = load_file(weights)
        if name == "config-a-list":
            (path / "adapter_config.json").write_text(json.dumps([config]))
        elif name.startswith(("r-", "alpha-")):
            key, value = {"r-null": ("r", None), "r-zero": ("r", 0), "alpha-not-a-number": ("lora_alpha", "abc")}.get(
                name, ("r", 0)
            )
            text = json.dumps({**config, key: value})
            if name == "r-1e400":
                text = json.dumps({**config, "r": 12345}).replace("12345", "1e400")
            (path / "adapter_config.json").write_text(text)
        elif name == "no-lora-B":
            dropped = next(key for key in state if ".lora_B." in key)
            save_file({key: tensor for key, tensor in state.items() if key != dropped}, target)
        elif name == "file-under-8-bytes":
            target.write_bytes(b"\x01\x02\x03")
        elif name == "header-of-2^40-bytes":
            target.write_bytes(struct.pack("<Q", 2**40) + b"{}" * 16)
        elif name == "truncated":
            data = weights.read_bytes()
            target.write_bytes(data[: len(data) - 64])
        else:  # finite or not, values no mask could contain by multiplying
            value = float("nan") if name == "nan-weights" else 3e38
            save_file(
                {key: tensor.fill_(value) if ".lora_A." in key else tensor for key, tensor in state.items()}, target
            )
    return made
