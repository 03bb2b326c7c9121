"""Completion callbacks against a real HTTP receiver on 127.0.0.1: delivery, retries, refusals, SSRF policy."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import msgspec
import pytest
from server_helpers import Receiver, Reply

from batchgen.schemas import BatchObject, BatchRequestCounts
from batchgen.server.callbacks import (
    CALLBACK_METADATA_KEY,
    CallbackNotifier,
    CallbackSettings,
    CallbackUrlError,
    check_callback_metadata,
    check_callback_url,
    deliver,
)

MakeReceiver = Callable[[list[Reply]], Receiver]


@pytest.fixture
def receiver_factory() -> Iterator[MakeReceiver]:
    made: list[Receiver] = []

    def make(replies: list[Reply]) -> Receiver:
        made.append(Receiver(replies))
        return made[-1]

    yield make
    for receiver in made:
        receiver.close()


LOOPBACK = frozenset({"127.0.0.1"})
FAST = CallbackSettings(allowed_hosts=LOOPBACK, max_attempts=4, initial_backoff_s=0.05, timeout_s=2.0)


def make_batch(url: str | None) -> BatchObject:
    return BatchObject(
        id="batch_0123456789abcdef",
        endpoint="/v1/chat/completions",
        input_file_id="file-0123456789abcdef",
        completion_window="24h",
        status="completed",
        created_at=1_700_000_000,
        completed_at=1_700_000_060,
        output_file_id="file-00000000000000ff",
        request_counts=BatchRequestCounts(total=3, completed=3, failed=0),
        metadata=None if url is None else {CALLBACK_METADATA_KEY: url, "project": "x"},
    )


def run_deliver(url: str, settings: CallbackSettings = FAST) -> tuple[bool, int, str]:
    async def go() -> tuple[bool, int, str]:
        async with httpx.AsyncClient(follow_redirects=False, trust_env=False) as client:
            outcome = await deliver(client, check_callback_url(url, settings.allowed_hosts), make_batch(url), settings)
        return outcome.delivered, outcome.attempts, outcome.detail

    return asyncio.run(go())


def test_delivers_the_final_batch_object_as_json(receiver_factory: MakeReceiver) -> None:
    receiver = receiver_factory([Reply(204)])
    assert run_deliver(receiver.url + "?token=abc") == (True, 1, "HTTP 204")
    [hit] = receiver.received
    assert hit.path == "/hook?token=abc"
    assert hit.headers["content-type"] == "application/json"
    assert hit.headers["idempotency-key"] == "batch_0123456789abcdef"
    assert hit.headers["user-agent"].startswith("batchgen-callback/")
    sent = msgspec.json.decode(hit.body, type=BatchObject)
    assert sent == make_batch(receiver.url + "?token=abc")
    assert json.loads(hit.body)["request_counts"] == {"total": 3, "completed": 3, "failed": 0}


def test_retries_after_server_errors_with_growing_backoff(receiver_factory: MakeReceiver) -> None:
    receiver = receiver_factory([Reply(500), Reply(503), Reply(200)])
    assert run_deliver(receiver.url) == (True, 3, "HTTP 200")
    assert len({hit.body for hit in receiver.received}) == 1
    first, second, third = (hit.at for hit in receiver.received)
    assert second - first >= 0.05
    assert third - second >= 0.1


def test_gives_up_after_max_attempts(receiver_factory: MakeReceiver) -> None:
    receiver = receiver_factory([Reply(500)])
    assert run_deliver(receiver.url) == (False, 4, "HTTP 500")
    assert len(receiver.received) == 4


@pytest.mark.parametrize("status", [400, 404, 410])
def test_a_refusal_is_not_retried(receiver_factory: MakeReceiver, status: int) -> None:
    receiver = receiver_factory([Reply(status), Reply(200)])
    assert run_deliver(receiver.url) == (False, 1, f"HTTP {status}")
    assert len(receiver.received) == 1


def test_too_many_requests_is_retried(receiver_factory: MakeReceiver) -> None:
    receiver = receiver_factory([Reply(429), Reply(200)])
    assert run_deliver(receiver.url) == (True, 2, "HTTP 200")


def test_a_slow_receiver_times_out_and_is_retried(receiver_factory: MakeReceiver) -> None:
    receiver = receiver_factory([Reply(200, delay_s=1.0), Reply(200)])
    settings = CallbackSettings(allowed_hosts=LOOPBACK, max_attempts=3, initial_backoff_s=0.01, timeout_s=0.2)
    delivered, attempts, _ = run_deliver(receiver.url, settings)
    assert (delivered, attempts) == (True, 2)


def test_connection_refused_is_retried_then_given_up() -> None:
    with socket.socket() as sock:  # a port that was free a moment ago and has no listener now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    delivered, attempts, detail = run_deliver(f"http://127.0.0.1:{port}/hook")
    assert (delivered, attempts) == (False, 4)
    assert detail.startswith("ConnectError")


def test_redirects_are_not_followed(receiver_factory: MakeReceiver) -> None:
    target = receiver_factory([Reply(200)])
    redirecting = receiver_factory([Reply(307, headers={"location": target.url})])
    assert run_deliver(redirecting.url) == (False, 1, "HTTP 307")
    assert target.received == []


def test_the_notifier_delivers_from_any_thread_and_skips_what_it_may_not_send(
    receiver_factory: MakeReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    receiver = receiver_factory([Reply(500), Reply(200)])

    async def go() -> None:
        notifier = CallbackNotifier(FAST)
        await notifier.start()
        senders = [
            threading.Thread(target=notifier.notify, args=(make_batch(receiver.url),)),  # from the writer thread
            threading.Thread(target=notifier.notify, args=(make_batch(None),)),  # no callback asked for
            threading.Thread(target=notifier.notify, args=(make_batch("http://169.254.169.254/latest/"),)),
        ]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join()
        await asyncio.sleep(0)
        await notifier.stop(timeout_s=5)

    with caplog.at_level("INFO", logger="batchgen.server.callbacks"):
        asyncio.run(go())
    assert len(receiver.received) == 2
    assert "callback delivered after 2 attempt(s): HTTP 200" in caplog.text
    assert "not on this server's list of allowed hosts" in caplog.text


def test_stop_cancels_deliveries_that_outlast_the_deadline(receiver_factory: MakeReceiver) -> None:
    receiver = receiver_factory([Reply(500)])
    slow = CallbackSettings(allowed_hosts=LOOPBACK, max_attempts=10, initial_backoff_s=5.0)

    async def go() -> float:
        notifier = CallbackNotifier(slow)
        await notifier.start()
        notifier.notify(make_batch(receiver.url))
        while not receiver.received:
            await asyncio.sleep(0.01)
        started = time.monotonic()
        await notifier.stop(timeout_s=0.2)
        return time.monotonic() - started

    assert asyncio.run(go()) < 2.0
    assert len(receiver.received) == 1


ALLOWED = frozenset({"127.0.0.1", "hooks.example.com", "::1"})


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/cb",
        "http://127.0.0.1:8080/cb?x=1",
        "https://hooks.example.com/batch-done",
        "https://HOOKS.Example.COM./batch-done",
        "http://[::1]:9000/",
    ],
)
def test_allowed_urls(url: str) -> None:
    assert check_callback_url(url, ALLOWED).host.lower().rstrip(".") in {"127.0.0.1", "hooks.example.com", "::1"}


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("ftp://127.0.0.1/cb", "must be http or https"),
        ("file:///etc/passwd", "must be http or https"),
        ("gopher://127.0.0.1:25/", "must be http or https"),
        ("javascript:alert(1)", "must be http or https"),
        ("/relative/path", "must be http or https"),
        ("http://user:secret@127.0.0.1/cb", "credentials"),
        ("http://127.0.0.1@evil.example/cb", "credentials"),
        ("http://evil.example/cb", "not on this server's list"),
        ("http://127.0.0.1.evil.example/cb", "not on this server's list"),
        ("http://hooks.example.com.evil.example/", "not on this server's list"),
        ("http://evil.example#@127.0.0.1/", "not on this server's list"),
        ("http://localhost/cb", "not on this server's list"),
        ("http://2130706433/cb", "not on this server's list"),
        ("http://0x7f.0.0.1/cb", "not on this server's list"),
        ("http://169.254.169.254/latest/meta-data/", "not on this server's list"),
        ("http:///cb", "not on this server's list"),
        ("http://127.0.0.1:abc/cb", "not a valid URL"),
        ("http://127.0.0.1:99999/cb", "port must be from 1 to 65535"),
        ("http://127.0.0.1:0/cb", "port must be from 1 to 65535"),
        ("http://127.0.0.1/cb\r\nX-Injected: 1", "not a valid URL"),
    ],
)
def test_refused_urls(url: str, reason: str) -> None:
    with pytest.raises(CallbackUrlError, match=reason) as raised:
        check_callback_url(url, ALLOWED)
    assert (raised.value.status_code, raised.value.param, raised.value.code) == (
        400,
        "metadata.ds_batch_finish_callback",
        "invalid_value",
    )


def test_callbacks_are_off_by_default() -> None:
    check_callback_metadata(None, CallbackSettings())
    check_callback_metadata({"project": "x"}, CallbackSettings())
    with pytest.raises(CallbackUrlError, match="callbacks are disabled on this server"):
        check_callback_metadata({CALLBACK_METADATA_KEY: "http://127.0.0.1/cb"}, CallbackSettings())
    check_callback_metadata({CALLBACK_METADATA_KEY: "http://127.0.0.1/cb"}, FAST)
