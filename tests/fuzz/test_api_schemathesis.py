"""A bounded schemathesis pass over the live server's own OpenAPI schema: no 5xx, every answer as published.

Valid and invalid requests are generated for every operation; ``benchmarks/fuzz_api.py`` runs the long version
(all phases, minutes).
"""

from __future__ import annotations

from collections.abc import Callable

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance
from server_helpers import LiveServer

API_KEY = "schemathesis-key-0123"
CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance]
EXAMPLES_PER_OPERATION_AND_MODE = 8


def test_no_server_error_and_no_schema_violation(server_factory: Callable[..., LiveServer]) -> None:
    server = server_factory(api_key=API_KEY)
    schema = schemathesis.openapi.from_url(f"{server.base_url}/schema/openapi.json")
    failures: dict[str, str] = {}
    results = list(schema.get_all_operations())
    operations = [result.ok() for result in results if isinstance(result, Ok)]
    assert len(operations) == len(results) >= 12, "every operation of the published schema must be usable"
    for operation in operations:
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=EXAMPLES_PER_OPERATION_AND_MODE,
                deadline=None,
                suppress_health_check=list(HealthCheck),
                database=None,
            )
            def check(case: schemathesis.Case) -> None:
                case.call_and_validate(headers={"Authorization": f"Bearer {API_KEY}"}, checks=CHECKS)

            try:
                check()
            except Unsatisfiable:  # nothing to make invalid (an operation without parameters or body)
                continue
            except (Exception, FailureGroup) as exc:  # FailureGroup is a BaseExceptionGroup
                failures[f"{operation.label} ({mode.value})"] = str(exc)[:2000]
    assert not failures, "\n\n".join(f"{label}:\n{detail}" for label, detail in failures.items())
