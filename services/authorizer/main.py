"""``shoal run authorizer``: the auth callout service for per-job sidecar identities.

Started by ``shoal up`` when its embedded server runs with the auth callout
(:mod:`shoal.callout`, ``docs/security.md``). It needs the credentials directory of
the installation: its own seed (``SHOAL_NATS_CREDS``), the callout issuer's seed
(``callout-issuer.nk`` next to it) and the manifest, whose ``sidecar-<node>`` public
keys verify the sidecar tokens (under ``shoal up`` the manifest is the whole store's:
an identity ``shoal creds add`` made is admitted by the callout until the server next
starts, so adding one restarts nothing). It is not leader-elected: answers depend only on the
log, so any number may run; they share the requests (one queue group), each request
answered by one of them.

With ``revoker.nk`` next to its seed (the system account's identity, which ``shoal up``,
``shoal nats-config`` and ``shoal creds k8s`` make with the authorizer's), it also ends
the connection of any sidecar whose job left its node ``sidecar_revoke_after_s`` ago
(``SHOAL_SIDECAR_REVOKE_AFTER_S``, 30 s); without it, it says so in its log and judges
sidecars only when they connect.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import msgspec
import structlog
from shoal import callout as co
from shoal import probes
from shoal.auth import ISSUER, CredentialStore
from shoal.runtime import StartupError, connect_bus, resolve_creds
from shoal.settings import Settings
from shoal_services.authorizer.service import AuthorizerService

log = structlog.get_logger("shoal.authorizer")


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    """Run the authorizer until ``stop`` is set."""
    creds = resolve_creds(settings, "authorizer")
    if creds is None:
        raise StartupError(
            "the authorizer needs its credentials (SHOAL_NATS_CREDS in a credentials directory)"
        )
    store = CredentialStore(Path(creds).parent)
    try:
        issuer = co.keypair(store.path(ISSUER).read_bytes())
    except (OSError, co.CalloutError) as exc:
        raise StartupError(f"cannot read the callout issuer's seed {store.path(ISSUER)}: {exc}") from None
    async with contextlib.AsyncExitStack() as resources:
        bus = await connect_bus(settings, "authorizer", declare=False)
        resources.push_async_callback(bus.close)
        revoker = None
        if store.path("revoker").exists():
            as_revoker = msgspec.structs.replace(settings, nats_creds=str(store.path("revoker")))
            revoker = await connect_bus(as_revoker, "authorizer-revoker", declare=False)
            resources.push_async_callback(revoker.close)
        else:
            log.warning(
                "revocation_off",
                reason=f"no {store.path('revoker')}: sidecars are judged only when they connect",
            )
        service = AuthorizerService(
            bus,
            issuer=issuer,
            node_keys=store.sidecar_keys,
            revoker=revoker,
            grace_s=settings.sidecar_revoke_after_s,
            identities=store.identities,
        )
        probes.watch(bus=bus, projection=service.projection)
        await service.run(stop)
