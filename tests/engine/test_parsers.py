"""Tool-call and reasoning parsers on golden outputs in each model's own format (from the models' chat templates and
vLLM's parser tests): parsed whole, and streamed in pieces of every size, which must add up to the same."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest

from batchgen.server.serving.parsers import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ParsedDelta,
    ReasoningDelta,
    parse_tool_calls,
    reasoning_parser,
    tool_call_parser,
)

TOOLS = frozenset(
    {"get_weather", "search", "add", "multiply", "get_age", "bash", "send_email", "process_html", "register_user"}
)
WEATHER = {"city": "Oslo", "unit": "celsius"}
NESTED = {"query": {"text": 'Zoë said "hi" \\ — 東京', "filters": [{"k": 1.5}, {"k": [True, None, -2]}]}}
NESTED_JSON = json.dumps(NESTED, ensure_ascii=False)

Case = tuple[str, str, str | None, list[tuple[str, dict[str, Any]]]]
"""Parser name, model output, expected content, expected calls (name, arguments)."""


def hermes(name: str, arguments: str) -> str:
    """A call as the Qwen 2.5/3 and Hermes chat templates render it."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def kimi(name: str, index: int, arguments: str) -> str:
    return f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>{arguments}<|tool_call_end|>"


KIMI_BEGIN, KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_BAD = (
    "I'll help you check the weather. <|tool_calls_section_begin|> <|tool_call_begin|>\nfunctions.get_weather:0 "
    '<|tool_call_argument_begin|> {"city": "Beijing" <|tool_call_end|>'
)

CASES: list[Case] = [
    # Qwen 2.5/3, Hermes
    ("hermes", hermes("get_weather", json.dumps(WEATHER)), None, [("get_weather", WEATHER)]),
    (
        "hermes",
        hermes("get_weather", '{"city": "Oslo"}') + "\n" + hermes("get_weather", '{"city": "Bergen"}'),
        None,
        [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bergen"})],
    ),
    (
        "hermes",
        "I'll check both.\n" + hermes("get_weather", '{"city": "Oslo"}') + "\n" + hermes("search", NESTED_JSON),
        "I'll check both.",
        [("get_weather", {"city": "Oslo"}), ("search", NESTED)],
    ),
    ("hermes", hermes("search", "{}") + "\nDone.", "Done.", [("search", {})]),
    ("hermes", '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}', None, [("search", {"q": "x"})]),  # stop
    ("hermes", hermes("get_weather", '{"city": "Oslo"'), hermes("get_weather", '{"city": "Oslo"'), []),
    ("hermes", hermes("delete_all", "{}"), hermes("delete_all", "{}"), []),
    (
        "hermes",
        hermes("get_weather", "{oops}") + "\n" + hermes("search", '{"q": "</tool"}'),
        hermes("get_weather", "{oops}"),
        [("search", {"q": "</tool"})],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "search", "arguments": {"q": "cut',
        '<tool_call>\n{"name": "search", "arguments": {"q": "cut',
        [],
    ),
    (
        "hermes",
        "Use <b>bold</b>, a < b, and </tool_call> alone.",
        "Use <b>bold</b>, a < b, and </tool_call> alone.",
        [],
    ),
    ("hermes", "", None, []),
    # Llama 3.1-3.3
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}',
        None,
        [("get_weather", WEATHER)],
    ),
    ("llama3_json", '<|python_tag|>{"name": "search", "parameters": ' + NESTED_JSON + "}", None, [("search", NESTED)]),
    (
        "llama3_json",
        '\n{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "search", "arguments": {"q": "a } b { c"}}',
        None,
        [("get_weather", {"city": "Oslo"}), ("search", {"q": "a } b { c"})],
    ),
    ("llama3_json", 'Sure.<|python_tag|>{"name": "search", "parameters": {}}', "Sure.", [("search", {})]),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Oslo"}',
        '{"name": "get_weather", "parameters": {"city": "Oslo"}',
        [],
    ),
    ("llama3_json", '{"answer": 42} is the JSON.', '{"answer": 42} is the JSON.', []),
    ("llama3_json", '{"name": "delete_all", "parameters": {}}', '{"name": "delete_all", "parameters": {}}', []),
    ("llama3_json", "The set {1, 2} has two elements.", "The set {1, 2} has two elements.", []),
    (
        "llama3_json",
        '{"name": "search", "parameters": {"q": "x"}}; and then',
        "; and then",
        [("search", {"q": "x"})],
    ),
    # Mistral: before v11 (a JSON array), v11+ (name[ARGS]{...})
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "mistral",
        'Let me see.[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b": 4}}, '
        '{"arguments":{"name": "John Doe"}, "name": "get_age", "id": "a1B2c3D4e"}]',
        "Let me see.",
        [("add", {"a": 3.5, "b": 4}), ("get_age", {"name": "John Doe"})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]add[ARGS]{"a": 3.5, "b": 4}[TOOL_CALLS]multiply[ARGS]{"a": 3, "b": 6}',
        None,
        [("add", {"a": 3.5, "b": 4}), ("multiply", {"a": 3, "b": 6})],
    ),
    ("mistral", "[TOOL_CALLS]search[CALL_ID]a1B2c3D4e[ARGS]" + NESTED_JSON, None, [("search", NESTED)]),
    ("mistral", '[TOOL_CALLS]add{"a": 3.5, "b": 4}', None, [("add", {"a": 3.5, "b": 4})]),
    (
        "mistral",
        'hi{hi[TOOL_CALLS]bash[ARGS]{"command": "print(\\"hello world!\\")\\nre.compile(r\'{}\')"}',
        "hi{hi",
        [("bash", {"command": "print(\"hello world!\")\nre.compile(r'{}')"})],
    ),
    (
        "mistral",
        'hi{hi[TOOL_CALLS]bash{"command": "print(\\"hello',
        'hi{hi[TOOL_CALLS]bash{"command": "print(\\"hello',
        [],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "add", "arguments": {}}, {"name": "delete_all", "arguments": {}}]',
        '[TOOL_CALLS][{"name": "add", "arguments": {}}, {"name": "delete_all", "arguments": {}}]',
        [],
    ),
    ("mistral", "[TOOL_CALLS]not a call", "[TOOL_CALLS]not a call", []),
    ("mistral", "See [1] and [TOOL] notes [", "See [1] and [TOOL] notes [", []),
    # Llama 3.2 / 4 pythonic
    ("pythonic", '[get_weather(city="Oslo", unit="celsius")]', None, [("get_weather", WEATHER)]),
    (
        "pythonic",
        ' [get_weather(city="Oslo"), search(query={"text": \'Zoë said "hi" \\\\ — 東京\', '
        '"filters": [{"k": 1.5}, {"k": [True, None, -2]}]})]',
        None,
        [("get_weather", {"city": "Oslo"}), ("search", NESTED)],
    ),
    ("pythonic", '<|python_start|>[search(q="x")]<|python_end|>', None, [("search", {"q": "x"})]),
    (
        "pythonic",
        'Let me look.<|python_start|>[search(q="a]b")]<|python_end|>',
        "Let me look.",
        [("search", {"q": "a]b"})],
    ),
    ("pythonic", "[search()]\nDone.", "Done.", [("search", {})]),
    (
        "pythonic",
        r"""[get_weather(city='Martha\'s Vineyard', metric='\"cool units\"')]""",
        None,
        [("get_weather", {"city": "Martha's Vineyard", "metric": '"cool units"'})],
    ),
    (
        "pythonic",
        "<|python_start|>[get_weather(city='LA', metric='C'),register_user(name='Doe', age=9, "
        "address={'city': 'LA', 'state': 'CA'}, role=None, passed_test=True, aliases=['John', 'Johnny'])]",
        None,
        [
            ("get_weather", {"city": "LA", "metric": "C"}),
            (
                "register_user",
                {
                    "name": "Doe",
                    "age": 9,
                    "address": {"city": "LA", "state": "CA"},
                    "role": None,
                    "passed_test": True,
                    "aliases": ["John", "Johnny"],
                },
            ),
        ],
    ),
    ("pythonic", "hello world[get_weather(city='LA')]", "hello world[get_weather(city='LA')]", []),
    ("pythonic", '[get_weather(city="Oslo"]', '[get_weather(city="Oslo"]', []),
    ("pythonic", '[get_weather("Oslo")]', '[get_weather("Oslo")]', []),
    ("pythonic", "[get_weather(city=x)]", "[get_weather(city=x)]", []),
    ("pythonic", '[delete_all(path="/")]', '[delete_all(path="/")]', []),
    ("pythonic", "[1, 2, 3] are numbers.", "[1, 2, 3] are numbers.", []),
    ("pythonic", "Lists look like [search()].", "Lists look like [search()].", []),
    # Kimi K2
    (
        "kimi_k2",
        "I'll help you check the weather. <|tool_calls_section_begin|> <|tool_call_begin|>\nfunctions.get_weather:0 "
        '<|tool_call_argument_begin|> {"city": "Beijing"} <|tool_call_end|> <|tool_call_begin|>\n'
        'functions.get_weather:1 <|tool_call_argument_begin|> {"city": "Shanghai"} <|tool_call_end|> '
        "<|tool_calls_section_end|>",
        "I'll help you check the weather.",
        [("get_weather", {"city": "Beijing"}), ("get_weather", {"city": "Shanghai"})],
    ),
    (
        "kimi_k2",
        KIMI_BEGIN + kimi("search", 0, NESTED_JSON) + kimi("process_html", 1, '{"html": "<div>x</div>"}') + KIMI_END,
        None,
        [("search", NESTED), ("process_html", {"html": "<div>x</div>"})],
    ),
    (
        "kimi_k2",
        KIMI_BEGIN
        + kimi("send_email", 0, '{\n  "to": "a@b.c",\n  "nested": {\n    "k": "v"\n  }\n}')
        + KIMI_END
        + "\nSent.",
        "Sent.",
        [("send_email", {"to": "a@b.c", "nested": {"k": "v"}})],
    ),
    (
        "kimi_k2",
        KIMI_BAD + ' <|tool_call_begin|>\nfunctions.get_weather:1 <|tool_call_argument_begin|> {"city": "Shanghai"} '
        "<|tool_call_end|> <|tool_calls_section_end|>",
        KIMI_BAD,
        [("get_weather", {"city": "Shanghai"})],
    ),
    (
        "kimi_k2",
        KIMI_BEGIN + kimi("delete_all", 0, "{}") + KIMI_END,
        KIMI_BEGIN + kimi("delete_all", 0, "{}") + KIMI_END,
        [],
    ),
    (
        "kimi_k2",
        KIMI_BEGIN + "<|tool_call_begin|>functions.search.0<|tool_call_argument_begin|>{}<|tool_call_end|>",
        KIMI_BEGIN + "<|tool_call_begin|>functions.search.0<|tool_call_argument_begin|>{}<|tool_call_end|>",
        [],
    ),
    ("kimi_k2", "Plain <|answer|> text <", "Plain <|answer|> text <", []),
]


def splits(text: str) -> Iterator[list[str]]:
    """``text`` in pieces of 1, 2, 3 and 7 characters, and of seeded random sizes."""
    for size in (1, 2, 3, 7):
        yield [text[i : i + size] for i in range(0, len(text), size)]
    for seed in range(4):
        rng, pieces, at = random.Random(seed), [], 0
        while at < len(text):
            size = rng.randint(1, 12)
            pieces.append(text[at : at + size])
            at += size
        yield pieces


def assert_no_partial_marker(pieces: list[str], markers: tuple[str, ...]) -> None:
    """Every marker in the pieces' concatenation lies within one piece: none was given out a part at a time."""
    joined, bounds, at = "".join(pieces), set(), 0
    for piece in pieces:
        at += len(piece)
        bounds.add(at)
    for marker in markers:
        found = joined.find(marker)
        while found >= 0:
            assert not any(found < bound < found + len(marker) for bound in bounds), (marker, pieces)
            found = joined.find(marker, found + 1)


def calls_of(deltas: list[ParsedDelta]) -> list[tuple[str, str]]:
    """The calls the deltas give, checking their shape: indexes in order, the name on each call's first delta."""
    calls: list[list[str]] = []
    for call in (call for delta in deltas for call in delta.tool_calls):
        if call.index == len(calls):
            assert call.name is not None
            calls.append([call.name, ""])
        else:
            assert call.index == len(calls) - 1 and call.name is None
        calls[call.index][1] += call.arguments
    return [(name, arguments) for name, arguments in calls]


@pytest.mark.parametrize(
    ("parser", "text", "content", "expected"), CASES, ids=[f"{case[0]}-{i}" for i, case in enumerate(CASES)]
)
def test_tool_calls(parser: str, text: str, content: str | None, expected: list[tuple[str, dict[str, Any]]]) -> None:
    cls = tool_call_parser(parser)
    whole_content, whole_calls = parse_tool_calls(cls(TOOLS), text)
    assert whole_content == content
    assert [(name, json.loads(arguments)) for name, arguments in whole_calls] == expected
    assert all(
        arguments == json.dumps(json.loads(arguments), ensure_ascii=False, separators=(",", ":"))
        for _, arguments in whole_calls
    )
    for pieces in splits(text):
        stream = cls(TOOLS)
        fed = [stream.feed(piece) for piece in pieces]
        deltas = [*fed, stream.finish()]
        streamed = "".join(delta.content for delta in deltas)
        assert (streamed if streamed.strip() else None) == whole_content, pieces
        assert calls_of(deltas) == whole_calls, pieces
        assert_no_partial_marker([delta.content for delta in deltas], cls.markers)


FORMATS = ("hermes", "llama3_json", "mistral", "pythonic", "kimi_k2")
NOISE = (
    '{"name": "search", "arguments": ',
    '{"name": "search", "parameters": ',
    '{"q": "a"}',
    "search(q=1)",
    "search[ARGS]",
    "functions.search:0",
    *"{}[]()\"'\\;,: \nx",
)


@pytest.mark.parametrize("parser", FORMATS)
def test_any_text_streams_as_it_parses_whole(parser: str) -> None:
    """Golden outputs, markers and pieces of the formats in random order: however such a text is split, the stream
    gives what the whole text does."""
    cls = tool_call_parser(parser)
    pool = NOISE + cls.markers + tuple(case[1] for case in CASES if tool_call_parser(case[0]) is cls)
    rng = random.Random(parser)
    for _ in range(100):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(0, 20)))
        content, calls = parse_tool_calls(cls(TOOLS), text)
        assert all(isinstance(json.loads(arguments), dict) for _, arguments in calls)
        for pieces in list(splits(text))[::3]:
            stream = cls(TOOLS)
            deltas = [*(stream.feed(piece) for piece in pieces), stream.finish()]
            streamed = "".join(delta.content for delta in deltas)
            assert ((streamed if streamed.strip() else None), calls_of(deltas)) == (content, calls), pieces
            assert_no_partial_marker([delta.content for delta in deltas], cls.markers)


R1_PROMPT = "<\uff5cAssistant\uff5c>"
QWEN_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"

REASONING_CASES = [
    ("qwen3", QWEN_PROMPT, "<think>\nI should greet.\n</think>\n\nHello!", "I should greet.", "Hello!"),
    ("qwen3", QWEN_PROMPT, "<think>\nStill thinking about </thin", "Still thinking about </thin", ""),
    ("qwen3", QWEN_PROMPT, "<think>\n\n</think>\n\nHi", "", "Hi"),
    ("qwen3", QWEN_PROMPT, "<think>a</think>b</think>c <think>", "a", "b</think>c <think>"),
    ("qwen3", QWEN_PROMPT, " Hello <think> there", "", " Hello <think> there"),
    ("qwen3", QWEN_PROMPT + "<think>\n\n</think>\n\n", "Hi <think>x</think> there", "", "Hi <think>x</think> there"),
    ("qwen3", QWEN_PROMPT + "<think>\n", "Let me see.\n</think>\n\nAnswer", "Let me see.", "Answer"),
    ("qwen3", QWEN_PROMPT + "<think>\n", "Cut off", "Cut off", ""),
    ("qwen3", QWEN_PROMPT, "", "", ""),
    (
        "deepseek_r1",
        R1_PROMPT + "<think>\n",
        "Let me think.\n</think>\n\nThe answer is 4.",
        "Let me think.",
        "The answer is 4.",
    ),
    ("deepseek_r1", R1_PROMPT, "<think>\nhmm < ok\n</think>\n\nok <think>", "hmm < ok", "ok <think>"),
    ("deepseek_r1", R1_PROMPT + "<think>\n", "still thinking </thi", "still thinking </thi", ""),
    ("deepseek_r1", R1_PROMPT + "<think>\n", "</think>Answer", "", "Answer"),
    ("deepseek_r1", R1_PROMPT + "</think>", " Answer </think>", "", "Answer </think>"),
    ("deepseek_r1", R1_PROMPT + "<think>\n", "", "", ""),
]


@pytest.mark.parametrize(
    ("parser", "prompt", "text", "reasoning", "content"),
    REASONING_CASES,
    ids=[f"{case[0]}-{i}" for i, case in enumerate(REASONING_CASES)],
)
def test_reasoning(parser: str, prompt: str, text: str, reasoning: str, content: str) -> None:
    cls = reasoning_parser(parser)
    for pieces in [[text], *splits(text)]:
        stream = cls(prompt)
        fed = [stream.feed(piece) for piece in pieces]
        deltas: list[ReasoningDelta] = [*fed, stream.finish()]
        assert "".join(delta.reasoning for delta in deltas) == reasoning, pieces
        assert "".join(delta.content for delta in deltas) == content, pieces
        assert_no_partial_marker([delta.reasoning for delta in deltas], cls.markers)
        assert_no_partial_marker([delta.content for delta in deltas], cls.markers)


@pytest.mark.parametrize("parser", sorted(REASONING_PARSERS))
def test_any_reasoning_streams_as_it_parses_whole(parser: str) -> None:
    cls = reasoning_parser(parser)
    rng = random.Random(parser)
    for _ in range(150):
        prompt = rng.choice((QWEN_PROMPT, QWEN_PROMPT + "<think>\n", QWEN_PROMPT + "<think>\n\n</think>\n\n"))
        text = "".join(
            rng.choice(("<think>", "</think>", "<", "</thi", " ", "\n", "x")) for _ in range(rng.randint(0, 12))
        )
        whole = cls(prompt)
        expected = [whole.feed(text), whole.finish()]
        for pieces in list(splits(text))[::3]:
            stream = cls(prompt)
            deltas = [*(stream.feed(piece) for piece in pieces), stream.finish()]
            for part in ("reasoning", "content"):
                assert "".join(getattr(d, part) for d in deltas) == "".join(getattr(d, part) for d in expected), pieces


def test_reasoning_streams_as_it_comes() -> None:
    """An unclosed block is reasoning, so nothing waits for ``</think>``."""
    stream = reasoning_parser("deepseek_r1")("<think>\n")
    assert stream.feed("Step one, ") == ReasoningDelta("Step one,", "")
    assert stream.feed("step two") == ReasoningDelta(" step two", "")
    qwen = reasoning_parser("qwen3")(QWEN_PROMPT)
    assert qwen.feed("<think>Step one") == ReasoningDelta("Step one", "")
    assert qwen.feed("</think>Hi") == ReasoningDelta("", "Hi")


def test_a_call_is_given_once_complete() -> None:
    stream = tool_call_parser("hermes")(TOOLS)
    assert stream.feed("Checking <tool_") == ParsedDelta("Checking")
    assert stream.feed('call>\n{"name": "search", "arguments": {"q": 1}}\n</tool_call') == ParsedDelta("")
    delta = stream.feed(">")
    assert delta.content == "" and [(c.index, c.name, c.arguments) for c in delta.tool_calls] == [
        (0, "search", '{"q":1}')
    ]


def test_parsers_by_name() -> None:
    assert set(FORMATS) <= set(TOOL_CALL_PARSERS)
    assert {"qwen3", "deepseek_r1"} <= set(REASONING_PARSERS)
    with pytest.raises(ValueError, match="hermes"):
        tool_call_parser("nope")
    with pytest.raises(ValueError, match="qwen3"):
        reasoning_parser("nope")


@pytest.mark.parametrize("parser", ["hermes", "kimi_k2"])
def test_a_long_call_streamed_in_small_pieces_is_read_once(parser: str) -> None:
    """300,000 characters of arguments in 3-character pieces: while the call is open, a piece without its closing
    marker is only kept (the format's parse runs for the few pieces that may close it), so a call costs time in
    proportion to its length, not to its square."""
    arguments = json.dumps({"text": "x" * 300_000})
    call = hermes("search", arguments) if parser == "hermes" else KIMI_BEGIN + kimi("search", 0, arguments) + KIMI_END
    text = "Let me look. " + call
    stream = tool_call_parser(parser)(TOOLS)
    parses = 0
    region = stream._region

    def counted(*args: Any) -> Any:
        nonlocal parses
        parses += 1
        return region(*args)

    stream._region = counted  # type: ignore[method-assign]
    deltas = [stream.feed(text[i : i + 3]) for i in range(0, len(text), 3)] + [stream.finish()]
    assert "".join(delta.content for delta in deltas) == "Let me look."
    assert calls_of(deltas) == [("search", json.dumps(json.loads(arguments), separators=(",", ":")))]
    assert parses < 50, parses  # of some 100,000 pieces
