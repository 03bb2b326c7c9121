"""LoRA adapters through the API (``--enable-lora``): served beside the demo model, named by a request's ``model``,
listed by ``/v1/models``, mixed with the base in one batch, loaded and unloaded at run time by the operator alone;
every answer checked against peft's own forward of the adapter; a broken adapter fails only its own lines."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from lora_helpers import MALFORMED, make_adapters, malformed_adapters
from server_helpers import TENANT_KEYS, LiveServer

from batchgen.server.engine.features.adapters import LoRAModule

PROMPTS = [[10, 20, 30, 40, 50, 60, 70, 80, 90], [5, 4, 3, 2, 1, 200, 201], [33] * 12]
TOKENS = 8
ADMIN_KEY = "operator-key-8910"


@pytest.fixture(scope="module")
def adapters(lora_adapters: dict[str, Path]) -> dict[str, Path]:
    return lora_adapters


@pytest.fixture(scope="module")
def expected(peft_text: Callable[[list[int], int, str | None], str]) -> Callable[[list[int], str | None], str]:
    return lambda prompt, name: peft_text(prompt, TOKENS, name)


@pytest.fixture(scope="module")
def lora_server(server_factory: Callable[..., LiveServer], adapters: dict[str, Path]) -> Iterator[LiveServer]:
    """alpha and beta from the start (one flag, several values, and vLLM's JSON form), gamma loaded at run time; two
    tenants (its ``http`` is the first's) and the operator."""
    yield server_factory(
        "--enable-lora",
        "--lora-modules",
        f"alpha={adapters['alpha']}",
        f'{{"name": "beta", "path": "{adapters["beta"]}", "base_model_name": "demo"}}',
        "--max-loras", "2", "--max-lora-rank", "8", "--allow-runtime-lora-updating",
        "--api-key", TENANT_KEYS[1], "--admin-api-key", ADMIN_KEY,
        api_key=TENANT_KEYS[0],
    )  # fmt: skip


@pytest.fixture(scope="module")
def admin(lora_server: LiveServer) -> Iterator[httpx.Client]:
    """The operator's client."""
    with httpx.Client(base_url=lora_server.base_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as client:
        yield client


def completion(server: LiveServer, model: str, prompt: list[int]) -> Any:
    body = {"model": model, "prompt": prompt, "max_tokens": TOKENS, "ignore_eos": True}
    return server.http.post("/v1/completions", json=body)


def test_adapters_are_listed_with_their_base_and_answer_as_peft(
    lora_server: LiveServer, adapters: dict[str, Path], expected: Callable[[list[int], str | None], str]
) -> None:
    models = {model["id"]: model for model in lora_server.http.get("/v1/models").json()["data"]}
    assert models["demo"]["parent"] is None
    assert {name: (models[name]["parent"], models[name]["root"]) for name in ("alpha", "beta")} == {
        name: ("demo", str(adapters[name].resolve())) for name in ("alpha", "beta")
    }
    assert lora_server.http.get("/v1/models/beta").json()["parent"] == "demo"
    for name in ("demo", "alpha", "beta"):
        response = completion(lora_server, name, PROMPTS[0])
        assert response.status_code == 200, response.text
        assert response.json()["model"] == name
        assert response.json()["choices"][0]["text"] == expected(PROMPTS[0], None if name == "demo" else name)


def test_an_unknown_adapter_is_404_model_not_found(lora_server: LiveServer) -> None:
    response = completion(lora_server, "delta", PROMPTS[0])
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "invalid_request_error")
    assert "'delta' does not exist: this server serves 'demo' or 'alpha' or 'beta'" in error["message"]


def test_load_at_run_time_then_a_batch_mixing_adapters_and_the_base(
    lora_server: LiveServer,
    admin: httpx.Client,
    adapters: dict[str, Path],
    expected: Callable[[list[int], str | None], str],
) -> None:
    response = admin.post("/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": str(adapters["gamma"])})
    assert response.status_code == 200 and "gamma" in response.text
    again = admin.post("/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": "/nowhere"})
    assert again.status_code == 400 and again.json()["error"]["code"] == "invalid_adapter"
    names = ["demo", "alpha", "beta", "gamma"]
    lines = [
        {
            "custom_id": f"{name}-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": name, "prompt": prompt, "max_tokens": TOKENS, "ignore_eos": True},
        }
        for i, prompt in enumerate(PROMPTS)
        for name in names
    ]
    batch = lora_server.run(lines, endpoint="/v1/completions")
    assert batch["status"] == "completed", batch.get("errors")
    results = {line["custom_id"]: line["response"]["body"] for line in lora_server.lines(batch["output_file_id"])}
    for i, prompt in enumerate(PROMPTS):
        for name in names:
            body = results[f"{name}-{i}"]
            assert body["choices"][0]["text"] == expected(prompt, None if name == "demo" else name), f"{name}-{i}"
    # Unloaded: refused from then on, and gone from the list.
    assert admin.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"}).status_code == 200
    assert completion(lora_server, "gamma", PROMPTS[0]).status_code == 404
    assert "gamma" not in {model["id"] for model in lora_server.http.get("/v1/models").json()["data"]}
    missing = admin.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("", "1 to 128 characters, not 0"),
        ("x" * 100_000, "1 to 128 characters, not 100000"),
        ("a/../b", "no empty, '.' or '..' part"),
        ("/abs", "no empty, '.' or '..' part"),
        ("evil\u202egpj.exe", "no spaces, control or invisible (bidi) characters"),
        ("two words", "no spaces"),
    ],
)
def test_an_adapters_name_is_printable_and_short(
    admin: httpx.Client, adapters: dict[str, Path], name: str, said: str
) -> None:
    """Every tenant's /v1/models and model_not_found say the names: 100,000 characters made each 404 103 KB."""
    response = admin.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapters["gamma"])})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_value", "lora_name") and said in error["message"]
    with pytest.raises(ValueError, match="--lora-modules"):
        LoRAModule.parse(f"{name}=/adapters/a")


def test_an_adapters_name_may_name_its_owner() -> None:
    """A hub's ``org/adapter`` is a name: ``a/../b`` and ``/abs`` are refused for their empty or '..' part, not for
    their slashes."""
    assert LoRAModule.parse("org/adapter-1=/a").name == "org/adapter-1"


def test_model_not_found_lists_a_few_names_and_echoes_a_bounded_model(lora_server: LiveServer) -> None:
    error = completion(lora_server, "m" * 10_000, PROMPTS[0]).json()["error"]
    assert error["code"] == "model_not_found" and len(error["message"]) < 300


def test_an_adapter_the_engine_cannot_apply_is_refused_by_name(admin: httpx.Client, tmp_path: Path) -> None:
    from batchgen.server.engine.loading.demo_model import demo_model_dir

    dora = make_adapters(demo_model_dir(), tmp_path, {"dora": {"r": 4, "target_modules": ["q_proj"], "use_dora": True}})
    response = admin.post("/v1/load_lora_adapter", json={"lora_name": "dora", "lora_path": str(dora["dora"])})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_adapter", "lora_path")
    assert (
        error["message"]
        == "LoRA adapter 'dora' cannot be served: it uses DoRA (use_dora), which the engine does not apply"
    )


def test_run_time_loading_is_refused_unless_allowed(live_server: LiveServer, adapters: dict[str, Path]) -> None:
    response = live_server.http.post(
        "/v1/load_lora_adapter", json={"lora_name": "alpha", "lora_path": str(adapters["alpha"])}
    )
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "runtime_lora_updating_disabled"


def test_only_the_operator_loads_or_unloads_and_no_answer_tells_files_apart(
    lora_server: LiveServer, admin: httpx.Client, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """An adapter is served to every tenant: no tenant may load, replace or unload one; and what the operator is told
    of a path without an adapter is the same whatever the path is (a file, a directory, nothing)."""
    for tenant in TENANT_KEYS:
        headers = {"Authorization": f"Bearer {tenant}"}
        for url, body in [
            ("/v1/load_lora_adapter", {"lora_name": "mine", "lora_path": str(adapters["gamma"])}),
            ("/v1/unload_lora_adapter", {"lora_name": "alpha"}),
        ]:
            response = lora_server.http.post(url, json=body, headers=headers)
            assert response.status_code == 403, response.text
            assert response.json()["error"]["code"] == "admin_key_required"
    assert "alpha" in {model["id"] for model in lora_server.http.get("/v1/models").json()["data"]}
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "a-directory").mkdir()
    answers = set()
    for path in [tmp_path / "a-file", tmp_path / "a-directory", tmp_path / "nothing", Path("/etc/passwd")]:
        response = admin.post("/v1/load_lora_adapter", json={"lora_name": "probe", "lora_path": str(path)})
        assert response.status_code == 400
        answers.add(response.text)
    assert len(answers) == 1, answers
    assert "no PEFT LoRA adapter can be read at that path" in answers.pop()


def test_a_broken_adapter_fails_only_its_own_lines(
    lora_server: LiveServer,
    admin: httpx.Client,
    adapters: dict[str, Path],
    tmp_path: Path,
    expected: Callable[[list[int], str | None], str],
) -> None:
    """Each broken shape is refused at load (400 ``invalid_adapter``) or, when only its values are wrong, as each line
    that names it; the other lines of its batch, and another tenant's batch beside it, complete as peft says."""
    broken = malformed_adapters(adapters["gamma"], tmp_path)
    for name, path in broken.items():
        response = admin.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        if name in MALFORMED[-2:]:  # files whose every shape is right: refused when the engine reads the values
            assert response.status_code == 200, response.text
            continue
        assert response.status_code == 400, (name, response.text)
        assert (response.json()["error"]["code"], response.json()["error"]["param"]) == ("invalid_adapter", "lora_path")
    lines = [
        {"custom_id": f"{model}-{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": model, "prompt": PROMPTS[i % 3], "max_tokens": TOKENS, "ignore_eos": True}}
        for i in range(12) for model in ("demo", "nan-weights", "alpha")
    ]  # fmt: skip
    other = LiveServer(base_url=lora_server.base_url, api_key=TENANT_KEYS[1])
    mine = lora_server.create_batch(lora_server.upload(lines)["id"], endpoint="/v1/completions")
    theirs_lines = [{**line, "custom_id": f"b-{line['custom_id']}"} for line in lines if "nan" not in line["custom_id"]]
    theirs = other.create_batch(other.upload(theirs_lines[:4])["id"], endpoint="/v1/completions")
    for server, batch, count in [(lora_server, mine, len(lines)), (other, theirs, 4)]:
        finished = server.wait(batch["id"], timeout_s=120)
        assert finished["status"] == "completed" and finished["request_counts"]["total"] == count
        for line in server.lines(finished["output_file_id"]):
            model, index = line["custom_id"].removeprefix("b-").rsplit("-", 1)
            text = line["response"]["body"]["choices"][0]["text"]
            assert model != "nan-weights" and text == expected(
                PROMPTS[int(index) % 3], None if model == "demo" else model
            )
        failed = server.lines(finished["error_file_id"])
        assert {line["custom_id"].split("-")[0] for line in failed} <= {"nan"}
        assert all(line["response"]["body"]["error"]["code"] == "invalid_adapter" for line in failed)
    assert len(lora_server.lines(lora_server.wait(mine["id"])["error_file_id"])) == 12
    online = completion(lora_server, "nan-weights", PROMPTS[0])
    assert online.status_code == 400 and online.json()["error"]["code"] == "invalid_adapter"
    other.http.close()
