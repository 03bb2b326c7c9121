"""Where image bytes may come from, without a server: remote URLs only over https from the allowed hosts (the
callbacks' SSRF guard), run-batch's local paths only under their folder, data URLs checked before decoding."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from batchgen.server.media import ImageSources, MediaError, MediaLimits


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("http://images.example/a.png", "must be https"),
        ("https://evil.example/a.png", "not on this server's list"),
        ("https://images.example.evil.example/a.png", "not on this server's list"),
        ("https://user:pw@images.example/a.png", "credentials"),
        ("ftp://images.example/a.png", "must be https"),
    ],
)
def test_remote_urls_pass_the_ssrf_guard(url: str, said: str) -> None:
    sources = ImageSources(MediaLimits(), allowed_domains=("images.example",))
    with pytest.raises(MediaError) as refused:
        sources.url(url, "p")
    assert said in refused.value.message and refused.value.param == "p"


def test_no_remote_urls_by_default() -> None:
    with pytest.raises(MediaError) as refused:
        ImageSources(MediaLimits()).url("https://images.example/a.png", "p")
    assert "--allowed-media-domains" in refused.value.message


def test_local_paths_only_under_their_folder(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.png").write_bytes(b"x")
    (tmp_path / "secret.png").write_bytes(b"y")
    sources = ImageSources(MediaLimits(), local_root=str(tmp_path / "in"))
    assert sources.url(f"file://{tmp_path}/in/a.png", "p") == b"x"
    for escape in (f"file://{tmp_path}/in/../secret.png", f"file://{tmp_path}/secret.png"):
        with pytest.raises(MediaError):
            sources.url(escape, "p")
    with pytest.raises(MediaError):
        ImageSources(MediaLimits()).url(f"file://{tmp_path}/in/a.png", "p")  # off unless a folder is allowed


@pytest.mark.parametrize("name", ["a.png%00.jpg", "a.png\x00", "x" * 5_000 + ".png"])
def test_a_path_no_file_can_have_is_an_invalid_url_not_a_500(tmp_path: Path, name: str) -> None:
    """An embedded NUL (``%00``: ``ValueError`` from the file system calls) or a name too long (``OSError``)."""
    (tmp_path / "a.png").write_bytes(b"x")
    with pytest.raises(MediaError) as refused:
        ImageSources(MediaLimits(), local_root=str(tmp_path)).url(f"file://{tmp_path}/{name}", "p")
    assert refused.value.code == "invalid_image_url"


def test_data_urls_are_sized_before_decoding() -> None:
    sources = ImageSources(MediaLimits(max_image_bytes=30))
    assert sources.url("data:image/png;base64," + base64.b64encode(b"a" * 30).decode(), "p") == b"a" * 30
    with pytest.raises(MediaError) as refused:
        sources.url("data:image/png;base64," + "A" * 400, "p")
    assert refused.value.code == "image_too_large"


def test_fetch_from_an_allowed_host_no_redirects_and_a_size_cap() -> None:
    """The fetch itself (httpx's transport mocked by respx: no TLS server here): the bytes of a 200, a redirect not
    followed, a body over the cap cut off."""
    import respx
    from httpx import Response

    sources = ImageSources(MediaLimits(max_image_bytes=100), allowed_domains=("images.example",))
    with respx.mock(assert_all_called=True) as mock:
        mock.get("https://images.example/a.png").mock(return_value=Response(200, content=b"picture"))
        mock.get("https://images.example/moved.png").mock(
            return_value=Response(302, headers={"location": "https://evil.example/"})
        )
        mock.get("https://images.example/big.png").mock(return_value=Response(200, content=b"x" * 101))
        assert sources.url("https://images.example/a.png", "p") == b"picture"
        for url, code in (("moved.png", "image_fetch_failed"), ("big.png", "image_too_large")):
            with pytest.raises(MediaError) as refused:
                sources.url(f"https://images.example/{url}", "p")
            assert refused.value.code == code
