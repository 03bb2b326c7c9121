"""The incremental detokenizer: ``tokenizers``' ``DecodeStream`` (fast tokenizers) gives, token by token, the text the
window decodes through ``tokenizer.decode`` give (slow tokenizers), on the demo model's byte tokenizer, a trained
byte-level BPE and a SentencePiece-style BPE with byte fallback: characters split between tokens, invalid UTF-8,
special tokens kept or skipped, stop strings across tokens, the tail ``finish`` adds."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from batchgen.server.engine.sampling.detokenizer import IncrementalDetokenizer

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "héllo wörld, naïve café déjà vu",
    "中文分词 和 日本語のテキスト",
    "emoji 🙂🚀 and ümlauts äöü",
    '{"key": "value", "n": 12345}',
]


class WindowsOnly:
    """A tokenizer's ``decode`` alone, as a slow tokenizer offers it: the detokenizer then decodes its windows."""

    def __init__(self, tokenizer: Any) -> None:
        self.decode = tokenizer.decode


def byte_level_bpe() -> PreTrainedTokenizerFast:
    """GPT-2's kind, trained here: merges of bytes, so a token may hold part of a character."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def sentencepiece_style() -> PreTrainedTokenizerFast:
    """Llama 2's and Mistral's kind: pieces that start words with "▁", bytes (``<0xE4>``, ordinary tokens) for the
    characters the pieces lack, a decoder that turns "▁" into spaces, fuses bytes into characters and strips the
    first space."""
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=list("▁abcdefghijklmnopqrstuvwxyz,{}:\"'0123456789"),
        limit_alphabet=50,  # the other characters only as bytes
        show_progress=False,
    )
    trained.train_from_iterator(CORPUS * 20, trainer)
    spec = json.loads(trained.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    spec["model"]["byte_fallback"] = True
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def detokenize(tokenizer: Any, ids: list[int], stop: tuple[str, ...], skip: bool, stops_from: int) -> list[str]:
    """The text after each token, up to a stop string (then ``"stop"``), else the text ``finish`` gives."""
    detokenizer = IncrementalDetokenizer(tokenizer, stop, skip)
    texts = []
    for i, token in enumerate(ids):
        stopped = detokenizer.add(token, find_stops=i >= stops_from)
        texts.append(detokenizer.text)
        if stopped:
            return [*texts, "stop"]
    return [*texts, detokenizer.finish()]


@pytest.mark.parametrize("skip", [True, False], ids=["skip-special", "keep-special"])
@pytest.mark.parametrize("kind", ["demo", "byte-level BPE", "sentencepiece-style"])
def test_the_stream_gives_the_windows_text(kind: str, skip: bool, tokenizer: Any) -> None:
    fast = {"demo": lambda: tokenizer, "byte-level BPE": byte_level_bpe, "sentencepiece-style": sentencepiece_style}[
        kind
    ]()
    for text in CORPUS:  # whole characters: the stream serves every token
        detokenizer = IncrementalDetokenizer(fast, (), skip)
        for token in fast.encode(text, add_special_tokens=False):
            detokenizer.add(token)
        assert detokenizer._stream is not None and detokenizer.finish() == text
    rng = random.Random(0)
    specials = fast.all_special_ids
    for _ in range(150):  # random ids: characters split, invalid UTF-8, special tokens anywhere
        ids = rng.choices(range(len(fast)), k=rng.randint(1, 40))
        for _ in range(rng.randint(0, 3)):
            ids.insert(rng.randint(0, len(ids)), rng.choice(specials))
        text = detokenize(WindowsOnly(fast), ids, (), skip, 0)[-1]
        # A stop string of the text's own (most span tokens), looked for from a random token on (min_tokens).
        start = rng.randrange(max(1, len(text) - 2))
        for stop in [(), (text[start : start + rng.randint(1, 4)], "\x00never")]:
            stops_from = rng.randint(0, len(ids))
            expected = detokenize(WindowsOnly(fast), ids, stop, skip, stops_from)
            assert detokenize(fast, ids, stop, skip, stops_from) == expected, (ids, stop)


def test_tokenizers_whose_decode_does_more_keep_the_windows(tokenizer: Any) -> None:
    """A slow tokenizer has no stream; nor does one whose ``decode`` cleans up spaces after its backend's."""
    assert IncrementalDetokenizer(WindowsOnly(tokenizer), ())._stream is None
    cleaning = byte_level_bpe()
    cleaning.clean_up_tokenization_spaces = True
    assert IncrementalDetokenizer(cleaning, ())._stream is None


def test_a_window_the_stream_refuses_is_decoded_as_before() -> None:
    """``DecodeStream`` raises where a window's text does not start with its prefix's: with byte fallback, a byte that
    decoded to a character alone decodes to U+FFFD once the bytes after it make its sequence invalid. The detokenizer
    goes on from there with the windows, from the offsets it kept, as a slow tokenizer does throughout."""
    fast = sentencepiece_style()
    ids = [fast.convert_tokens_to_ids(token) for token in ("a", "<0x78>", "<0xBE>", "<0xE9>", "b")]
    detokenizer = IncrementalDetokenizer(fast, ())
    texts = []
    for token in ids:
        detokenizer.add(token)
        texts.append(detokenizer.text)
    assert detokenizer._stream is None  # refused at the last token
    assert texts == detokenize(WindowsOnly(fast), ids, (), True, 0)[:-1] == ["a", "ax", "ax", "ax", "ax\ufffd\ufffdb"]
    assert detokenizer.finish() == texts[-1]


def test_detokenizer_holds_back_split_characters_and_finds_stops(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, ("wö",))
    ids = tokenizer.encode("héllo wörld")
    fed = 0
    while not detok.add(ids[fed]):
        fed += 1
    assert fed == ids.index(0xB6)  # the stop is found at the last byte of "ö", not before
    assert detok.text == "héllo "
    plain = IncrementalDetokenizer(tokenizer, ())
    for token in ids[:2]:  # "h" and the first byte of "é"
        plain.add(token)
    assert plain.text == "h"
    assert plain.finish() == "h\ufffd"
