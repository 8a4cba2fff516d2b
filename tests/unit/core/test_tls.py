"""core.tls: the TLS trio is all-or-none and each file must exist, the mesh token is compared exactly, the flags
default from the environment and configure the process; over the wire, mutual TLS refuses peers without a mesh
certificate while the public port serves TLS without demanding one."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from embedmesh.core import tls
from embedmesh.core.auth import Access
from embedmesh.core.certs import make_mesh_certs
from embedmesh.core.server import mesh_channel
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc

from .conftest import ServeEcho


def _md(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")] if key else []


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    make_mesh_certs(out, names=["worker", "client"])
    other = out / "other"
    make_mesh_certs(other, names=["client"])  # a certificate from a CA the mesh does not trust
    return out


def _tls_for(certs: Path, name: str) -> tls.Security:
    return tls.Security(tls=tls.TlsFiles(certs / f"{name}.pem", certs / f"{name}-key.pem", certs / "ca.pem"))


async def test_mutual_tls_refuses_peers_without_a_mesh_certificate(certs: Path, plain_security: None,
                                                                   serve_echo: ServeEcho) -> None:
    tls.configure(_tls_for(certs, "worker"))
    server = await serve_echo(Access.MESH)
    port = server.port
    ca = (certs / "ca.pem").read_bytes()
    no_cert = grpc.aio.secure_channel(f"localhost:{port}", grpc.ssl_channel_credentials(root_certificates=ca))
    foreign = grpc.aio.secure_channel(f"localhost:{port}", grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=(certs / "other" / "client-key.pem").read_bytes(),
        certificate_chain=(certs / "other" / "client.pem").read_bytes()))
    plaintext = grpc.aio.insecure_channel(f"localhost:{port}")
    tls.configure(_tls_for(certs, "client"))
    member = mesh_channel(f"localhost:{port}")
    try:
        got = await worker_pb2_grpc.WorkerServiceStub(member).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
        assert got.engine == "admin"  # a verified mesh certificate is a mesh caller
        for ch in (no_cert, foreign, plaintext):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await worker_pb2_grpc.WorkerServiceStub(ch).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake itself fails
    finally:
        for ch in (no_cert, foreign, plaintext, member):
            await ch.close()
        await server.drain()


async def test_public_port_serves_tls_without_client_certificates(certs: Path, keys: None, plain_security: None,
                                                                  serve_echo: ServeEcho) -> None:
    tls.configure(_tls_for(certs, "worker"))
    server = await serve_echo(Access.PUBLIC, public=True)
    ca = (certs / "ca.pem").read_bytes()
    ch = grpc.aio.secure_channel(f"localhost:{server.port}", grpc.ssl_channel_credentials(root_certificates=ca))
    try:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        assert (await stub.GetInfo(worker_pb2.GetInfoRequest(), metadata=_md("kb-12345678"), timeout=10)).model \
            == "beta"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await ch.close()
        await server.drain()


# --- settings ----------------------------------------------------------------------------------------------------


def test_from_values_takes_all_three_files_or_none(certs: Path) -> None:
    cert, key, ca = (str(certs / n) for n in ("worker.pem", "worker-key.pem", "ca.pem"))
    assert tls.from_values("", "", "", "").tls is None
    assert not tls.from_values("", "", "", "").enabled
    sec = tls.from_values(cert, key, ca, "tok")
    assert sec.tls == tls.TlsFiles(Path(cert), Path(key), Path(ca)) and sec.mesh_token == "tok" and sec.enabled
    for partial in ((cert, "", ""), ("", key, ca), (cert, key, "")):
        with pytest.raises(ValueError, match="--tls-cert, --tls-key and --tls-ca go together"):
            tls.from_values(*partial, "")


def test_from_values_names_the_missing_file(certs: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(ValueError, match=f"--tls-key: {missing} is not a readable file"):
        tls.from_values(str(certs / "worker.pem"), str(missing), str(certs / "ca.pem"), "")


def test_mesh_token_alone_enables_the_internal_plane_and_matches_exactly() -> None:
    sec = tls.Security(mesh_token="s3cret")
    assert sec.enabled and sec.tls is None
    assert sec.token_matches("s3cret")
    for wrong in ("", "s3cre", "s3cret ", "S3CRET"):
        assert not sec.token_matches(wrong), wrong
    assert not tls.Security().token_matches("")  # no token configured: nothing matches
    assert not tls.Security().token_matches("anything")


def test_credentials_only_with_tls(certs: Path) -> None:
    assert tls.Security().server_credentials(True) is None and tls.Security().channel_credentials() is None
    sec = _tls_for(certs, "worker")
    assert isinstance(sec.server_credentials(True), grpc.ServerCredentials)
    assert isinstance(sec.channel_credentials(), grpc.ChannelCredentials)


def test_security_flags_default_from_the_environment() -> None:
    p = argparse.ArgumentParser()
    tls.add_security_args(p, {"EMBEDMESH_TLS_CERT": "c", "EMBEDMESH_TLS_KEY": "k", "EMBEDMESH_TLS_CA": "a",
                              "EMBEDMESH_MESH_TOKEN": "t"})
    a = p.parse_args([])
    assert (a.tls_cert, a.tls_key, a.tls_ca, a.mesh_token) == ("c", "k", "a", "t")
    assert p.parse_args(["--mesh-token", "flag"]).mesh_token == "flag"


@pytest.fixture
def restore_security() -> Iterator[None]:
    before = tls.current()
    yield
    tls.configure(before)


def test_strip_security_args_configures_the_process_and_returns_the_rest(certs: Path,
                                                                           restore_security: None) -> None:
    rest = tls.strip_security_args(["--port", "5", "--tls-cert", str(certs / "worker.pem"), "--tls-key",
                                    str(certs / "worker-key.pem"), "--tls-ca", str(certs / "ca.pem"), "-v"], env={})
    assert rest == ["--port", "5", "-v"]
    assert tls.current().tls == tls.TlsFiles(certs / "worker.pem", certs / "worker-key.pem", certs / "ca.pem")
    assert tls.strip_security_args([], env={"EMBEDMESH_MESH_TOKEN": "from-env"}) == []
    assert tls.current() == tls.Security(mesh_token="from-env")


def test_strip_security_args_exits_with_usage_on_a_partial_trio(restore_security: None,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        tls.strip_security_args(["--tls-cert", "x.pem"], env={}, prog="router")
    assert info.value.code == 2
    assert "router: error: --tls-cert, --tls-key and --tls-ca go together" in capsys.readouterr().err
