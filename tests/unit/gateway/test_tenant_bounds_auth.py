"""Issue #33 item 6 over a real socket (the gateway's own HTTP protocol, not an in-process transport): with keys on,
``/sleep``, ``/wake_up`` and ``/is_sleeping`` need the key at the gateway, and more than one ``Authorization``
header is a 400 naming it on every route, whichever of them is valid and however its name is spelled."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from embedmesh.core import auth
from tests.unit.gateway.conftest import Harness

KEY = "good-key-123"


@pytest.fixture
def keyed(gw: Harness) -> Iterator[Harness]:
    auth.configure_keys(auth.keyring_from_values(api_keys=f"{KEY}=alpha", admin_keys="adm-key-1234"))
    yield gw
    auth.configure_keys(auth.KeyRing())


ADMIN_ROUTES = [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")]


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
def test_sleep_routes_need_the_key_at_the_gateway(keyed: Harness, method: str, path: str) -> None:
    r = httpx.request(method, f"{keyed.url}{path}", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    assert keyed.fake.requests == []  # refused before anything was forwarded
    r = httpx.request(method, f"{keyed.url}{path}", headers={"Authorization": "Bearer wrong-key-000"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    r = httpx.request(method, f"{keyed.url}{path}", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code != 401, r.text  # past the key, on to the preprocessor (which has its own say)


@pytest.mark.parametrize(("method", "path"), [*ADMIN_ROUTES, ("POST", "/v1/completions"), ("GET", "/v1/models")])
@pytest.mark.parametrize("names", [("Authorization", "Authorization"), ("Authorization", "authorization"),
                                   ("AUTHORIZATION", "Authorization")])
def test_two_authorization_headers_are_a_400(keyed: Harness, method: str, path: str, names: tuple[str, str]) -> None:
    for first, second in ((KEY, "wrong-key-000"), ("wrong-key-000", KEY), (KEY, KEY)):
        headers = [(names[0], f"Bearer {first}"), (names[1], f"Bearer {second}")]
        r = httpx.request(method, f"{keyed.url}{path}", headers=headers, content=b'{"model": "m", "prompt": "x"}',
                          timeout=30)
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert error["param"] == "Authorization" and error["code"] == "duplicate_header"
        assert KEY not in r.text
    assert keyed.fake.requests == []
