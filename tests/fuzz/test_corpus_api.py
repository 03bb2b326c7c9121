"""The malformed corpus through the real API: each file is refused at upload or fails its batch with its errors.

Upload-level problems (encoding, JSON, limits) answer the upload (422, or 413 for size) with the first one's code;
request-level problems fail the batch at validation with every documented error, line and param.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from server_helpers import LiveServer
from test_corpus import CORPUS, EXPECTED, UPLOAD_CODES

from batchgen.schemas import ENDPOINTS

# The three files that need small limits run on a server started with those limits.
RESTRICTED = {"--max-requests-per-file": "3", "--max-line-bytes": "256", "--max-upload-bytes": "1024"}
RESTRICTED_FILES = {name for name, spec in EXPECTED.items() if spec["limits"]}


def _batch_endpoint(content: bytes, spec: dict[str, Any]) -> str:
    """The endpoint the batch is created for: the documented one, else the first line's url when it is one."""
    if spec["endpoint"]:
        return str(spec["endpoint"])
    try:
        url = json.loads(content.splitlines()[0])["url"]
    except (ValueError, LookupError, TypeError):
        return "/v1/chat/completions"
    return url if url in ENDPOINTS else "/v1/chat/completions"


def _check(server: LiveServer, name: str) -> None:
    spec = EXPECTED[name]
    content = (CORPUS / name).read_bytes()
    upload = server.http.post("/v1/files", data={"purpose": "batch"}, files={"file": (name, content)})
    upload_level = [e for e in spec["errors"] if e["code"] in UPLOAD_CODES]
    if upload_level:
        first = upload_level[0]
        assert upload.status_code == (413 if first["code"] == "file_too_large" else 422), upload.text
        error = upload.json()["error"]
        assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", first["code"], "file")
        if first["line"] is not None:
            assert f"line {first['line']}:" in error["message"]
        return
    assert upload.status_code == 200, upload.text
    created = server.create_batch(upload.json()["id"], endpoint=_batch_endpoint(content, spec))
    batch = server.wait(created["id"])
    assert batch["status"] == "failed", (spec["doc"], batch)
    found = [{"line": e["line"], "code": e["code"], "param": e["param"]} for e in batch["errors"]["data"]]
    assert found == spec["errors"], spec["doc"]
    assert batch["failed_at"] is not None
    assert batch["output_file_id"] is None


# The server serves whatever model the file names consistently; a file whose one model differs from the server's is
# not a validation error there, so the file documented for that case is left to test_corpus.py.
API_FILES = sorted(name for name, spec in EXPECTED.items() if spec["model"] is None and name not in RESTRICTED_FILES)


@pytest.mark.parametrize("name", API_FILES)
def test_each_file_is_refused_with_its_documented_errors(live_server: LiveServer, name: str) -> None:
    _check(live_server, name)


def test_files_over_small_limits_are_refused(server_factory: Callable[..., LiveServer]) -> None:
    server = server_factory(*(item for flag in RESTRICTED.items() for item in flag))
    assert {(k, v) for name in RESTRICTED_FILES for k, v in EXPECTED[name]["limits"].items()} <= {
        ("max_requests", 3),
        ("max_line_bytes", 256),
        ("max_file_bytes", 1024),
    }
    for name in sorted(RESTRICTED_FILES):
        _check(server, name)
