"""Images through the engine, against transformers' own ``generate`` on the same pictures (float32): greedy tokens
identical, logprobs within 1e-4, for each family the engine drives, with the prompt's chunks cutting through the
images' placeholders, the encoder cache on and off, preemption, n > 1 and the prefix cache (two pictures behind
the same placeholder tokens never share KV)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForImageTextToText
from vlm_helpers import BUILDERS, hf_greedy, image, png_bytes

from batchgen.server.engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams, build_engine
from batchgen.server.engine.core.step_costs import StepCosts
from batchgen.server.engine.errors import ModelNotSupported
from batchgen.server.engine.self_check import check_engine
from batchgen.server.media import image_hash
from batchgen.server.serving.image_processor import ImageProcessor

NEW_TOKENS = 6
PICTURES = [image(70, 50, 1), image(40, 100, 2), image(60, 60, 3), image(60, 60, 4)]
"""The last two: the same size (the same placeholder tokens), other pixels."""
CONVERSATIONS = [
    [{"type": "text", "text": "look "}, {"type": "image"}, {"type": "text", "text": " and "}, {"type": "image"}],
    [{"type": "image"}, {"type": "text", "text": "what is it?"}],
]
IMAGES_OF = [[0, 1], [2]]


class Family:
    def __init__(self, name: str, path: Path) -> None:
        self.path = path
        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        self.hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        """The reference: a copy of its own (the engine's attention is set on ``model``)."""
        self.processor = ImageProcessor(str(path), None)
        self.reference: dict[int, tuple[list[int], torch.Tensor, list[int]]] = {}

    def expected(self, index: int) -> tuple[list[int], torch.Tensor, list[int]]:
        if index not in self.reference:
            messages = [{"role": "user", "content": CONVERSATIONS[index]}]
            pictures = [PICTURES[i] for i in IMAGES_OF[index]]
            self.reference[index] = hf_greedy(self.hf, self.processor.processor, messages, pictures, NEW_TOKENS)
        return self.reference[index]

    def request(self, index: int, request_id: str, pictures: list[int] | None = None, **params: Any) -> EngineRequest:
        messages = [{"role": "user", "content": CONVERSATIONS[index]}]
        text = self.processor.processor.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        chosen = [PICTURES[i] for i in (pictures or IMAGES_OF[index])]
        keys = [image_hash(png_bytes(p)) for p in chosen]
        ids, mm = self.processor.prompt_inputs(text, chosen, keys)
        sampling = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True, **params)
        return EngineRequest(request_id, ids, sampling, multimodal=mm)

    def engine(self, **overrides: Any) -> LLMEngine:
        config = EngineConfig(model=str(self.path), dtype="float32", device="cpu", **{"num_kv_blocks": 64, **overrides})
        return LLMEngine(self.model, self.processor.processor.tokenizer, config, self.path.name)


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    return Family(request.param, BUILDERS[request.param](tmp_path_factory.mktemp(request.param)))


def _run(engine: LLMEngine, requests: list[EngineRequest]) -> dict[str, Any]:
    for request in requests:
        engine.add_request(request)
    results = {}
    while engine.has_unfinished_requests():
        results.update((r.request_id, r) for r in engine.step())
    return results


def _same(family: Family, result: Any, index: int) -> None:
    assert result.error is None, result.error
    tokens, logprobs, _ = family.expected(index)
    for output in result.outputs:
        assert output.token_ids == tokens
        for lp, expected in zip(output.logprobs, logprobs, strict=True):
            assert abs(lp.logprob - expected[lp.token_id].item()) < 1e-4


@pytest.mark.parametrize("chunk", [2048, 6])
def test_greedy_matches_generate(family: Family, chunk: int) -> None:
    """Whole prompts, then chunks of 6 tokens that start and end inside the images' placeholders."""
    engine = family.engine(max_num_batched_tokens=chunk, enable_prefix_caching=False)
    if chunk == 2048:
        check_engine(engine)  # the text self-check passes on the vision-language model
    requests = [family.request(i, f"r{i}") for i in range(len(CONVERSATIONS))]
    results = _run(engine, requests)
    for i in range(len(CONVERSATIONS)):
        _same(family, results[f"r{i}"], i)
    vision = engine.runner.vision
    assert vision is not None and vision.encoded_images == 3  # each picture once, whatever the chunks
    assert vision.cache.held_bytes() == vision.cache.bytes  # no entry keeps its batch's other images alive


def test_encoder_cache_off_preemption_and_n(family: Family) -> None:
    """No encoder cache, a KV cache so small that sequences are preempted and recomputed, n = 2 forks."""
    order = [1, 1, 0, 1]
    requests = [family.request(c, f"r{i}", n=2 if c == 0 else 1) for i, c in enumerate(order)]
    short, longest = (len(family.request(c, "x").prompt_token_ids) for c in (1, 0))
    # Two short prompts fit, not their outputs too: running sequences are preempted; the longest fits alone.
    blocks = max(-(-(longest + NEW_TOKENS) // 4), 2 * -(-short // 4) + 1)
    engine = family.engine(encoder_cache_mib=0, num_kv_blocks=blocks, block_size=4, enable_prefix_caching=False)
    results = _run(engine, requests)
    for i, c in enumerate(order):
        _same(family, results[f"r{i}"], c)
    assert len(results["r2"].outputs) == 2
    assert engine.stats().preemptions > 0
    assert engine.runner.vision is not None and engine.runner.vision.cache.bytes == 0


@pytest.mark.parametrize("family", ["gemma4"], indirect=True)  # its images attend both ways, 63-65 tokens each
def test_image_prompts_beside_streams_under_the_prefill_bound(family: Family) -> None:
    """A chunk cannot end inside an image that attends both ways: it runs on to the image's end, past the bound beside
    online streams, and the prompts after it in that step wait (none is given zero or fewer tokens); every output is
    still generate's."""
    engine = family.engine(enable_prefix_caching=False)
    for i in range(5):  # five online streams, decoding past the prompts' prefill
        stream = family.request(1, f"s{i}")
        engine.add_request(replace(stream, params=SamplingParams(max_tokens=60, ignore_eos=True), interactive=True))
    engine.step()
    tight = StepCosts(1.1, floor=4)  # measured: 2 + 2d ms a step of d decodes, 0.11 ms a prefill token
    for seconds, decodes, prefill in ((0.006, 2, 0), (0.010, 4, 0), (0.017, 2, 100)):
        tight.record(seconds, decodes, prefill)
    engine.scheduler.step_costs = tight  # (the engine's own, which its steps teach, stays apart)
    for index, request_id in ((0, "r0"), (1, "r1")):  # two online prompts beside five streams: bounded
        engine.add_request(replace(family.request(index, request_id), interactive=True))
    given: list[int] = []
    schedule = engine.scheduler.schedule

    def recorded() -> Any:
        output = schedule()
        given.extend(item.num_tokens for item in output.scheduled)
        return output

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    results = _run(engine, [])
    assert min(given) >= 1 and max(given) > 9  # an image's chunk ran past the bound (1.1 x 10 ms less 10 ms: 9 tokens)
    assert max(given) <= 65  # by one image's run (63-65 tokens) at most, never a whole prompt (158 or 93 tokens)
    for request_id, index in (("r0", 0), ("r1", 1)):
        _same(family, results[request_id], index)


def test_prefix_cache_keys_include_the_images(family: Family) -> None:
    """The same conversation with another picture has the same token ids: it must not reuse the first's KV, and the
    same picture again must. Blocks of 8: a prompt of whole blocks leaves a hybrid model's state checkpoint at its
    end, which a repeat of it cannot resume from (it must compute its last token)."""
    engine = family.engine(block_size=8)
    first = _run(engine, [family.request(1, "a")])["a"]
    other = family.request(1, "b", pictures=[3])
    assert other.prompt_token_ids == family.request(1, "x").prompt_token_ids
    second = _run(engine, [other])["b"]
    third = _run(engine, [family.request(1, "c")])["c"]
    _same(family, first, 1)
    _same(family, third, 1)
    placeholders = family.request(1, "y").multimodal.images[0].first
    assert second.cached_tokens <= placeholders  # at most the text before the picture
    assert third.cached_tokens > placeholders
    assert (
        second.outputs[0].token_ids != first.outputs[0].token_ids
        or second.outputs[0].logprobs != first.outputs[0].logprobs
    )


def test_unsupported_family_is_refused_in_one_line(tmp_path: Path) -> None:
    """A family the engine does not drive: refused by the factory from the config alone (there are no weights to
    load)."""
    from transformers import Glm4vConfig

    Glm4vConfig().save_pretrained(tmp_path)
    with pytest.raises(ModelNotSupported) as refused:
        build_engine(EngineConfig(model=str(tmp_path), device="cpu"))
    said = str(refused.value)
    assert "\n" not in said and "glm4v" in said


def test_run_batch_reads_local_images_under_the_allowed_path(tmp_path: Path) -> None:
    """run-batch's lines may name pictures as file:// URLs under --allowed-local-media-path, and only there."""
    import json

    from vlm_helpers import data_url, llava

    from batchgen.schemas import ChatCompletion, ErrorResponse, parse_output_line
    from batchgen.server.cli import main

    path = llava(tmp_path / "llava")
    pictures = tmp_path / "pictures"
    pictures.mkdir()
    (pictures / "a.png").write_bytes(png_bytes(PICTURES[0]))
    (tmp_path / "outside.png").write_bytes(png_bytes(PICTURES[0]))
    urls = {
        "local": f"file://{pictures}/a.png",
        "data": data_url(PICTURES[0]),
        "outside": f"file://{pictures}/../outside.png",
    }
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    with source.open("w") as f:
        for custom_id, url in urls.items():
            content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is it?"}]
            body = {"model": str(path), "messages": [{"role": "user", "content": content}], "max_tokens": 4}
            f.write(json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}))
            f.write("\n")
    argv = ["run-batch", "-i", str(source), "-o", str(output), "--model", str(path), "--no-progress"]
    assert main([*argv, "--allowed-local-media-path", str(pictures), "--num-kv-blocks", "64"]) == 0
    lines = {line.custom_id: line.response.body for line in map(parse_output_line, output.read_text().splitlines())}
    local, data, outside = lines["local"], lines["data"], lines["outside"]
    assert isinstance(local, ChatCompletion) and isinstance(data, ChatCompletion)
    assert local.choices[0].message.content == data.choices[0].message.content
    assert isinstance(outside, ErrorResponse) and outside.error.code == "invalid_image_url"


def test_lora_on_the_language_model_with_images(tmp_path: Path) -> None:
    """A LoRA adapter on LLaVA's language model, with a picture in the prompt: the engine's greedy tokens are peft's
    ``generate`` on the same picture."""
    from vlm_helpers import llava_adapter

    from batchgen.server.engine.features.adapters import Adapters

    path, reference = llava_adapter(tmp_path, seed=7)
    family = Family("llava", path)
    messages = [{"role": "user", "content": CONVERSATIONS[1]}]
    tokens, _, _ = hf_greedy(reference, family.processor.processor, messages, [PICTURES[2]], NEW_TOKENS)
    engine = family.engine(enable_lora=True, lora_modules=(f"a={tmp_path / 'adapter'}",), max_lora_rank=8)
    request = family.request(1, "lora")
    request.lora = Adapters.of(engine.config).get("a")
    base = family.request(1, "base")
    results = _run(engine, [request, base])
    assert results["lora"].outputs[0].token_ids == tokens
    assert results["base"].outputs[0].token_ids == family.expected(1)[0] != tokens


def test_images_attending_both_ways_are_refused_where_unmasked(tmp_path: Path) -> None:
    """Gemma 3's image tokens see each other both ways only through the gather backend's masks: flex is refused in
    one line, at load."""
    from vlm_helpers import gemma3

    family = Family("gemma3", gemma3(tmp_path / "gemma3"))
    with pytest.raises(ModelNotSupported) as refused:
        family.engine(attention_backend="flex")
    assert "both ways" in str(refused.value) and "\n" not in str(refused.value)


def test_kimi_k25_pictures_without_torchvision() -> None:
    """Kimi K2.5's Pillow image processor sizes pictures as transformers' torchvision one does: at most
    ``max_patches`` patches (a 400 x 300 picture scaled by sqrt(64 / 588) to 131 x 98), padded at the bottom and right
    to a multiple of the 2 x 2 merge window of 14-pixel patches (with zeros, -1 once normalized)."""
    from batchgen.server.serving.kimi_k25 import KimiK25ImageProcessorPil

    processor = KimiK25ImageProcessorPil(size={"max_height": 112, "max_width": 112}, max_patches=64)
    out = processor([image(70, 50, 1), image(400, 300, 2)], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 10]]
    assert out["pixel_values"].shape == (4 * 6 + 8 * 10, 3, 14, 14)
    last_row = out["pixel_values"][4 * 6 - 6 : 4 * 6]  # rows 42-55 of the first picture: 50-55 padding
    assert torch.all(last_row[:, :, 8:, :] == -1) and not torch.all(last_row[:, :, :8, :] == -1)
