"""How requests are answered: the tool-call and reasoning parsers of chat outputs, spelled as vLLM's flags spell
them, and the bound on what scoring may return."""

from __future__ import annotations

from dataclasses import dataclass

from ..options import setting


@dataclass(frozen=True, slots=True)
class ServingConfig:
    enable_auto_tool_choice: bool = setting(
        False, "with tool_choice 'auto', parse the model's tool calls out of its text (needs --tool-call-parser)"
    )
    tool_call_parser: str | None = setting(
        None,
        "the format of the model's tool calls: hermes (Qwen 2.5/3, Hermes), llama3_json (Llama 3.x), mistral, "
        "pythonic (Llama 4, ToolACE), kimi_k2 (Kimi K2)",
    )
    reasoning_parser: str | None = setting(
        None, "split a thinking model's reasoning from its answer: qwen3 or deepseek_r1"
    )
    max_prompt_logprob_entries: int = setting(
        2**19,
        "most logprobs a request's prompts may return (prompt tokens x (top logprobs + 1) x n, its prompts together: "
        "prompt_logprobs, echo with logprobs); a request over it is refused (400 too_many_logprobs), as its answer "
        "would be tens of megabytes",
    )
    allowed_media_domains: tuple[str, ...] = setting(
        (),
        "hosts image URLs may be fetched from over https, exact names, repeat for several (vLLM's flag); none: only "
        "data: URLs and uploaded images (file ids)",
    )
    allowed_local_media_path: str | None = setting(
        None, "a folder whose images run-batch lines may name as file:// URLs (vLLM's flag); none: no local files"
    )
    serve_local_media: bool = setting(
        False,
        "in serve, let requests (online, and the lines of batches created through the API) read images under "
        "--allowed-local-media-path too; off, that folder is run-batch's alone, as every caller of the server could "
        "read it",
    )
    limit_mm_per_prompt: str = setting(
        '{"image": 8}', "most images one prompt may hold, as vLLM's JSON ('{\"image\": 4}') or a number"
    )
    max_image_bytes: int = setting(20 * 2**20, "largest image taken, in bytes (a data URL's decoded bytes)")
    max_image_pixels: int = setting(
        40_000_000, "most pixels (width x height, read from the header before decoding) an image may have"
    )
    max_request_image_pixels: int = setting(
        128_000_000,
        "most pixels the images of one request may have together, each counted as its header's width x height or "
        "what the model's processor resizes it to, where more (about 10 bytes of memory a pixel at the peak); "
        "a request over it is refused (400 too_many_image_pixels)",
    )
    max_image_pixels_in_flight: int = setting(
        256_000_000,
        "most pixels of images being decoded at once, all requests together: an online request that would go over "
        "it is answered 429 (image_budget_full), a batch line waits its turn",
    )
    media_fetch_timeout_s: float = setting(
        10.0, "longest an image URL's fetch may take, from its request's first byte to its answer's last"
    )

    @property
    def max_images(self) -> int:
        """Images one prompt may hold (``--limit-mm-per-prompt``)."""
        import json

        value = json.loads(self.limit_mm_per_prompt)
        return int(value.get("image", 0) if isinstance(value, dict) else value)

    def __post_init__(self) -> None:
        from .parsers import reasoning_parser, tool_call_parser

        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.tool_call_parser is not None:
            tool_call_parser(self.tool_call_parser)
        if self.reasoning_parser is not None:
            reasoning_parser(self.reasoning_parser)
        if self.max_request_image_pixels > self.max_image_pixels_in_flight:
            raise ValueError(
                f"--max-request-image-pixels ({self.max_request_image_pixels}) is over --max-image-pixels-in-flight "
                f"({self.max_image_pixels_in_flight}): such a request could never be decoded"
            )
        if not self.media_fetch_timeout_s > 0:  # (NaN too)
            raise ValueError(f"--media-fetch-timeout-s must be positive, not {self.media_fetch_timeout_s:g}")
        try:
            self.max_images  # noqa: B018 (parsed once here, so a bad value is a usage error at start)
        except (ValueError, TypeError, AttributeError):
            raise ValueError(
                f"--limit-mm-per-prompt {self.limit_mm_per_prompt!r}: give a number or JSON such as '{{\"image\": 4}}'"
            ) from None
