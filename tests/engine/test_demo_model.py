"""The demo model is built once, safely even when several processes build it at the same time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

BUILD = "from batchgen.server.engine.loading.demo_model import demo_model_dir; print(demo_model_dir())"


@pytest.mark.slow
def test_concurrent_builds_yield_one_loadable_model(tmp_path: Path) -> None:
    env = {**os.environ, "BATCHGEN_CACHE_DIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(sys.path)}
    builders = [
        subprocess.Popen([sys.executable, "-c", BUILD], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    paths = {builder.communicate(timeout=120)[0].strip() for builder in builders}
    assert all(builder.returncode == 0 for builder in builders)
    assert len(paths) == 1
    path = Path(paths.pop())
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary build directory left behind
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert tokenizer.decode(tokenizer.encode("héllo")) == "héllo"
    assert model.config.vocab_size == len(tokenizer) == 259
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert "<|assistant|>" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
