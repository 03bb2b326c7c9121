"""Pictures and image hosts that never exhaust or starve the server, on a tiny LLaVA (CLIP's processor scales a
picture's shortest side up to its tower's size) behind two API keys: a thin picture is refused from its header
(1 x 400,000 took 8 GB), a request's pictures within a pixel budget of their own and all requests' within the
server's (8 of 6000 x 6000 took 4-5 GB, 5 at once killed it), their memory given back after; an allowed host that
drips its answer is cut off at the fetch deadline (it held a fetch for minutes), and neither its online requests nor
its batch lines hold another tenant's."""

from __future__ import annotations

import base64
import io
import ssl
import threading
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image
from server_helpers import TENANT_KEYS, LiveServer, ServerProcess, chat_line, jsonl
from vlm_helpers import data_url, llava, png_bytes

FETCH_TIMEOUT_S = 5.0
WINDOW = 12
"""The engine's window of batch lines here: tenant A's dripping lines outnumber it."""
REQUEST_PIXELS = 80_000_000
"""The server's budgets here: two 6000 x 6000 pictures a request, one such request decoded at a time."""
BLACK_36MP = data_url(Image.new("RGB", (6000, 6000)))
"""A data URL of 100 KB of PNG, 108 MB once decoded."""


def _chat(*urls: str, **body: Any) -> dict[str, Any]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    content = [*parts, {"type": "text", "text": "what is it?"}]
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **body}


@dataclass
class ImageHost:
    """An https host on loopback, its certificate for ``localhost`` from a test CA (``ca_file``): ``/drip.png``
    sends its answer's head one byte a second and never ends, whatever its query; ``/picture.png`` answers a picture
    at once."""

    base_url: str
    ca_file: Path


@pytest.fixture(scope="module")
def image_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ImageHost]:
    import trustme

    ca = trustme.CA()
    picture = png_bytes(Image.new("RGB", (64, 48), (40, 120, 200)))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if urllib.parse.urlsplit(self.path).path == "/drip.png":
                try:
                    for byte in b"HTTP/1.1 200 OK\r\n" * 100:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(1)
                except OSError:  # the fetch gave up and hung up
                    pass
                self.close_connection = True
                return
            self.send_response(200)
            self.send_header("content-length", str(len(picture)))
            self.end_headers()
            self.wfile.write(picture)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("localhost").configure_cert(context)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ca_file = tmp_path_factory.mktemp("ca") / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    yield ImageHost(f"https://localhost:{server.server_address[1]}", ca_file)
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def local_pictures(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("pictures")
    (folder / "ok.png").write_bytes(png_bytes(Image.new("RGB", (60, 60), (9, 9, 9))))
    return folder


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llava(tmp_path_factory.mktemp("models") / "llava")


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, image_host: ImageHost, local_pictures: Path, llava_path: Path
) -> Iterator[LiveServer]:
    """Tenant A's (``http``); ``--allowed-local-media-path`` given, as run-batch's, without ``--serve-local-media``."""
    flags = [
        "--served-model-name", "m",
        "--allowed-media-domains", "localhost",
        "--media-fetch-timeout-s", str(FETCH_TIMEOUT_S),
        "--max-request-image-pixels", str(REQUEST_PIXELS),
        "--max-image-pixels-in-flight", str(REQUEST_PIXELS),
        "--engine-window", str(WINDOW),
        "--allowed-local-media-path", str(local_pictures),
        "--api-key", TENANT_KEYS[0], "--api-key", TENANT_KEYS[1],
    ]  # fmt: skip
    env = {"SSL_CERT_FILE": str(image_host.ca_file)}
    with ServerProcess(tmp_path_factory.mktemp("server"), *flags, model=str(llava_path), env=env) as process:
        server = LiveServer(process, api_key=TENANT_KEYS[0])
        yield server
        server.http.close()


@pytest.fixture
def tenant_b(server: LiveServer) -> Iterator[LiveServer]:
    other = LiveServer(base_url=server.base_url, api_key=TENANT_KEYS[1])
    yield other
    other.http.close()


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


def test_a_picture_from_an_allowed_host_is_fetched_and_its_url_not_logged(
    server: LiveServer, image_host: ImageHost
) -> None:
    """httpx logged each fetch's URL at INFO, a signed URL's signature with it."""
    url = f"{image_host.base_url}/picture.png?signature=s3cr3t"
    response = server.http.post("/v1/chat/completions", json=_chat(url))
    assert response.status_code == 200, response.text
    assert "s3cr3t" not in server.process.log_path.read_text()  # type: ignore[union-attr]


def test_a_thin_picture_is_refused_from_its_header(server: LiveServer) -> None:
    """1 x 400,000 pixels (1,630 bytes of PNG, 1% of --max-image-pixels): CLIP's processor would make it
    56 x 22,400,000. Refused before anything is decoded, the server's memory as it was."""
    thin = Image.new("RGB", (1, 400_000))
    server.reset_peak_memory()
    before = server.memory_mib()
    error = _error(server.http.post("/v1/chat/completions", json=_chat(data_url(thin))), 400)
    assert (error["code"], error["param"]) == ("image_too_large", "messages[0].content[0].image_url.url")
    assert "200:1" in error["message"]
    assert server.memory_mib("VmHWM") - before < 1024


def test_a_picture_counts_what_the_processor_resizes_it_to(llava_path: Path) -> None:
    """CLIP's processor scales the shortest side to 56 here (336 in LLaVA-1.5): 5 x 1,000 pixels are held as
    56 x 11,200; Qwen2-VL's resizes within its own pixel budget, so a picture counts its own pixels there."""
    from vlm_helpers import qwen2_5_vl

    from batchgen.server.serving.image_processor import ImageProcessor

    clip = ImageProcessor(str(llava_path), None)
    assert clip.processed_pixels(5, 1_000) == clip.processed_pixels(1_000, 5) == 56 * 11_200
    assert clip.processed_pixels(600, 400) == 600 * 400  # scaled down: its own pixels are the most held
    qwen = ImageProcessor(str(qwen2_5_vl(llava_path.parent / "qwen")), None)
    assert qwen.processed_pixels(5, 1_000) == 5_000


def test_a_request_over_its_pixel_budget_is_a_400_naming_it(server: LiveServer) -> None:
    """8 pictures of 6000 x 6000 (a 1.1 MB body): 288 M pixels, over the request's 80 M; nothing decoded."""
    before = server.memory_mib()
    server.reset_peak_memory()
    error = _error(server.http.post("/v1/chat/completions", json=_chat(*[BLACK_36MP] * 8)), 400)
    assert (error["code"], error["param"]) == ("too_many_image_pixels", "messages")
    assert "--max-request-image-pixels" in error["message"]
    assert server.memory_mib("VmHWM") - before < 300


def test_requests_within_the_servers_budget_take_turns_and_give_their_memory_back(server: LiveServer) -> None:
    """Three requests of two 36 MP pictures at once, with room for one: one is decoded, the others are answered
    429 (Retry-After) while it holds the room; the server's peak stays within one request's pictures, and the
    memory is given back after. Measured over a round after a first: +139 MB (a thread's malloc arena keeps ~70 MB of
    its own), a plateau over the next; without giving it back, +483 MB after one, +1 GB after four."""
    body = _chat(BLACK_36MP, BLACK_36MP)

    def round_of_three() -> list[httpx.Response]:
        with ThreadPoolExecutor(3) as pool:
            return list(pool.map(lambda _: server.http.post("/v1/chat/completions", json=body), range(3)))

    round_of_three()  # what a first round's threads and the vision tower keep
    before = server.memory_mib()
    server.reset_peak_memory()
    answers = round_of_three()
    statuses = sorted(answer.status_code for answer in answers)
    assert statuses[0] == 200 and statuses[-1] == 429, [answer.text for answer in answers]  # [200, 429, 429] at once
    busy = next(answer for answer in answers if answer.status_code == 429)
    assert busy.json()["error"]["code"] == "image_budget_full" and busy.headers["retry-after"] == "1"
    assert server.memory_mib("VmHWM") - before < 1200  # 72 M pixels decoded: ~10 bytes each at the peak (710 MB)
    assert server.memory_mib() - before < 250
    # A batch line waits for room where an online request is refused: both lines are answered.
    lines = [chat_line(f"two-{i}", **body) for i in range(2)]
    batch = server.run(lines)
    assert batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0}, batch


def test_a_dripping_host_is_cut_off_at_the_deadline_and_holds_no_other_tenant(
    server: LiveServer, tenant_b: LiveServer, image_host: ImageHost
) -> None:
    """Six chats of tenant A name a host that sends its answer's head a byte a second: each is answered 400 within
    the fetch deadline (5 s here), and meanwhile every call of tenant B is answered within 2 s."""
    drip = _chat(f"{image_host.base_url}/drip.png")
    picture = data_url(Image.new("RGB", (60, 60)))
    started = time.monotonic()
    with ThreadPoolExecutor(6) as pool:
        dripping = [pool.submit(server.http.post, "/v1/chat/completions", json=drip) for _ in range(6)]
        time.sleep(0.5)  # they are fetching
        calls = {
            "models": lambda: tenant_b.http.get("/v1/models"),
            "files": lambda: tenant_b.http.get("/v1/files"),
            "batches": lambda: tenant_b.http.get("/v1/batches"),
            "upload": lambda: tenant_b.http.post(
                "/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", jsonl([chat_line("b")]))}
            ),
            "chat": lambda: tenant_b.http.post("/v1/chat/completions", json=_chat(picture)),
            "metrics": lambda: tenant_b.http.get("/metrics"),
        }
        for name, call in calls.items():
            called = time.monotonic()
            response = call()
            assert response.status_code < 500 and time.monotonic() - called < 2, (name, response.text)
        for future in dripping:
            error = _error(future.result(), 400)
            assert error["code"] == "image_fetch_failed" and "5 s" in error["message"]
    assert time.monotonic() - started < FETCH_TIMEOUT_S + 3
    # More pictures than a prompt takes are refused before any is fetched (one fetched would hold it 5 s).
    many = _chat(*[f"{image_host.base_url}/drip.png?{i}" for i in range(9)])
    called = time.monotonic()
    error = _error(server.http.post("/v1/chat/completions", json=many), 400)
    assert error["code"] == "too_many_images" and time.monotonic() - called < 2


def test_a_slow_line_of_one_tenant_holds_no_batch_of_another(
    server: LiveServer, tenant_b: LiveServer, image_host: ImageHost
) -> None:
    """Tenant A's batch of 14 lines names the dripping host, more than the window of 12 places; tenant B's batch,
    created after it, completes within the fetch deadline while A's lines wait for their pictures: A holds at most 8
    places with them. Before, one FIFO preparation thread held B's batch 62 s behind a single such line, and A's
    lines would have taken every place until their deadline."""
    drip = _chat(f"{image_host.base_url}/drip.png")
    slow = server.create_batch(server.upload([chat_line(f"slow-{i}", **drip) for i in range(14)])["id"])
    time.sleep(0.5)  # A's lines are taken and fetching
    picture = data_url(Image.new("RGB", (60, 60), (200, 10, 10)))
    started = time.monotonic()
    fast = tenant_b.run([chat_line(f"fast-{i}", **_chat(picture)) for i in range(2)])
    assert fast["request_counts"] == {"total": 2, "completed": 2, "failed": 0}, fast
    assert time.monotonic() - started < FETCH_TIMEOUT_S - 1
    assert server.batch(slow["id"])["status"] == "in_progress"
    cancelled = server.http.post(f"/v1/batches/{slow['id']}/cancel")  # (its lines' own failure: the online test's)
    assert cancelled.status_code == 200


def test_local_files_are_run_batchs_unless_the_server_is_told(server: LiveServer, local_pictures: Path) -> None:
    """--allowed-local-media-path opens its folder to run-batch: serve's callers read it only with
    --serve-local-media (not given here), online or in their batches."""
    error = _error(server.http.post("/v1/chat/completions", json=_chat(f"file://{local_pictures}/ok.png")), 400)
    assert (error["code"], error["param"]) == ("invalid_image_url", "messages[0].content[0].image_url.url")
    assert "--serve-local-media" in error["message"]


def test_a_jpeg_cut_short_is_an_invalid_image(server: LiveServer) -> None:
    """A JPEG whose header says 6000 x 6000 and whose data is an 8 x 8 picture's: libjpeg would pad it with grey."""
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(out, format="JPEG")
    data = bytearray(out.getvalue())
    frame = data.index(b"\xff\xc0")
    data[frame + 5 : frame + 9] = (6000).to_bytes(2, "big") * 2
    jpeg = "data:image/jpeg;base64," + base64.b64encode(bytes(data)).decode()
    error = _error(server.http.post("/v1/chat/completions", json=_chat(jpeg)), 400)
    assert error["code"] == "invalid_image" and "cut short" in error["message"]
