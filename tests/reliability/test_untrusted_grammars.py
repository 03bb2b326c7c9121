"""A grammar that crashes llguidance's native compiler costs that grammar alone: each is compiled first in a child
process (``security/grammar_probe.py``), so 3,000 chained Lark rules, which overflowed the server's stack and
segfaulted it, are a 400 ``invalid_grammar`` while every tenant goes on being served; what the child takes, the
engine's compile threads (four times its stack) compile."""

from __future__ import annotations

import json
import sys
from typing import Any

import llguidance
import pytest
from server_helpers import TENANT_KEYS, LiveServer, chat_line

from batchgen.server.engine.loading.demo_model import build_tokenizer
from batchgen.server.engine.sampling import grammar as engine_grammar
from batchgen.server.security.grammar_probe import PROBE_STACK_BYTES, GrammarProbe, Verdict


def chained_rules(n: int) -> str:
    """``n`` Lark rules, each optionally followed by the next: compiling it recurses ``n`` deep."""
    rules = [f'r{i}: "t{i}" r{i + 1}?' for i in range(n)]
    return "\n".join(["start: r0", *rules, f'r{n}: "end"'])


def chained_refs(n: int) -> dict[str, Any]:
    """A JSON schema whose ``$ref``\\ s chain ``n`` definitions deep."""
    defs: dict[str, Any] = {
        f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["a"]}
        for i in range(n)
    }
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def _chat(**body: Any) -> dict[str, Any]:
    return {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **body}


CRASHING = [
    ({"structured_outputs": {"grammar": chained_rules(3_000)}}, "structured_outputs"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": chained_refs(2_000)}}},
        "response_format",
    ),
]


@pytest.mark.parametrize(("constraint", "param"), CRASHING, ids=["lark-chain", "ref-chain"])
def test_a_grammar_that_crashes_the_compiler_is_a_400_and_every_tenant_is_served(
    keyed_server: LiveServer, constraint: dict[str, Any], param: str
) -> None:
    """Both crashed the compiler in process (measured: a segfault 0.17 s after the request). Tenant A's request is
    refused by name, and tenant B, then A, are served by the same server."""
    refused = keyed_server.http.post("/v1/chat/completions", json=_chat(**constraint))
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_grammar", param)
    assert "crashed the grammar compiler" in error["message"]
    other = {"Authorization": f"Bearer {TENANT_KEYS[1]}"}
    assert keyed_server.http.post("/v1/chat/completions", json=_chat(), headers=other).status_code == 200
    assert keyed_server.http.post("/v1/chat/completions", json=_chat()).status_code == 200


def test_a_crashing_grammar_in_a_batch_is_its_lines_error_and_the_batch_completes(keyed_server: LiveServer) -> None:
    crash = chat_line("crash", structured_outputs={"grammar": chained_rules(3_000)})
    lines = [chat_line("ok-1"), crash, chat_line("ok-2")]
    batch = keyed_server.run(lines)
    assert batch["status"] == "completed" and batch["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    errors = [json.loads(line) for line in keyed_server.raw(batch["error_file_id"]).splitlines()]
    assert [(e["custom_id"], e["response"]["body"]["error"]["code"]) for e in errors] == [("crash", "invalid_grammar")]


def test_the_probe_outlives_its_children() -> None:
    """A child that crashes, or runs past the time limit, is killed and replaced: the next grammar is checked. A
    crash is the grammar's own verdict (remembered); a time limit run out is not (the machine may have been busy)."""
    probe = GrammarProbe(timeout_s=30)
    fine = llguidance.grammar_from("regex", "[a-z]+")
    try:
        crashed = probe.verdict(llguidance.grammar_from("grammar", chained_rules(3_000)))
        assert "crashed" in crashed.problem and crashed.lasting
        assert probe.verdict(fine) == Verdict("")
        assert "unknown name" in probe.verdict(llguidance.grammar_from("grammar", "start: nowhere")).problem
        probe.close()
        command, probe.command = probe.command, [sys.executable, "-c", SILENT_CHILD]
        probe.timeout_s = 0.5
        assert probe.verdict(fine) == Verdict("it did not compile within 0.5 s", lasting=False)
        probe.command, probe.timeout_s = command, 30
        assert probe.verdict(fine) == Verdict("")
    finally:
        probe.close()


SILENT_CHILD = "import sys, time; sys.stdout.buffer.write(b'\\x01'); sys.stdout.flush(); time.sleep(60)"
"""A child that says it is ready, then never answers."""


def test_what_the_probe_takes_the_engine_compiles() -> None:
    """The engine compiles on threads of four times the probe's stack: a grammar near the probe's limit (it takes
    1,200 chained rules on 4 MiB: ~3 KB a rule) compiles there, in this process."""
    assert engine_grammar.COMPILE_STACK_BYTES >= 4 * PROBE_STACK_BYTES
    grammar = llguidance.grammar_from("grammar", chained_rules(1_200))
    probe = GrammarProbe(timeout_s=30)
    try:
        assert probe.verdict(grammar) == Verdict("")
    finally:
        probe.close()
    tokenizer = build_tokenizer()
    compiler = engine_grammar.GrammarCompiler(tokenizer, len(tokenizer), timeout_s=30)
    assert not compiler.compile(grammar).is_error()
