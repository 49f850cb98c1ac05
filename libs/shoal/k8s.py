"""Kubernetes Secrets of an installation's identities (``shoal creds k8s``).

Pure: from the identities and their seeds (read by the caller) it builds the Secret
objects the manifests in ``deploy/k8s`` mount (``docs/deploy.md``):

``shoal-nats-auth``
    ``auth.conf``: the NATS servers' ``authorization`` block, every identity's public
    nkey and its permissions, from :func:`shoal.auth.authorization_block` (no seed;
    MQTT password hashes if any); with the callout issuer's seed, also the auth callout
    (per-job sidecar identities, :mod:`shoal.callout`): every static identity but the
    sidecars' in ``auth_users``, the issuer's public key. ``cluster.conf``: the route password the servers of
    the StatefulSet require of each other, and their routes (:func:`cluster_conf`).
``shoal-creds-<service>`` (admission, allocator, placer, profiler, trader)
    ``<service>.nk``: that service's seed alone, so each Deployment mounts only its own.
``shoal-creds-authorizer`` (with the callout)
    ``authorizer.nk``, ``revoker.nk`` (its system-account identity, which ends the
    connections of sidecars whose job left their node), ``callout-issuer.nk`` (the
    account key the authorizer signs its answers with) and ``identities.json`` (every
    identity's public key and MQTT password hash, no seed: the ``sidecar-<id>`` keys
    verify the sidecar tokens, and the others let the callout admit an identity added
    after the servers started, without restarting them): ``shoal run authorizer``'s alone.
``shoal-creds-nodes``
    ``node-<id>.nk`` and ``sidecar-<id>.nk`` of every node: a DaemonSet cannot mount a
    different Secret on each node, so every node daemon pod can read every node's seeds.
    With the callout a ``sidecar-<id>`` seed is no user of the servers: it only signs
    the tokens of that node's sidecars.

The admin's and the users' seeds are never put in a Secret: the operator and the
users keep them (their public keys are in ``auth.conf``).
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from shoal.auth import ISSUER, MANIFEST, SERVICE_ROLES, Identity, authorization_block

AUTH_SECRET = "shoal-nats-auth"
NODES_SECRET = "shoal-creds-nodes"
AUTHORIZER_SECRET = "shoal-creds-authorizer"


def node_id_of(node_name: str) -> str:
    """The node id a node daemon in ``deploy/k8s`` takes from its Kubernetes node name:
    dots become dashes (a node id is one subject token), as the DaemonSet's
    ``tr . -`` does."""
    return node_name.replace(".", "-")


ROUTE_USER = "route"


def cluster_conf(password: str, *, namespace: str = "shoal", servers: int = 3) -> str:
    """What ``deploy/k8s``'s ``nats.conf`` includes in its ``cluster`` block: the route
    user and password every server requires of the others, and the routes to the
    StatefulSet's ``servers`` pods (``nats-<i>.nats-headless.<namespace>``) with them.

    Raises:
        ValueError: a password that is not letters and digits (it is part of a URL).
    """
    if not password.isalnum():
        raise ValueError("the route password must be letters and digits (it is part of a URL)")
    routes = "\n".join(
        f"  nats-route://{ROUTE_USER}:{password}@nats-{i}.nats-headless.{namespace}.svc.cluster.local:6222"
        for i in range(servers)
    )
    return f'authorization {{\n  user: {ROUTE_USER}\n  password: "{password}"\n}}\nroutes: [\n{routes}\n]\n'


def service_secret(role: str) -> str:
    """The name of the Secret that holds service ``role``'s seed."""
    return f"shoal-creds-{role}"


def _secret(name: str, namespace: str, files: Mapping[str, bytes]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/part-of": "shoal"},
        },
        "type": "Opaque",
        "data": {key: base64.b64encode(files[key]).decode() for key in sorted(files)},
    }


def secret_manifests(
    identities: Iterable[Identity],
    seeds: Mapping[str, bytes],
    *,
    route_password: str,
    prefix: str = "shoal",
    namespace: str = "shoal",
    nats_servers: int = 3,
    callout_issuer_seed: bytes | None = None,
) -> list[dict[str, Any]]:
    """The Secrets of ``identities`` (``seeds``: identity name -> seed file content) and
    of the NATS servers' routes (``route_password``, :func:`cluster_conf`). With
    ``callout_issuer_seed`` (the auth callout's account seed) the servers judge sidecars
    by the auth callout and the authorizer gets its Secret.

    Raises:
        KeyError: a service, node, sidecar or (with the callout) authorizer identity whose
            seed is not in ``seeds``.
    """
    idents = sorted(identities, key=lambda i: i.name)
    issuer = None
    if callout_issuer_seed is not None:
        from shoal import callout as co

        issuer = co.public_key(co.keypair(callout_issuer_seed))
    nats_files = {
        "auth.conf": authorization_block(idents, prefix, callout_issuer=issuer).encode(),
        "cluster.conf": cluster_conf(route_password, namespace=namespace, servers=nats_servers).encode(),
    }
    out = [_secret(AUTH_SECRET, namespace, nats_files)]
    for ident in idents:
        if ident.role in SERVICE_ROLES:
            out.append(
                _secret(service_secret(ident.role), namespace, {f"{ident.name}.nk": seeds[ident.name]})
            )
    nodes = {f"{i.name}.nk": seeds[i.name] for i in idents if i.role in ("node", "sidecar")}
    out.append(_secret(NODES_SECRET, namespace, nodes))
    if callout_issuer_seed is not None:
        # Every identity's public key (no seed): the sidecar keys verify sidecar tokens, and
        # an identity added later is admitted by the callout before the servers list it.
        keys = list(idents)
        files = {
            "authorizer.nk": seeds["authorizer"],
            f"{ISSUER}.nk": callout_issuer_seed,
            MANIFEST: msgspec.json.format(msgspec.json.encode(keys)),
        }
        if any(i.role == "revoker" for i in idents):  # it ends revoked sidecars' connections
            files["revoker.nk"] = seeds["revoker"]
        out.append(_secret(AUTHORIZER_SECRET, namespace, files))
    return out
