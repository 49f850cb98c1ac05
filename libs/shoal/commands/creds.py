"""``shoal creds``: the identities of the installation ``shoal up`` runs here.

``shoal creds add user alice`` makes user ``alice``'s nkey seed file in
``<state dir>/creds`` (mode 0600; hand it to alice, who sets ``NATS_CREDS`` to it)
and tells the running ``shoal up`` (SIGHUP), which admits the identity at once: its
server reloads its configuration or, under the auth callout, the authorizer admits it
until the server next starts (:meth:`shoal.nats_server.EmbeddedNats.reload`).
``--mqtt-password`` also admits alice's MQTT devices with that password (under the
callout, the authorizer checks it until the server next starts).
``shoal creds add node gpu-7`` makes the identities of a node daemon run elsewhere
(``node-gpu-7.nk`` for the daemon, ``sidecar-gpu-7.nk`` for its sidecars).
``shoal creds list`` shows every identity and its role. Only whoever can read the
state directory (its owner) can do this: the files are the credentials.

``shoal creds k8s DIR --node gpu-1.example --user alice`` keeps the identities of a
Kubernetes installation in ``DIR`` instead (the admin, every service, a node and a
sidecar identity per node, the users, and the password of the NATS servers' routes;
existing seeds are kept, so running it again with one more ``--node`` adds that node)
and writes ``DIR/secrets.yaml``, the Secrets
the manifests in ``deploy/k8s`` mount (:mod:`shoal.k8s`; ``docs/deploy.md``), and
``DIR/auth.conf``, the NATS servers' authorization block, for servers run without
Kubernetes. It also keeps the authorizer's identity and the auth callout issuer's seed
(``callout-issuer.nk``): the servers judge sidecars by the auth callout, each sidecar an
identity of its one job (``--no-callout``: static ``sidecar-<node>`` identities instead).
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

from shoal.cli import CommandError

_KINDS = ("user", "node", "admin", "admission", "allocator", "placer", "profiler", "trader")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("creds", help="add or list the identities of the local installation")
    sub = p.add_subparsers(dest="creds_command", metavar="<add|list|k8s>")
    add = sub.add_parser("add", help="make an identity's nkey seed file and admit it")
    add.add_argument("kind", choices=_KINDS, help="a user, a node (its daemon and sidecars), or a service")
    add.add_argument("name", nargs="?", default="", help="the user's or node's name")
    add.add_argument(
        "--mqtt-password", default=None, help="(users) also admit MQTT devices with this password"
    )
    add.set_defaults(func=_add)
    k8s = sub.add_parser("k8s", help="identities of a Kubernetes installation and their Secrets")
    k8s.add_argument("directory", help="where the seeds are kept and secrets.yaml is written")
    k8s.add_argument(
        "--node", action="append", default=[], help="a GPU node's Kubernetes name (repeat for each)"
    )
    k8s.add_argument("--user", action="append", default=[], help="a user (repeat for each)")
    k8s.add_argument("--prefix", default="shoal", help="the installation's SHOAL_PREFIX")
    k8s.add_argument("--namespace", default="shoal", help="the namespace of the Secrets")
    k8s.add_argument(
        "--nats-servers", type=int, default=3, help="servers of the NATS StatefulSet (default 3)"
    )
    k8s.add_argument(
        "--no-callout",
        dest="callout",
        action="store_false",
        help="no per-job sidecar identities: sidecars connect as their node's static sidecar identity",
    )
    k8s.set_defaults(func=_k8s)
    ls = sub.add_parser("list", help="every identity and its role")
    ls.set_defaults(func=_list)
    p.set_defaults(func=lambda _args: p.print_help() or 2)


def _store() -> Any:
    from shoal.auth import CredentialStore
    from shoal.commands._connect import state_dir
    from shoal.runtime import CREDS_DIR

    return CredentialStore(state_dir() / CREDS_DIR)


def _add(args: argparse.Namespace) -> int:
    from shoal.auth import AuthError
    from shoal.commands._connect import state_dir
    from shoal.runtime import read_up_info

    store = _store()
    try:
        if args.kind == "user":
            paths = [store.ensure("client", args.name, mqtt_password=args.mqtt_password)]
        elif args.kind == "node":
            paths = [store.ensure("node", args.name), store.ensure("sidecar", args.name)]
        else:
            if args.name:
                raise CommandError(f"a {args.kind} identity takes no name")
            paths = [store.ensure(args.kind)]
    except (AuthError, PermissionError) as exc:
        raise CommandError(str(exc)) from None
    for path in paths:
        print(path)
    info = read_up_info(state_dir())
    if info is not None:
        # `shoal up` reloads its server's configuration on SIGHUP (new identities admitted).
        os.kill(int(info["pid"]), signal.SIGHUP)
    return 0


def _k8s(args: argparse.Namespace) -> int:
    import secrets

    import yaml

    from shoal.auth import ISSUER, SERVICE_ROLES, AuthError, CredentialStore, authorization_block
    from shoal.k8s import node_id_of, secret_manifests

    store = CredentialStore(args.directory)
    try:
        store.ensure("admin")
        for role in SERVICE_ROLES:
            store.ensure(role)
        if args.callout:
            store.ensure_callout()
        for node in args.node:
            store.ensure("node", node_id_of(node))
            store.ensure("sidecar", node_id_of(node))
        for user in args.user:
            store.ensure("client", user)
    except (AuthError, PermissionError) as exc:
        raise CommandError(str(exc)) from None
    idents = store.identities()
    seeds = {i.name: store.path(i.name).read_bytes() for i in idents if i.role not in ("admin", "client")}
    # The password the NATS servers require of each other's routes, kept with the seeds.
    route_file = Path(args.directory) / "route-password"
    if not route_file.exists():
        fd = os.open(route_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(24) + "\n")
    docs = secret_manifests(
        idents,
        seeds,
        route_password=route_file.read_text().strip(),
        prefix=args.prefix,
        namespace=args.namespace,
        nats_servers=args.nats_servers,
        callout_issuer_seed=store.path(ISSUER).read_bytes() if args.callout else None,
    )
    out = Path(args.directory) / "secrets.yaml"
    text = "# Made by `shoal creds k8s`: seeds; keep out of version control.\n"
    text += yaml.safe_dump_all(docs, sort_keys=False)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    print(out)
    # The same authorization block as a file, for NATS servers outside Kubernetes.
    auth = Path(args.directory) / "auth.conf"
    fd = os.open(auth, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        issuer = store.issuer_public_key() if args.callout else None
        fh.write(authorization_block(idents, args.prefix, callout_issuer=issuer))
    print(auth)
    return 0


def _list(_args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table("name", "role", "for", "mqtt", "seed file", box=None)
    store = _store()
    for ident in store.identities():
        seed = store.path(ident.name)
        table.add_row(
            ident.name,
            ident.role,
            ident.subject,
            "yes" if ident.mqtt_password_hash else "",
            str(seed) if Path(seed).exists() else "(missing)",
        )
    Console(soft_wrap=True).print(table)
    return 0
