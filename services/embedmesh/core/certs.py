"""Make a throwaway mesh CA and one certificate per service (for ``make run`` with mTLS, and for tests).

    python -m embedmesh.core.certs --out DIR [--names gateway,preprocessor,...] [--hosts localhost,127.0.0.1]

Writes ``DIR/ca.pem`` (+ ``ca-key.pem``) and ``DIR/<name>.pem`` / ``DIR/<name>-key.pem`` for each name, plus
``client.pem``/``client-key.pem`` for a test client that holds a mesh certificate. Every certificate is valid for
server and client use (services call each other both ways) and names the given hosts and the Kubernetes service
names ``embedmesh-<name>`` in its subject alternative names. Keys are EC P-256, files mode 0600.
In production, issue these from your own CA (cert-manager; see deploy/k8s/overlays/mtls).
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["make_mesh_certs", "SERVICE_NAMES"]

SERVICE_NAMES = ("gateway", "preprocessor", "router", "worker", "embed-worker", "vector-store", "encoder-cache",
                 "image-encoder", "client")


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.write_bytes(data)
    if private:
        os.chmod(path, 0o600)


def make_mesh_certs(out: Path, names: Sequence[str] = SERVICE_NAMES,
                    hosts: Sequence[str] = ("localhost", "127.0.0.1"), days: int = 30) -> dict[str, Path]:
    """Create the CA and the certificates; returns name -> certificate path (``ca`` included)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    pem = serialization.Encoding.PEM

    def key_pem(k: ec.EllipticCurvePrivateKey) -> bytes:
        return k.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "embedmesh mesh CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    _write(out / "ca.pem", ca.public_bytes(pem))
    _write(out / "ca-key.pem", key_pem(ca_key), private=True)
    paths = {"ca": out / "ca.pem"}
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        alt = [*sans, x509.DNSName(f"embedmesh-{name}")]
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"embedmesh-{name}")]))
                .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
                .add_extension(x509.SubjectAlternativeName(alt), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        _write(out / f"{name}.pem", cert.public_bytes(pem))
        _write(out / f"{name}-key.pem", key_pem(key), private=True)
        paths[name] = out / f"{name}.pem"
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m embedmesh.core.certs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--names", default=",".join(SERVICE_NAMES))
    p.add_argument("--hosts", default="localhost,127.0.0.1")
    p.add_argument("--days", type=int, default=30)
    a = p.parse_args(argv)
    paths = make_mesh_certs(a.out, [n for n in a.names.split(",") if n], [h for h in a.hosts.split(",") if h],
                            a.days)
    for name, path in paths.items():
        print(f"{name:<14} {path}")


if __name__ == "__main__":
    main()
