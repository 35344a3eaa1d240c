"""The SuperLink ``serve`` starts: Flower's own, with nothing but the Fleet API on the public address.

Flower 1.42 serves its Fleet, Control and Runtime (ServerAppIo) APIs from one FastAPI app on one
``--host``/``--port`` (``flwr.superlink.cli.flower_superlink._run_superlink_http_api``), and its
open-source release has no account authentication on the Control API (``load_control_authn_plugin``
gives the no-op plugin unless the enterprise ``flwr.ee`` is installed). So this runs that same app,
parsed, checked and started by Flower's own code, on two listening sockets:

- ``127.0.0.1:PORT`` (Flower's ``--host``/``--port``): every API, for serve's ``flwr`` commands and
  for the SuperExec and ServerApps the SuperLink starts, which Flower points at that address;
- the public ``--public HOST:PORT``: only the Fleet API's routes (``/v1/fleet/...``, the ones a
  SuperNode calls). Any other request there is answered 404 before it reaches Flower.

    python -m ciders_cloud.fleet.superlink --public HOST:PORT --host 127.0.0.1 --port PORT [flower-superlink flags]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

LOOPBACK = "127.0.0.1"
# Flower's switches that would also start its old gRPC Control/Fleet servers on their default
# 0.0.0.0 addresses; they must stay off.
GRPC_SWITCHES = ("FLWR_INTERNAL_GRPC_CONTROL_API", "FLWR_INTERNAL_GRPC_FLEET_API")


def fleet_paths() -> frozenset[str]:
    """The paths of Flower's Fleet API routes: all the public address serves."""
    from flwr.superlink.routers.fleet.router import router

    paths = frozenset(route.path for route in router.routes)
    if not paths or not all(p.startswith("/v1/fleet/") for p in paths):
        raise RuntimeError(f"unexpected Fleet API routes in this Flower: {sorted(paths)}")
    return paths


class FleetOnly:
    """ASGI gate around the SuperLink app: a connection accepted on ``127.0.0.1:internal_port`` reaches
    everything; one accepted on any other listening socket reaches only the Fleet API's paths."""

    def __init__(self, app, internal_port: int, paths: frozenset[str]) -> None:
        self.app, self.internal_port, self.paths = app, internal_port, paths

    def allows(self, scope: dict) -> bool:
        server = scope.get("server")  # the local address the connection was accepted on
        if server is not None and tuple(server) == (LOOPBACK, self.internal_port):
            return True
        return scope["type"] == "http" and scope.get("root_path", "") == "" and scope["path"] in self.paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan" or self.allows(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            body = b"Not Found: this address serves only the Fleet API\n"
            headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": 404, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        else:  # a websocket: closing before accepting refuses the handshake
            await send({"type": "websocket.close", "code": 1008})


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"--public {address!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def _listen(host: str, port: int) -> socket.socket:
    """A bound socket as uvicorn binds one (``Config.bind_socket``); uvicorn listens on it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"cannot listen on {host}:{port}: {e}") from None
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--public", required=True, help="HOST:PORT where the SuperNodes reach the Fleet API")
    ours, flower_args = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    public = split_address(ours.public)
    for name in GRPC_SWITCHES:
        os.environ.pop(name, None)

    import uvicorn
    from flwr.supercore.http_logging import get_uvicorn_log_config
    from flwr.supercore.logger import console_handler
    from flwr.superlink.cli.flower_superlink import SuperLinkLifespan, _parse_superlink_lifespan_config
    from flwr.superlink.main import create_app

    sys.argv = ["flower-superlink", *flower_args]
    config = _parse_superlink_lifespan_config()  # Flower's flags and checks, as `flower-superlink` has them
    if config.host != LOOPBACK:
        raise SystemExit(f"--host {config.host}: the Control and Runtime APIs listen on {LOOPBACK} only")
    if public == (LOOPBACK, config.port):
        raise SystemExit(f"--public {ours.public}: must differ from the loopback API address")
    sockets = [_listen(LOOPBACK, config.port), _listen(*public)]
    app = FleetOnly(create_app(config, SuperLinkLifespan), config.port, fleet_paths())
    server = uvicorn.Server(
        uvicorn.Config(
            app=app,
            reload=False,
            access_log=True,
            log_config=get_uvicorn_log_config(console_handler.level),
            ssl_keyfile=config.ssl_keyfile,
            ssl_certfile=config.ssl_certfile,
            workers=1,
        )
    )
    print(
        f"SuperLink: Fleet API on {ours.public}; Fleet, Control and Runtime APIs on {LOOPBACK}:{config.port}",
        flush=True,
    )
    server.run(sockets=sockets)


if __name__ == "__main__":
    main()
