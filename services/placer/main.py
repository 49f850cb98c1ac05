"""``shoal run placer``: the leader-elected placer as its own process.

On ``stop`` the placement in progress is finished and published, then the lease
is released.
"""

from __future__ import annotations

import asyncio
import contextlib

from shoal import probes
from shoal.allocation import PLACERS
from shoal.runtime import StartupError, connect_bus, holder_id, make_clock
from shoal.settings import Settings
from shoal_services.placer.service import PlacerService


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    """Run the placer until ``stop`` is set.

    Raises:
        StartupError: unknown placer name.
    """
    if settings.placer not in PLACERS:
        raise StartupError(f"unknown placer {settings.placer!r}; choose one of {', '.join(PLACERS)}")
    clock = make_clock(settings)
    async with contextlib.AsyncExitStack() as resources:
        bus = await connect_bus(settings, "placer")
        resources.push_async_callback(bus.close)
        service = PlacerService(
            bus,
            holder=holder_id("placer"),
            clock=clock,
            placer=settings.placer,
            lease_ttl_s=settings.lease_ttl_s,
        )
        probes.watch(bus=bus, projection=service.projection, role=lambda: service.role)
        await service.run(stop)
