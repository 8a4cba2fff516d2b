"""http(s) image URLs: only configured hosts, no redirects, a byte cap and a deadline."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from embedmesh.core.errors import InvalidArgument
from embedmesh.vision.fetch import fetch_image, is_http_url

FIELD = "messages[0].content[0].image_url"
BODY = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/cat.png":
            self.send_response(200)
            self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY)
        elif self.path == "/undeclared.png":  # no Content-Length: the cap is applied while reading
            self.send_response(200)
            self.end_headers()
            self.wfile.write(BODY)
        elif self.path == "/away":
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/latest/meta-data")
            self.end_headers()
        else:
            self.send_response(404)
            self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def fetch(url: str, hosts: tuple[str, ...] = ("127.0.0.1",), max_bytes: int = 1 << 20) -> bytes:
    return fetch_image(url, FIELD, hosts=hosts, max_bytes=max_bytes, timeout_seconds=5)


def refusal(url: str, **kw: object) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as e:
        fetch(url, **kw)  # type: ignore[arg-type]
    assert e.value.field == FIELD and e.value.message.startswith(FIELD)
    return e.value


def test_an_allowed_host_is_fetched(server: str) -> None:
    assert fetch(f"{server}/cat.png") == BODY


def test_no_hosts_configured_refuses_every_url(server: str) -> None:
    assert refusal(f"{server}/cat.png", hosts=()).reason == "URL_NOT_ALLOWED"


def test_a_host_not_listed_is_refused(server: str) -> None:
    e = refusal(f"{server}/cat.png", hosts=("images.example.com",))
    assert e.reason == "URL_NOT_ALLOWED" and "127.0.0.1" in e.message


def test_redirects_are_not_followed(server: str) -> None:
    e = refusal(f"{server}/away")
    assert e.reason == "FETCH_FAILED" and "302" in e.message


def test_over_the_cap_is_refused_declared_or_not(server: str) -> None:
    assert refusal(f"{server}/cat.png", max_bytes=100).reason == "TOO_LARGE"
    assert refusal(f"{server}/undeclared.png", max_bytes=100).reason == "TOO_LARGE"


def test_http_errors_are_refusals(server: str) -> None:
    assert refusal(f"{server}/missing.png").reason == "FETCH_FAILED"


def test_is_http_url() -> None:
    assert is_http_url("https://x/y") and is_http_url("HTTP://x/y")
    assert not is_http_url("data:image/png;base64,") and not is_http_url("file:///etc/passwd")
