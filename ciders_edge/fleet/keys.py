"""The SuperNode key pair that authenticates this edge to the SuperLink (Flower node authentication).

Made once per state folder: the private key never leaves the device; the public key
(``node-key.pub``, OpenSSH format, NIST P-384 as Flower requires) is what the cloud registers as
``RUN/nodes/<client-id>.pub``.
"""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ciders_edge.formats.atomic import write_bytes

__all__ = ["ensure_node_key", "PRIVATE", "PUBLIC"]

PRIVATE = "node-key"
PUBLIC = "node-key.pub"


def ensure_node_key(state_dir: Path) -> tuple[Path, Path]:
    """``(private, public)`` key files under ``state_dir``, generated on first use."""
    private, public = state_dir / PRIVATE, state_dir / PUBLIC
    if not private.is_file():
        key = ec.generate_private_key(ec.SECP384R1())
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        )
        write_bytes(private, pem, mode=0o600)
    if not public.is_file():
        key = serialization.load_ssh_private_key(private.read_bytes(), None)
        line = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        write_bytes(public, line + b"\n")
    return private, public
