"""A request's output constraint as an llguidance grammar: its ``response_format``, vLLM's ``structured_outputs``, a
``tool_choice`` that forces a call, or its batch's default ``response_format``; each checked here, so that a schema
the grammar cannot enforce is refused with the request's own error, naming the field and the cause.

JSON grammars allow at most ``WHITESPACE`` between tokens: a random-weight model (or a confused one) would otherwise
fill its budget with spaces and newlines, and its JSON would never end.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import llguidance
from llguidance import LLMatcher

from batchgen.schemas import (
    ChatCompletionRequest,
    ChatTool,
    CompletionRequest,
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputs,
)

from ..engine.request import MAX_REASON_CHARS, grammar_key
from ..security.grammar_probe import GrammarProbe
from .errors import RequestRejected

WHITESPACE = r"(\x0D?\x0A)?[\x20\x09]{0,20}"
"""JSON's optional whitespace at each place: a space, or a newline and the indentation of a pretty-printed document
(ten levels of two spaces)."""
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
"""The arguments of a function declared without ``parameters``: ``{}``."""


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    grammar: str
    """llguidance's grammar text, also the compiled grammar's cache key."""
    param: str
    """The request field it comes from."""


def output_constraint(
    body: ChatCompletionRequest | CompletionRequest,
    default: ResponseFormat | None,
    tokens: Mapping[str, int] = MappingProxyType({}),
) -> OutputConstraint | None:
    """The grammar every token of ``body``'s output must follow (``None``: unconstrained); ``default`` is its batch's
    ``response_format``, for a request that sets no constraint of its own; ``tokens``: the tokenizer's added tokens
    (markers such as ``<tool_call>``) by their text. ``RequestRejected`` when it cannot be enforced. ``body`` has
    passed ``request_problem`` (one constraint at most, a named tool among the tools)."""
    build: Callable[[], str | None]
    if isinstance(body, ChatCompletionRequest) and body.tools and body.tool_choice not in (None, "none", "auto"):
        tools, choice, parallel = body.tools, body.tool_choice, body.parallel_tool_calls
        build, param = lambda: _tool_grammar(tools, choice, parallel), "tool_choice"
    elif (outputs := body.structured_outputs) is not None:
        build, param = lambda: _structured_grammar(outputs, tokens), "structured_outputs"
    elif (response_format := default if body.response_format is None else body.response_format) is not None:
        build, param = lambda: _format_grammar(response_format), "response_format"
    else:
        return None
    return _checked(build, param)


def format_constraint(response_format: ResponseFormat) -> OutputConstraint | None:
    """The grammar of a ``response_format`` (a batch's default is checked when the batch is created)."""
    return _checked(lambda: _format_grammar(response_format), "response_format")


def _checked(build: Callable[[], str | None], param: str) -> OutputConstraint | None:
    try:
        grammar = build()
    except ValueError as exc:  # llguidance could not read it (a number past a float's range, say)
        raise RequestRejected("invalid_grammar", f"{param} cannot be enforced: {exc}", param) from None
    except RecursionError:  # the schema's walk (closed_objects, json.dumps) past Python's own depth
        raise RequestRejected("invalid_grammar", f"{param} cannot be enforced: it nests too deeply", param) from None
    if grammar is None:
        return None
    if problem := grammar_problem(grammar):
        raise RequestRejected("invalid_grammar", f"{param} cannot be enforced: {problem}", param)
    return OutputConstraint(grammar, param)


PROBLEMS_KEPT = 1024
_problems: OrderedDict[bytes, str] = OrderedDict()
_problems_lock = threading.Lock()
_probe = GrammarProbe(timeout_s=10.0)
"""The process's: its children serve every request's grammars (``set_grammar_timeout``: the engine's limit)."""


def set_grammar_timeout(timeout_s: float) -> None:
    """The longest a grammar's check may take (``--grammar-timeout-s``, the engine's own compile limit)."""
    _probe.timeout_s = timeout_s


def stop_grammar_probes() -> None:
    """The idle probing children stopped (a server's shutdown); the next grammar checked starts another."""
    _probe.close()


def grammar_problem(grammar: str) -> str:
    """Why llguidance cannot build ``grammar`` (``""``: it can), compiled in a process of its own (``GrammarProbe``:
    a grammar may crash the compiler); each grammar checked once (a batch repeats its schema on every line),
    remembered by its text's hash (the text of what was refused is not kept), the reason cut short (llguidance's
    may quote the grammar). Without the tokenizer: the engine compiles it against the vocabulary."""
    key = grammar_key(grammar)
    with _problems_lock:
        if (problem := _problems.get(key)) is not None:
            _problems.move_to_end(key)
            return problem
    verdict = _probe.verdict(grammar)
    problem = verdict.problem[:MAX_REASON_CHARS]
    if verdict.lasting:
        with _problems_lock:
            _problems[key] = problem
            while len(_problems) > PROBLEMS_KEPT:
                _problems.popitem(last=False)
    return problem


def _format_grammar(response_format: ResponseFormat) -> str | None:
    if response_format.type == "json_object":
        return json_grammar({"type": "object"}, lenient=False)
    if response_format.type == "json_schema":
        if (json_schema := response_format.json_schema) is None:  # a batch's default (request_problem: a request's)
            raise RequestRejected(
                "invalid_value", "it is required when 'type' is 'json_schema'", "response_format.json_schema"
            )
        schema = {} if json_schema.schema_ is None else json_schema.schema_
        return json_grammar(schema, lenient=not json_schema.strict)
    return None


def _structured_grammar(outputs: StructuredOutputs, tokens: Mapping[str, int]) -> str:
    options: dict[str, Any] = {"whitespace_pattern": outputs.whitespace_pattern or WHITESPACE}
    if outputs.disable_any_whitespace:
        options = {"whitespace_flexible": False}
    if outputs.json is not None:
        schema = outputs.json if isinstance(outputs.json, dict) else _parsed(outputs.json, "structured_outputs.json")
        return json_grammar(schema, lenient=False, options=options)
    if outputs.json_object:
        return json_grammar({"type": "object"}, lenient=False, options=options)
    if outputs.regex is not None:
        return LLMatcher.grammar_from_regex(outputs.regex)
    if outputs.choice is not None:
        return llguidance.grammar_from("choice", outputs.choice)  # type: ignore[arg-type]  # it takes a list too
    if outputs.grammar is not None:
        try:
            return llguidance.grammar_from("grammar", outputs.grammar)
        except ValueError as exc:  # GBNF that does not convert to Lark
            raise RequestRejected("invalid_grammar", str(exc), "structured_outputs.grammar") from None
    assert outputs.structural_tag is not None  # request_problem: exactly one is set
    return _structural_tag_grammar(outputs.structural_tag, tokens)


def _structural_tag_grammar(text: str, tokens: Mapping[str, int]) -> str:
    """vLLM's structural tag (``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``): free text in which
    each structure, once its trigger is written, follows its schema up to its end. Written as llguidance's Lark (its
    ``StructTag`` does the same) with each marker that is one token of the tokenizer (``<tool_call>``) named by its id:
    llguidance reads such a token as special, and a quoted literal of its text could not match it."""
    param = "structured_outputs.structural_tag"
    spec = _parsed(text, param)
    try:
        triggers = [str(trigger) for trigger in spec["triggers"]]
        rules = []
        for index, structure in enumerate(spec["structures"]):
            begin, end = str(structure["begin"]), str(structure["end"])
            trigger = next((t for t in triggers if t and begin.startswith(t)), None)
            if trigger is None:
                raise RequestRejected("invalid_grammar", f"no trigger begins the structure {begin!r}", param)
            schema = {"x-guidance": {"whitespace_pattern": WHITESPACE}, **structure["schema"]}
            body = f"{_literal(begin[len(trigger) :], tokens)} %json {json.dumps(schema)} {_literal(end, tokens)}"
            if trigger in tokens:
                rules.append(f"tag_{index}: TAG_TEXT {_literal(trigger, tokens)} {body}")
            else:  # a trigger of several tokens: found lazily in the free text
                rules += [f"tag_{index}_trigger[lazy]: TAG_TEXT {_literal(trigger, tokens)}", f"tag_{index}: "
                          f"tag_{index}_trigger {body}"]  # fmt: skip
    except (KeyError, TypeError, AttributeError) as exc:
        raise RequestRejected(
            "invalid_grammar",
            f'it must be {{"structures": [{{"begin", "schema", "end"}}], "triggers": [...]}} ({exc!r})',
            param,
        ) from None
    if not rules:
        raise RequestRejected("invalid_grammar", "it has no structures", param)
    tags = " | ".join(f"tag_{index}" for index in range(len(spec["structures"])))
    return "\n".join(["%llguidance {}", f"start: ({tags})* TAG_TEXT", r"TAG_TEXT: /(.|\n)*/", *rules])


def _literal(text: str, tokens: Mapping[str, int]) -> str:
    """``text`` in Lark: quoted, but each marker that is one token named by its id (``<[151657]>``)."""
    if not text:
        return '""'
    pattern = "|".join(map(re.escape, sorted((t for t in tokens if t in text), key=len, reverse=True)))
    parts = re.split(f"({pattern})", text) if pattern else [text]
    return " ".join(f"<[{tokens[part]}]>" if part in tokens else json.dumps(part) for part in parts if part)


def _tool_grammar(tools: list[ChatTool], choice: Any, parallel: bool | None) -> str:
    """A named function: its arguments, as JSON of its ``parameters``. ``required``: a JSON list of one call or more
    (one with ``parallel_tool_calls: false``) ``{"name", "parameters"}`` of any of the tools (vLLM's shape)."""
    functions = {tool.function.name: tool.function for tool in tools}
    if isinstance(choice, NamedToolChoice):
        function = functions[choice.function.name]
        return json_grammar(function.parameters or NO_ARGUMENTS, lenient=not function.strict)
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": function.parameters or NO_ARGUMENTS},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, function in functions.items()
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if parallel is False:
        schema["maxItems"] = 1
    return json_grammar(schema, lenient=not all(function.strict for function in functions.values()))


def json_grammar(schema: dict[str, Any], *, lenient: bool, options: dict[str, Any] | None = None) -> str:
    """``lenient``: keywords llguidance does not implement are ignored (the rest enforced), else refused by name.
    Objects are closed (``closed_objects``)."""
    defaults = {"whitespace_pattern": WHITESPACE} if options is None else options
    compile_options: Any = {**defaults, "lenient": lenient}  # llguidance's JsonCompileOptions
    # As text: llguidance's own conversion of a dict refuses an integer past 64 bits; in JSON text it reads a float.
    return LLMatcher.grammar_from_json_schema(json.dumps(closed_objects(schema)), defaults=compile_options)


SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
"""Keywords whose value maps names to subschemas."""
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
"""Keywords whose value is one subschema (``items`` may be a list of them too)."""


def closed_objects(schema: Any, *, part: bool = False) -> Any:
    """``schema`` with every object that lists ``properties`` (or ``patternProperties``) closed unless it says
    ``additionalProperties`` itself, as xgrammar (vLLM's default backend) reads a schema: a model then ends the
    object after its keys instead of adding keys of its own (pydantic's schemas say nothing). llguidance alone
    would leave such objects open. The walk follows the keywords that hold subschemas, so a property named
    ``properties`` is not taken for the keyword; an ``allOf`` member is a ``part`` of its object, left open (its
    keys add to the others')."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for keyword in SUBSCHEMA_MAPS:
        if isinstance(closed.get(keyword), dict):
            closed[keyword] = {name: closed_objects(sub) for name, sub in closed[keyword].items()}
    for keyword in SUBSCHEMA_LISTS:
        if isinstance(closed.get(keyword), list):
            closed[keyword] = [closed_objects(sub) for sub in closed[keyword]]
    if isinstance(closed.get("allOf"), list):
        closed["allOf"] = [closed_objects(sub, part=True) for sub in closed["allOf"]]
    for keyword in SUBSCHEMAS:
        value = closed.get(keyword)
        if isinstance(value, list):
            closed[keyword] = [closed_objects(sub) for sub in value]
        elif isinstance(value, dict):
            closed[keyword] = closed_objects(value)
    opened = part or any(key in closed for key in ("additionalProperties", "unevaluatedProperties", "allOf"))
    if ("properties" in closed or "patternProperties" in closed) and not opened:
        closed["additionalProperties"] = False
    return closed


def _parsed(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise RequestRejected("invalid_grammar", f"it is not JSON: {exc}", param) from None
