"""``shoal run authorizer``: the auth callout service for per-job sidecar identities.

Started by ``shoal up`` when its embedded server runs with the auth callout
(:mod:`shoal.callout`, ``docs/security.md``). It needs the credentials directory of
the installation: its own seed (``SHOAL_NATS_CREDS``), the callout issuer's seed
(``callout-issuer.nk`` next to it) and the manifest, whose ``sidecar-<node>`` public
keys verify the sidecar tokens. It is not leader-elected: answers depend only on the
log, so any number may run; they share the requests (one queue group), each request
answered by one of them.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from shoal import callout as co
from shoal import probes
from shoal.auth import ISSUER, CredentialStore
from shoal.runtime import StartupError, connect_bus, resolve_creds
from shoal.settings import Settings
from shoal_services.authorizer.service import AuthorizerService


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
        service = AuthorizerService(bus, issuer=issuer, node_keys=store.sidecar_keys)
        probes.watch(bus=bus, projection=service.projection)
        await service.run(stop)
