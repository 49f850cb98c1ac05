"""Kubernetes Secrets of an installation's identities (``shoal creds k8s``).

Pure: from the identities and their seeds (read by the caller) it builds the Secret
objects the manifests in ``deploy/k8s`` mount (``docs/deploy.md``):

``shoal-nats-auth``
    ``auth.conf``: the NATS servers' ``authorization`` block, every identity's public
    nkey and its permissions, from :func:`shoal.auth.authorization_block`. It holds no
    seed; it is a Secret because it carries the MQTT password hashes.
``shoal-creds-<service>`` (admission, allocator, placer, profiler, trader)
    ``<service>.nk``: that service's seed alone, so each Deployment mounts only its own.
``shoal-creds-nodes``
    ``node-<id>.nk`` and ``sidecar-<id>.nk`` of every node: a DaemonSet cannot mount a
    different Secret on each node, so every node daemon pod can read every node's seeds.

The admin's and the users' seeds are never put in a Secret: the operator and the
users keep them (their public keys are in ``auth.conf``).
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from typing import Any

from shoal.auth import SERVICE_ROLES, Identity, authorization_block

AUTH_SECRET = "shoal-nats-auth"
NODES_SECRET = "shoal-creds-nodes"


def node_id_of(node_name: str) -> str:
    """The node id a node daemon in ``deploy/k8s`` takes from its Kubernetes node name:
    dots become dashes (a node id is one subject token), as the DaemonSet's
    ``tr . -`` does."""
    return node_name.replace(".", "-")


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
    prefix: str = "shoal",
    namespace: str = "shoal",
) -> list[dict[str, Any]]:
    """The Secrets of ``identities`` (``seeds``: identity name -> seed file content).

    Raises:
        KeyError: a service, node or sidecar identity whose seed is not in ``seeds``.
    """
    idents = sorted(identities, key=lambda i: i.name)
    out = [_secret(AUTH_SECRET, namespace, {"auth.conf": authorization_block(idents, prefix).encode()})]
    for ident in idents:
        if ident.role in SERVICE_ROLES:
            out.append(
                _secret(service_secret(ident.role), namespace, {f"{ident.name}.nk": seeds[ident.name]})
            )
    nodes = {f"{i.name}.nk": seeds[i.name] for i in idents if i.role in ("node", "sidecar")}
    out.append(_secret(NODES_SECRET, namespace, nodes))
    return out
