"""Tiny random vision-language models built in code, with real processors (Pillow image processors, a byte-level
tokenizer carrying the family's special tokens, a chat template rendering image parts as the real one does),
saved to a directory and loaded back through ``from_pretrained``; test images; transformers' own greedy ``generate``
on a conversation with images, the reference the engine must match."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}

_IMAGE_PART = "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    + _IMAGE_PART
    + "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() }}: {% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    + _IMAGE_PART
    + "<image>\n{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def byte_tokenizer(specials: list[str], chat_template: str) -> Any:
    """Every byte one token (ids 0-255, as the demo model's), bos/eos/pad, then ``specials`` as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from batchgen.server.engine.loading.demo_model import BOS, EOS, PAD, _bytes_to_unicode

    byte_to_char = _bytes_to_unicode()
    tokenizer = Tokenizer(models.BPE(vocab={byte_to_char[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=4096
    )
    tok.add_special_tokens({"additional_special_tokens": specials}, replace_extra_special_tokens=False)
    tok.chat_template = chat_template
    return tok


def _save(path: Path, model: Any, tokenizer: Any, image_processor: Any, processor: dict[str, Any]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():  # clear margins for greedy decoding
        model.get_output_embeddings().weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    image_processor.save_pretrained(path)
    (path / "processor_config.json").write_text(json.dumps(processor))
    (path / "chat_template.jinja").write_text(tokenizer.chat_template)
    return path


def qwen2_5_vl(path: Path) -> Path:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = byte_tokenizer(QWEN_SPECIALS, QWEN_TEMPLATE)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    config = Qwen2_5_VLConfig(
        text_config={**TEXT, "vocab_size": len(tok), "rope_parameters": rope},
        vision_config={
            "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
            "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
            "fullatt_block_indexes": [1],
        },
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).float()
    pixels = {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 16}
    ip = Qwen2VLImageProcessorPil(size=pixels, patch_size=14, merge_size=2, temporal_patch_size=2)
    return _save(path, model, tok, ip, {"processor_class": "Qwen2_5_VLProcessor"})


def llava(path: Path) -> Path:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = byte_tokenizer(["<image>"], LLAVA_TEMPLATE)
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56, patch_size=14
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=LlamaConfig(**TEXT, vocab_size=len(tok)),
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).float()
    ip = CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    processor = {
        "processor_class": "LlavaProcessor", "patch_size": 14, "vision_feature_select_strategy": "default",
        "num_additional_image_tokens": 1, "image_token": "<image>",
    }  # fmt: skip
    return _save(path, model, tok, ip, processor)


def llava_adapter(path: Path, seed: int) -> tuple[Path, Any]:
    """LLaVA saved at ``path / "llava"`` and a random LoRA adapter on its language model's q/v projections saved at
    ``path / "adapter"``; returns the model's path and peft's model (the reference, in eval mode)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    model_path = llava(path / "llava")
    torch.manual_seed(seed)
    spec = LoraConfig(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj)", init_lora_weights=False)
    peft = get_peft_model(AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32), spec)
    with torch.no_grad():
        for key, param in peft.named_parameters():
            if "lora_" in key:  # large enough to change the greedy tokens
                param.normal_(0, 0.5 if "lora_A" in key else 0.2)
    peft.save_pretrained(path / "adapter")
    return model_path, peft.eval()


BUILDERS = {"llava": llava, "qwen2_5_vl": qwen2_5_vl}


def image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def png_bytes(picture: Image.Image, format: str = "PNG") -> bytes:
    out = io.BytesIO()
    picture.save(out, format=format)
    return out.getvalue()


def data_url(picture: Image.Image, format: str = "PNG") -> str:
    import base64

    return f"data:image/{format.lower()};base64," + base64.b64encode(png_bytes(picture, format)).decode()


@torch.no_grad()
def hf_greedy(
    model: Any, processor: Any, messages: list[dict[str, Any]], images: list[Any], new_tokens: int
) -> tuple[list[int], torch.Tensor, list[int]]:
    """``generate(do_sample=False)`` on the conversation: its tokens, each step's log-softmax, the prompt's ids."""
    text = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)  # as served
    inputs = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
    out = model.generate(
        **inputs, max_new_tokens=new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True,
        pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    prompt = inputs["input_ids"].shape[1]
    logprobs = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1)
    return out.sequences[0, prompt:].tolist(), logprobs, inputs["input_ids"][0].tolist()


IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}:{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}" + _IMAGE_PART + "<image>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def idefics3(path: Path, smolvlm: bool = False) -> Path:
    """Idefics3 (and SmolVLM, its successor with the same layout): pictures split into tiles, each tile's
    placeholders a run of their own."""
    from transformers import LlamaConfig

    if smolvlm:
        from transformers import SmolVLMConfig as Config
        from transformers import SmolVLMForConditionalGeneration as Model
        from transformers import SmolVLMVisionConfig as VisionConfig
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil as Pil
    else:
        from transformers import Idefics3Config as Config  # type: ignore[assignment]
        from transformers import Idefics3ForConditionalGeneration as Model  # type: ignore[assignment]
        from transformers import Idefics3VisionConfig as VisionConfig  # type: ignore[assignment]
        from transformers.models.idefics3.image_processing_pil_idefics3 import (  # type: ignore[assignment]
            Idefics3ImageProcessorPil as Pil,
        )

    specials = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", "<|im_start|>"]
    specials += [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tok = byte_tokenizer(specials, IDEFICS3_TEMPLATE)
    vision = VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56, patch_size=14
    )
    config = Config(
        vision_config=vision.to_dict(),
        text_config=LlamaConfig(**TEXT, vocab_size=len(tok)).to_dict(),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        scale_factor=2,
    )
    torch.manual_seed(0)
    model = Model(config).float()
    ip = Pil(size={"longest_edge": 112}, max_image_size={"longest_edge": 56}, do_image_splitting=True)
    name = "SmolVLMProcessor" if smolvlm else "Idefics3Processor"
    return _save(path, model, tok, ip, {"processor_class": name, "image_seq_len": 4})


def smolvlm(path: Path) -> Path:
    return idefics3(path, smolvlm=True)


BUILDERS["smolvlm"] = smolvlm
BUILDERS["idefics3"] = idefics3


def qwen3_vl(path: Path) -> Path:
    """Qwen3-VL: Qwen2.5-VL's dynamic resolution and M-RoPE (interleaved), plus deepstack: the vision tower's
    intermediate features added to the first decoder layers' outputs at the image positions."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tok = byte_tokenizer(QWEN_SPECIALS, QWEN_TEMPLATE)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True}
    config = Qwen3VLConfig(
        text_config={**TEXT, "head_dim": 16, "vocab_size": len(tok), "rope_parameters": rope},
        vision_config={**QWEN3_VISION, "deepstack_visual_indexes": [0, 1]},
        **_qwen_image_tokens(tok),
    )
    torch.manual_seed(0)
    return _save_qwen3_vision(path, Qwen3VLForConditionalGeneration(config), tok)


QWEN3_VISION = {
    "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64, "patch_size": 16,
    "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 16,
}  # fmt: skip
"""Qwen3-VL's vision tower, tiny (Qwen3.5's too)."""


def _qwen_image_tokens(tok: Any) -> dict[str, int]:
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    return {
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
    }  # fmt: skip


def _save_qwen3_vision(path: Path, model: Any, tok: Any) -> Path:
    """``model`` (built under seed 0 by its caller) with Qwen2-VL's Pillow image processor, as Qwen3VLProcessor
    reads it."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pixels = {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 16}
    ip = Qwen2VLImageProcessorPil(size=pixels, patch_size=16, merge_size=2, temporal_patch_size=2)
    return _save(path, model.float(), tok, ip, {"processor_class": "Qwen3VLProcessor"})


BUILDERS["qwen3_vl"] = qwen3_vl


MISTRAL_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}[INST]{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}" + _IMAGE_PART + "[IMG]"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}[/INST]"
    "{% else %}{{ message['content'] }}{% endif %}{% endfor %}"
)


def mistral3(path: Path) -> Path:
    """Mistral 3 (Pixtral's vision tower): each picture at its own size, its rows of placeholders ending in
    ``[IMG_BREAK]`` and the last in ``[IMG_END]``; a patch merger before the projector."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    tok = byte_tokenizer(["[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"], MISTRAL_TEMPLATE)
    vision = PixtralVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=112,
        patch_size=14, head_dim=16,
    )  # fmt: skip
    config = Mistral3Config(
        vision_config=vision,
        text_config=MistralConfig(**TEXT, vocab_size=len(tok), head_dim=16),
        image_token_index=tok.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=2,
        vision_feature_layer=-1,
    )
    torch.manual_seed(0)
    model = Mistral3ForConditionalGeneration(config).float()
    ip = PixtralImageProcessorPil(size={"longest_edge": 112}, patch_size=14)
    processor = {"processor_class": "PixtralProcessor", "patch_size": 14, "spatial_merge_size": 2}
    return _save(path, model, tok, ip, processor)


BUILDERS["mistral3"] = mistral3


def qwen3_5(path: Path) -> Path:
    """Qwen3.5's ConditionalGeneration: Qwen3-VL's tower without deepstack, M-RoPE, and the hybrid text model
    (Gated DeltaNet layers beside full attention: the engine's state cache)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    tok = byte_tokenizer(QWEN_SPECIALS, QWEN_TEMPLATE)
    rope = {
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "mrope_interleaved": True,
        "partial_rotary_factor": 0.5,
    }  # fmt: skip
    gdn = {
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "head_dim": 16, "layer_types": ["linear_attention", "full_attention"],
    }  # fmt: skip
    config = Qwen3_5Config(
        text_config={**TEXT, **gdn, "vocab_size": len(tok), "rope_parameters": rope},
        vision_config=QWEN3_VISION,
        **_qwen_image_tokens(tok),
    )
    torch.manual_seed(0)
    return _save_qwen3_vision(path, Qwen3_5ForConditionalGeneration(config), tok)


BUILDERS["qwen3_5"] = qwen3_5


GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    + _IMAGE_PART
    + "<start_of_image>{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def gemma3(path: Path) -> Path:
    """Gemma 3: each picture's 4 image tokens (pooled SigLIP patches) between ``<start_of_image>`` and
    ``<end_of_image>``, attending to each other both ways; sliding-window and global layers."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    specials = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    tok = byte_tokenizer(specials, GEMMA3_TEMPLATE)
    named = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tok._set_model_specific_special_tokens(special_tokens=named)  # saved as the real tokenizer's named tokens
    ids = {t: tok.convert_tokens_to_ids(t) for t in specials}
    text = Gemma3TextConfig(
        **{**TEXT, "num_hidden_layers": 2}, head_dim=16, vocab_size=len(tok), sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
    )  # fmt: skip
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56, patch_size=14
    )
    config = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"], image_token_index=ids["<image_soft_token>"],
        tie_word_embeddings=False,  # the output scaled for clear greedy margins, not the input (Gemma scales it)
    )  # fmt: skip
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).float()
    with torch.no_grad():  # initialised to zeros: every picture would be the same
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.5)
    ip = Gemma3ImageProcessorPil(size={"height": 56, "width": 56})
    return _save(path, model, tok, ip, {"processor_class": "Gemma3Processor", "image_seq_length": 4})


BUILDERS["gemma3"] = gemma3


def gemma4(path: Path) -> Path:
    """Gemma 4's ConditionalGeneration: pictures at their aspect ratio (up to 70 pooled tokens each, padding patches
    at ``(-1, -1)``), per-layer inputs from the token ids, image tokens attending both ways on sliding layers."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    specials = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    template = GEMMA3_TEMPLATE.replace("<start_of_image>{%", "<image_soft_token>{%")  # the marker: the image token
    audio = {"boa_token": "<start_of_audio>", "eoa_token": "<end_of_audio>", "audio_token": "<audio_soft_token>"}
    tok = byte_tokenizer([*specials, "<|video|>", *audio.values()], template)
    named = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tok._set_model_specific_special_tokens(special_tokens={**named, **audio})  # its processor asks for all six
    ids = {t: tok.convert_tokens_to_ids(t) for t in [*specials, "<|video|>", *audio.values()]}
    text = {
        **TEXT, "head_dim": 16, "global_head_dim": 16, "vocab_size": len(tok), "sliding_window": 8,
        "num_hidden_layers": 3, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": len(tok), "use_bidirectional_attention": "vision",
        "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
    }  # fmt: skip
    vision = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 16, "patch_size": 4, "pooling_kernel_size": 2,
        "position_embedding_size": 64,
    }  # fmt: skip
    config = Gemma4Config(
        text_config=text, vision_config=vision, audio_config=None, boi_token_id=ids["<start_of_image>"],
        eoi_token_id=ids["<end_of_image>"], image_token_id=ids["<image_soft_token>"], video_token_id=ids["<|video|>"],
        boa_token_id=ids["<start_of_audio>"], eoa_token_index=ids["<end_of_audio>"],
        audio_token_id=ids["<audio_soft_token>"], tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(config).float()
    ip = Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
    return _save(path, model, tok, ip, {"processor_class": "Gemma4Processor", "image_seq_length": 70})


BUILDERS["gemma4"] = gemma4


def llava_next(path: Path, onevision: bool = False) -> Path:
    """LLaVA-NeXT ("anyres"): each picture resized into the best grid of 28-pixel tiles for its size, the tiles plus
    a base view through the tower, the grid's features unpadded back to the picture's aspect ratio with an
    ``image_newline`` ending each row, so pictures of other sizes take other numbers of placeholders. LLaVA-OneVision
    (``onevision``): the same on SigLIP and Qwen2, its grid's features pooled down past ``anyres_max_1``."""
    from transformers import CLIPVisionConfig, LlamaConfig, Qwen2Config, SiglipVisionConfig

    if onevision:
        from transformers import LlavaOnevisionConfig as Config
        from transformers import LlavaOnevisionForConditionalGeneration as Model
        from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
            LlavaOnevisionImageProcessorPil as Pil,
        )
    else:
        from transformers import LlavaNextConfig as Config  # type: ignore[assignment]
        from transformers import LlavaNextForConditionalGeneration as Model  # type: ignore[assignment]
        from transformers.models.llava_next.image_processing_pil_llava_next import (  # type: ignore[assignment]
            LlavaNextImageProcessorPil as Pil,
        )

    tok = byte_tokenizer(["<image>", "<video>"], LLAVA_TEMPLATE)
    tower = SiglipVisionConfig if onevision else CLIPVisionConfig
    vision = tower(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14
    )
    pinpoints = [[28, 56], [56, 28], [56, 56], [28, 84], [84, 28]]
    text = (Qwen2Config if onevision else LlamaConfig)(**TEXT, vocab_size=len(tok))
    extra = {"vision_aspect_ratio": "anyres_max_1", "video_token_index": tok.convert_tokens_to_ids("<video>")}
    config = Config(
        vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1, image_grid_pinpoints=pinpoints,
        vision_feature_select_strategy="full" if onevision else "default", **(extra if onevision else {}),
    )  # fmt: skip
    torch.manual_seed(0)
    model = Model(config).float()
    with torch.no_grad():  # a newline unlike the other rows (initialised small)
        model.model.image_newline.normal_(0, 1.0)
    if onevision:
        ip = Pil(size={"height": 28, "width": 28}, image_grid_pinpoints=pinpoints)
        processor = {
            "processor_class": "LlavaOnevisionProcessor", "num_image_tokens": 4,
            "vision_feature_select_strategy": "full", "vision_aspect_ratio": "anyres_max_1", "image_token": "<image>",
            "video_token": "<video>",
        }  # fmt: skip
    else:
        ip = Pil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}, image_grid_pinpoints=pinpoints)
        processor = {
            "processor_class": "LlavaNextProcessor", "patch_size": 14, "vision_feature_select_strategy": "default",
            "num_additional_image_tokens": 1, "image_token": "<image>",
        }  # fmt: skip
    return _save(path, model, tok, ip, processor)


def llava_onevision(path: Path) -> Path:
    return llava_next(path, onevision=True)


BUILDERS["llava_next"] = llava_next
BUILDERS["llava_onevision"] = llava_onevision


KIMI_SPECIALS = [
    "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>", "<|media_begin|>", "<|media_content|>",
    "<|media_pad|>", "<|media_end|>", "<|kimi_k25_video_placeholder|>",
]  # fmt: skip
KIMI_TEMPLATE = (
    "{% for message in messages %}<|im_{{ message['role'] }}|>{{ message['role'] }}<|im_middle|>"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    + _IMAGE_PART
    + "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)
KIMI_TEXT = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "max_position_embeddings": 512, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 16, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
}  # fmt: skip
"""DeepSeek-V3's shape, as Kimi K2.5's text model is: MLA, a dense first layer, then routed experts."""


def kimi_k25(path: Path) -> Path:
    """Kimi K2.5 (the seed's model) built tiny from its own config: MoonViT (learned positions resampled to each
    picture's grid, 2x2 merged patches) and DeepSeek-V3's text model; its Pillow image processor (transformers'
    needs torchvision)."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    from batchgen.server.serving.kimi_k25 import KimiK25ImageProcessorPil

    tok = byte_tokenizer(KIMI_SPECIALS, KIMI_TEMPLATE)
    ids = {t: tok.convert_tokens_to_ids(t) for t in KIMI_SPECIALS}
    vision = {
        "patch_size": 14, "pos_emb_height": 8, "pos_emb_width": 8, "num_attention_heads": 2, "num_hidden_layers": 2,
        "hidden_size": 32, "intermediate_size": 64, "merge_kernel_size": [2, 2],
    }  # fmt: skip
    config = Kimi_K25Config(
        text_config={"model_type": "deepseek_v3", **KIMI_TEXT, "vocab_size": len(tok)},
        vision_config=vision, projection_hidden_size=32, image_token_id=ids["<|media_pad|>"],
        video_token_id=ids["<|kimi_k25_video_placeholder|>"], vision_start_token_id=ids["<|media_begin|>"],
        vision_end_token_id=ids["<|media_end|>"], tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Kimi_K25ForConditionalGeneration(config).float()
    ip = KimiK25ImageProcessorPil(size={"max_height": 112, "max_width": 112}, max_patches=64)
    return _save(path, model, tok, ip, {"processor_class": "Kimi_K25Processor"})


BUILDERS["kimi_k25"] = kimi_k25
