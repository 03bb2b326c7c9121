"""A bounded schemathesis pass over the live server's own OpenAPI schema with every check: no 5xx, every answer as
published, valid requests accepted and invalid ones refused, the API key enforced.

Valid and invalid requests are generated for every operation, with the repository's ``schemathesis.toml`` (what the
document cannot state); ``nox -s schemathesis`` runs every phase of the same checks (minutes).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import CHECKS, load_all_checks, max_response_time
from schemathesis.config import SchemathesisConfig
from schemathesis.core.failures import FailureGroup
from schemathesis.core.result import Ok
from server_helpers import LiveServer

API_KEY = "schemathesis-key-0123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CONFIG = Path(__file__).parents[2] / "schemathesis.toml"
EXAMPLES_PER_OPERATION_AND_MODE = 4


def test_every_check_passes(server_factory: Callable[..., LiveServer]) -> None:
    server = server_factory(api_key=API_KEY)
    schema = schemathesis.openapi.from_url(
        f"{server.base_url}/schema/openapi.json", config=SchemathesisConfig.from_path(CONFIG)
    )
    load_all_checks()
    checks = [*CHECKS.get_all(), max_response_time]
    failures: dict[str, str] = {}
    results = list(schema.get_all_operations())
    operations = [result.ok() for result in results if isinstance(result, Ok)]
    assert len(operations) == len(results) >= 12, "every operation of the published schema must be usable"
    for operation in operations:
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            # The key fixed in every case, as the CLI's --header fixes it: no invalid case is made by dropping it.
            @given(case=operation.as_strategy(generation_mode=mode, headers=AUTH))
            @settings(
                max_examples=EXAMPLES_PER_OPERATION_AND_MODE,
                deadline=None,
                suppress_health_check=list(HealthCheck),
                database=None,
            )
            def check(case: schemathesis.Case) -> None:
                # The key named to the checks too: ignored_auth sends the request again without it.
                case.call_and_validate(headers=AUTH, checks=checks)

            try:
                check()
            except Unsatisfiable:  # nothing to make invalid (an operation without parameters or body)
                continue
            except (Exception, FailureGroup) as exc:  # FailureGroup is a BaseExceptionGroup
                failures[f"{operation.label} ({mode.value})"] = str(exc)[:2000]
    assert not failures, "\n\n".join(f"{label}:\n{detail}" for label, detail in failures.items())
