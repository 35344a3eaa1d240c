"""Check, before the SuperNode starts, that the cloud's TLS certificate is signed by the CA we were given.

The SuperNode (Flower's, over httpx) retries a failed handshake until it gives up, and what it
logs last then reads like a refused node key. One handshake of our own, with the same checks
httpx makes (the CA file, the certificate chain, the host name), names the TLS failure instead.
"""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

from ciders_edge.errors import ConfigError

__all__ = ["check_server_certificate"]


def check_server_certificate(host: str, port: int, ca: Path, timeout: float = 10.0) -> None:
    """Complete one TLS handshake with ``host:port`` trusting only ``ca``; a ConfigError says why it failed."""
    server = f"{host}:{port}"
    try:
        context = ssl.create_default_context(cafile=str(ca))
    except (ssl.SSLError, ValueError) as err:
        raise ConfigError(f"--root-certificates {ca}: not a PEM CA certificate ({err})") from None
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw:
            with context.wrap_socket(raw, server_hostname=host):
                return
    except ssl.SSLCertVerificationError as err:
        raise ConfigError(
            f"TLS: the cloud at {server} presented a certificate that --root-certificates {ca} does not accept "
            f"({err.verify_message}); use the ca.crt of the cloud's `ciders-cloud certs`, made for this host name"
        ) from None
    except ssl.SSLError as err:
        why = err.reason or err
        raise ConfigError(f"TLS: no TLS handshake with the cloud at {server} ({why}); is it serving TLS?") from None
    except OSError as err:
        raise ConfigError(f"TLS: the cloud at {server} closed the connection during the handshake ({err})") from None
