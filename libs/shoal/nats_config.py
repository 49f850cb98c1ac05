"""Server configuration of a NATS cluster for shoal on several hosts or containers.

:class:`shoal.nats_server.EmbeddedNats` writes the configuration of the one server
`shoal up` runs on this machine. A cluster of servers on other hosts (the compose stack
in ``deploy/compose``, bare-metal hosts) needs one configuration per server with the same
identities: :func:`server_config` writes it from the same pieces, the identities'
permission lists of :func:`shoal.auth.authorization_block`, so nothing is hand-written.

Routes between the servers authenticate with a user and password of their own
(``cluster.authorization``), so a process that can reach a route port but does not know
the password cannot join the cluster. The monitoring endpoint (``/healthz``) listens on
127.0.0.1 only, for the container's own health check.

This module is pure; ``shoal nats-config`` (:mod:`shoal.commands.nats_config`) writes the
files.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence

from shoal.auth import Identity, authorization_block

ROUTE_USER = "route"
CLIENT_PORT = 4222
ROUTE_PORT = 6222
MQTT_PORT = 1883
MONITOR_PORT = 8222


def server_config(
    server_name: str,
    *,
    servers: Sequence[str],
    identities: Iterable[Identity],
    route_password: str,
    cluster_name: str = "shoal",
    prefix: str = "shoal",
    store_dir: str = "/data",
    mqtt: bool = True,
    max_payload: int = 1024 * 1024,
    callout_issuer: str | None = None,
    sync_interval: str | None = None,
    tls: tuple[str, str] | None = None,
    tls_ca: str | None = None,
) -> str:
    """The configuration of ``server_name``, one of ``servers`` (host names that resolve
    to each server, e.g. compose service names), with JetStream in ``store_dir``, routes
    to every server of ``servers`` (a server ignores the route to itself), client and MQTT
    listeners on every address, and the identities' permissions for ``prefix``.

    With ``callout_issuer`` (the public account nkey the ``authorizer`` signs its answers
    with) every server also delegates to the auth callout each connection that is not one
    of ``identities`` (:func:`shoal.auth.authorization_block`): the static ``sidecar``
    identities are then no users of the cluster, and each sidecar connects with a token
    its node daemon signed, as an identity of its one job (:mod:`shoal.callout`).

    ``sync_interval`` (``"10s"``, ``"always"``…) is JetStream's fsync interval. ``tls``
    (certificate and key files, as the server sees them) makes every client connection
    TLS; with ``tls_ca`` too, the routes between the servers are TLS as well, each server
    verifying the others' certificates with that CA (so each certificate must name its
    server's host name).

    Raises:
        ValueError: ``server_name`` is not one of ``servers``, or a name or the password
            would break the configuration's syntax.
    """
    if server_name not in servers:
        raise ValueError(f"{server_name!r} is not one of the servers {list(servers)}")
    for name in (*servers, cluster_name):
        if not name or not all(c.isalnum() or c in "-_." for c in name):
            raise ValueError(f"a server or cluster name must be letters, digits, '-', '_' or '.': {name!r}")
    if not route_password or not all(c.isalnum() for c in route_password):
        raise ValueError("the route password must be letters and digits (it is part of the route URLs)")
    if sync_interval is not None and not (
        sync_interval == "always" or re.fullmatch(r"[0-9]+(\.[0-9]+)?(ms|s|m|h)", sync_interval)
    ):
        raise ValueError(
            f"sync_interval must be a duration (10s, 500ms, 2m) or 'always', got {sync_interval!r}"
        )
    if tls_ca is not None and tls is None:
        raise ValueError("a TLS CA for the routes needs the servers' certificate and key too")
    routes = [f"nats-route://{ROUTE_USER}:{route_password}@{s}:{ROUTE_PORT}" for s in servers]
    lines = [
        f"server_name: {json.dumps(server_name)}",
        'host: "0.0.0.0"',
        f"port: {CLIENT_PORT}",
        f"max_payload: {max_payload}",
        f'http: "127.0.0.1:{MONITOR_PORT}"',
        "jetstream {",
        f"  store_dir: {json.dumps(store_dir)}",
        *([f"  sync_interval: {json.dumps(sync_interval)}"] if sync_interval else []),
        "}",
        *(
            ["tls {", f"  cert_file: {json.dumps(tls[0])}", f"  key_file: {json.dumps(tls[1])}", "}"]
            if tls
            else []
        ),
        "cluster {",
        f"  name: {json.dumps(cluster_name)}",
        f'  listen: "0.0.0.0:{ROUTE_PORT}"',
        "  authorization {",
        f"    user: {json.dumps(ROUTE_USER)}",
        f"    password: {json.dumps(route_password)}",
        "  }",
        f"  routes: {json.dumps(routes)}",
        *(
            [
                "  tls {",
                f"    cert_file: {json.dumps(tls[0])}",
                f"    key_file: {json.dumps(tls[1])}",
                f"    ca_file: {json.dumps(tls_ca)}",
                "  }",
            ]
            if tls and tls_ca
            else []
        ),
        "}",
    ]
    if mqtt:
        lines += ["mqtt {", '  host: "0.0.0.0"', f"  port: {MQTT_PORT}", "}"]
    return "\n".join(lines) + "\n" + authorization_block(identities, prefix, callout_issuer=callout_issuer)
