"""The Hugging Face flags: --revision, --trust-remote-code, --tokenizer, --chat-template, --served-model-name and
--generation-config, each through its effect. A Hugging Face cache built on disk (offline) stands in for the hub:
the demo model under two revisions, one of them shipping its own code."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from server_helpers import LiveServer

from batchgen.server.cli import build_parser, settings_from_args
from batchgen.server.engine.config import EngineConfig
from batchgen.server.engine.errors import ModelLoadError
from batchgen.server.engine.loading.demo_model import demo_model_dir
from batchgen.server.engine.loading.loader import load_generation_defaults, load_model, load_tokenizer

REPO = "batchgen-test/tiny"
REVISIONS = {"main": "a" * 40, "custom": "b" * 40}
LAST_MESSAGE = "{{ messages[-1]['content'] }}"
"""A chat template whose prompt is the last message alone: with the demo's byte tokenizer, a prompt of len(text)."""
CUSTOM_CONFIG = (
    "from transformers import LlamaConfig\n\n\nclass TinyConfig(LlamaConfig):\n    model_type = 'tiny_custom'\n"
)
CUSTOM_MODEL = (
    "from transformers import LlamaForCausalLM\n\nfrom .configuration_tiny import TinyConfig\n\n\n"
    "class TinyForCausalLM(LlamaForCausalLM):\n    config_class = TinyConfig\n"
)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face hub cache holding ``batchgen-test/tiny``: ``main`` is the demo model, ``custom`` the same
    weights behind its own code (auto_map) with a 1024-token context."""
    root = tmp_path_factory.mktemp("hub")
    repo = root / f"models--{REPO.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    for ref, commit in REVISIONS.items():
        shutil.copytree(demo_model_dir(), repo / "snapshots" / commit)
        (repo / "refs" / ref).write_text(commit)
    custom = repo / "snapshots" / REVISIONS["custom"]
    config = json.loads((custom / "config.json").read_text())
    auto_map = {"AutoConfig": "configuration_tiny.TinyConfig", "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"}
    config |= {"model_type": "tiny_custom", "auto_map": auto_map, "max_position_embeddings": 1024}
    (custom / "config.json").write_text(json.dumps(config))
    (custom / "configuration_tiny.py").write_text(CUSTOM_CONFIG)
    (custom / "modeling_tiny.py").write_text(CUSTOM_MODEL)
    return root


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo tokenizer alone, with the last-message chat template."""
    path = tmp_path_factory.mktemp("tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_dir() / name, path / name)
    (path / "chat_template.jinja").write_text(LAST_MESSAGE)
    return path


def test_the_flags_and_their_variables() -> None:
    argv = ["serve", "--revision", "v2", "--trust-remote-code", "--tokenizer", "tok", "--chat-template", "t.jinja"]
    argv += ["--served-model-name", "a", "--served-model-name", "b", "--generation-config", "none"]
    engine = settings_from_args(build_parser().parse_args(argv)).engine
    assert (engine.revision, engine.trust_remote_code, engine.tokenizer) == ("v2", True, "tok")
    assert (engine.chat_template, engine.served_model_names, engine.generation_config) == (
        "t.jinja",
        ("a", "b"),
        "none",
    )
    # vLLM's spelling: several names after one flag.
    several = settings_from_args(build_parser().parse_args(["serve", "--served-model-name", "a", "b", "c"]))
    assert several.engine.served_model_names == ("a", "b", "c")
    # By default the model answers to --model as given, a hub id or a path; the demo model stays "demo".
    for model in ("Qwen/Qwen2.5-0.5B-Instruct", ".", "/models/llama", "demo"):
        assert EngineConfig(model=model).served_model_names == (model,)
    assert EngineConfig(served_model_name=("x", "y")).served_model_names == ("x", "y")


def test_a_server_with_every_hub_flag(
    hub: Path,
    tokenizer_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    server_factory: Callable[..., LiveServer],
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))  # where transformers copies the model's code
    server = server_factory(
        *("--model", REPO, "--revision", "custom", "--trust-remote-code", "--tokenizer", str(tokenizer_dir)),
        *("--served-model-name", "tiny", "--served-model-name", "tiny-alias"),
    )
    models = server.http.get("/v1/models").json()["data"]
    assert [(m["id"], m["max_context_length"]) for m in models] == [("tiny", 1024), ("tiny-alias", 1024)]
    assert list((tmp_path / "modules").rglob("modeling_tiny.py"))  # its own code ran
    for name in ("tiny", "tiny-alias"):
        body = {"model": name, "messages": [{"role": "user", "content": "Bonjour"}], "max_tokens": 2}
        answer = server.http.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == name  # the name asked for
        assert answer.json()["usage"]["prompt_tokens"] == len("Bonjour")  # --tokenizer's template
    unknown = server.http.post("/v1/chat/completions", json={**body, "model": REPO})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert "'tiny' or 'tiny-alias'" in unknown.json()["error"]["message"]


def test_revision_and_remote_code_at_load(hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    model, _ = load_model(EngineConfig(model=REPO, device="cpu"))
    assert model.config.max_position_embeddings == 2048  # main
    assert not model.use_kernels  # no Hub kernels, which transformers 5.25 turns on by default
    with pytest.raises(ModelLoadError) as refused:
        load_model(EngineConfig(model=REPO, revision="custom", device="cpu"))
    assert str(refused.value) == (
        f"the model '{REPO}' ships its own Python code (auto_map): pass --trust-remote-code to run it, if you trust "
        "its source"
    )
    with pytest.raises(ModelLoadError, match=f"could not load the model '{REPO}'"):
        load_model(EngineConfig(model=REPO, revision="v9", device="cpu"))


def test_chat_template_from_a_file_or_the_text(tmp_path: Path) -> None:
    template = tmp_path / "template.jinja"
    template.write_text("[{{ messages[0]['content'] }}]")
    assert load_tokenizer(EngineConfig(chat_template=str(template))).chat_template == template.read_text()
    assert load_tokenizer(EngineConfig(chat_template=LAST_MESSAGE)).chat_template == LAST_MESSAGE
    with pytest.raises(ModelLoadError, match="no such file, and not a template"):
        load_tokenizer(EngineConfig(chat_template=str(tmp_path / "missing.jinja")))
    with pytest.raises(ModelLoadError, match="--chat-template cannot render a one-message conversation"):
        load_tokenizer(EngineConfig(chat_template="{% if %}"))


def test_tokenizer_from_elsewhere(tokenizer_dir: Path, tmp_path: Path) -> None:
    assert load_tokenizer(EngineConfig(tokenizer=str(tokenizer_dir))).chat_template == LAST_MESSAGE
    assert load_tokenizer(EngineConfig()).chat_template != LAST_MESSAGE  # the model's own
    with pytest.raises(ModelLoadError, match=r"^no tokenizer at '/nowhere/tok': that directory does not exist"):
        load_tokenizer(EngineConfig(tokenizer="/nowhere/tok"))


def test_generation_config_defaults(tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(demo_model_dir(), model)
    shipped = json.loads((model / "generation_config.json").read_text())
    sampling = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 7}
    (model / "generation_config.json").write_text(json.dumps({**shipped, **sampling, "do_sample": False}))
    expected = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 7}
    assert load_generation_defaults(EngineConfig(model=str(model))) == expected  # auto: the model's
    assert load_generation_defaults(EngineConfig(model=str(model), generation_config="none")) == {}
    assert load_generation_defaults(EngineConfig(model=str(model), generation_config="vllm")) == {}
    assert load_generation_defaults(EngineConfig(model="demo")) == {}  # it ships no sampling values
    assert load_generation_defaults(EngineConfig(model="demo", generation_config=str(model))) == expected
    with pytest.raises(ModelLoadError, match=r"--generation-config '/nowhere': no generation_config\.json there"):
        load_generation_defaults(EngineConfig(generation_config="/nowhere"))
