"""core.certs: one throwaway CA and, per name, a certificate it signed, valid for server and client use, naming the
given hosts and ``embedmesh-<name>``; keys are private files; the command line writes the same and lists them."""

from __future__ import annotations

import ipaddress
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from embedmesh.core.certs import SERVICE_NAMES, main, make_mesh_certs


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    out = tmp_path_factory.mktemp("certs") / "nested"  # the folder is created
    return out, make_mesh_certs(out, names=["router", "worker"], hosts=["localhost", "10.1.2.3", "mesh.local"],
                                days=3)


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_writes_the_ca_and_one_pair_per_name(made: tuple[Path, dict[str, Path]]) -> None:
    out, paths = made
    assert paths == {"ca": out / "ca.pem", "router": out / "router.pem", "worker": out / "worker.pem"}
    assert sorted(p.name for p in out.iterdir()) == ["ca-key.pem", "ca.pem", "router-key.pem", "router.pem",
                                                     "worker-key.pem", "worker.pem"]
    for key in ("ca-key.pem", "router-key.pem", "worker-key.pem"):
        assert stat.S_IMODE((out / key).stat().st_mode) == 0o600, key


def test_each_certificate_is_signed_by_the_ca_for_both_directions(made: tuple[Path, dict[str, Path]]) -> None:
    out, _ = made
    ca = _cert(out / "ca.pem")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for name in ("router", "worker"):
        cert = _cert(out / f"{name}.pem")
        cert.verify_directly_issued_by(ca)  # raises if the CA did not sign it
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == f"embedmesh-{name}"
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        assert usages == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert set(san.get_values_for_type(x509.DNSName)) == {"localhost", "mesh.local", f"embedmesh-{name}"}
        assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.1.2.3")]
        lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
        assert 3 * 86400 <= lifetime.total_seconds() <= 3 * 86400 + 600


def test_each_key_belongs_to_its_certificate(made: tuple[Path, dict[str, Path]]) -> None:
    out, _ = made
    for name in ("ca", "router", "worker"):
        key = serialization.load_pem_private_key((out / f"{name}-key.pem").read_bytes(), password=None)
        spki = serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        assert key.public_key().public_bytes(*spki) == _cert(out / f"{name}.pem").public_key().public_bytes(*spki)


def test_a_second_ca_signs_nothing_of_the_first(made: tuple[Path, dict[str, Path]], tmp_path: Path) -> None:
    out, _ = made
    make_mesh_certs(tmp_path, names=["client"])
    with pytest.raises(Exception):  # noqa: B017 - cryptography raises ValueError or InvalidSignature
        _cert(tmp_path / "client.pem").verify_directly_issued_by(_cert(out / "ca.pem"))


def test_command_line_writes_the_named_certificates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["--out", str(tmp_path), "--names", "gateway,,client", "--hosts", "localhost"])
    printed = capsys.readouterr().out.split()
    assert printed[0::2] == ["ca", "gateway", "client"]
    assert printed[1::2] == [str(tmp_path / f) for f in ("ca.pem", "gateway.pem", "client.pem")]


def test_default_names_cover_every_service_and_the_module_runs() -> None:
    assert {"gateway", "preprocessor", "router", "worker", "vector-store", "encoder-cache", "client"} <= set(
        SERVICE_NAMES)
    r = subprocess.run([sys.executable, "-m", "embedmesh.core.certs", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "--out" in r.stdout and "--names" in r.stdout and "--hosts" in r.stdout
