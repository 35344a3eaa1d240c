"""``ciders-cloud certs``: a private CA and a server certificate for the SuperLink's TLS.

The edges trust ``ca.crt`` (``ciders-edge join --root-certificates``); the SuperLink serves
``server.pem`` with ``server.key``. The server certificate names localhost, 127.0.0.1 and the
given hosts, so one set serves a loopback test or a deployment. The CA's private key is kept only
where ``ca_key`` says, outside the certificate folder (ideally offline): whoever holds it can
impersonate the cloud to every edge, so it must not sit beside the server key in the run.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ciders_cloud.run.folder import CertsFolder
from ciders_edge.config import check_limit
from ciders_edge.errors import ConfigError
from ciders_edge.formats.atomic import write_bytes

__all__ = ["make_certs"]


def make_certs(out: Path, hosts: list[str], days: int = 365, ca_key: Path | None = None) -> dict:
    """Write ``ca.crt`` and ``server.pem``/``server.key`` under ``out``, and the CA key to ``ca_key``
    (``None``: discarded once the server certificate is signed); refuse to overwrite."""
    check_limit("days", days, "--days")
    folder = CertsFolder(out)
    if any(p.exists() for p in (folder.ca, folder.ca_key, folder.server_cert, folder.server_key)):
        raise ConfigError(f"{out}: already holds certificates; choose a new --out or delete them")
    if ca_key is not None and (ca_key.exists() or ca_key.resolve().is_relative_to(out.resolve())):
        raise ConfigError(f"--ca-key {ca_key}: exists already, or lies inside --out {out}; keep the CA key elsewhere")
    names = list(dict.fromkeys(["localhost", "127.0.0.1", *hosts]))
    now = dt.datetime.now(dt.UTC)
    ca_signing_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "CIDERS fleet CA")])
    ca = (
        _builder(ca_name, ca_name, ca_signing_key.public_key(), now, days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(*_usage(cert_sign=True)), critical=True)
        .sign(ca_signing_key, hashes.SHA384())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    server = (
        _builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[-1])]), ca_name, key.public_key(), now, days)
        .add_extension(x509.SubjectAlternativeName([_san(n) for n in names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_signing_key, hashes.SHA384())
    )
    if ca_key is not None:
        _write_key(ca_key, ca_signing_key)
    _write_key(folder.server_key, key)
    write_bytes(folder.ca, ca.public_bytes(serialization.Encoding.PEM))
    write_bytes(folder.server_cert, server.public_bytes(serialization.Encoding.PEM))
    return {
        "out": str(out),
        "hosts": names,
        "days": days,
        "ca": str(folder.ca),
        "server": str(folder.server_cert),
        "ca_key": str(ca_key) if ca_key is not None else None,
    }


def _builder(subject: x509.Name, issuer: x509.Name, public_key, now: dt.datetime, days: int) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
    )


def _usage(cert_sign: bool) -> tuple[bool, ...]:
    # digital_signature, content_commitment, key_encipherment, data_encipherment, key_agreement,
    # key_cert_sign, crl_sign, encipher_only, decipher_only
    return (True, False, False, False, False, cert_sign, cert_sign, False, False)


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
    )
    write_bytes(path, pem, mode=0o600)
