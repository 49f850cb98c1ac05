"""``shoal run profiler``: the leader-elected profiler as its own process.

Thin wiring: settings -> bus, clock and parameters -> :class:`ProfilerService`.
Profiler-specific settings are read with defaults (``profiler_min_interval_s``,
``profiler_material_change``, ``profiler_window``, ``profiler_fit_min_counts``,
``profiler_plateau_delta``) so this module works whether or not the settings
struct carries them yet. The profiler snapshot's cadence is the allocator's
(``snapshot_every``, ``snapshot_interval_s``). On ``stop`` the pass in progress is finished, then the
lease is released so a standby takes over at once.
"""

from __future__ import annotations

import asyncio
import contextlib

from shoal import probes
from shoal.profiling import ProfileParams
from shoal.profiling.ratelimit import MIN_INTERVAL_S
from shoal.runtime import connect_bus, holder_id, make_clock
from shoal.settings import Settings
from shoal_services.profiler.service import ProfilerService


def params_from(settings: Settings) -> ProfileParams:
    """The profiling parameters in ``settings`` (defaults for those it lacks)."""
    d = ProfileParams()
    return ProfileParams(
        window=int(getattr(settings, "profiler_window", d.window)),
        max_rate=float(getattr(settings, "profiler_max_rate", d.max_rate)),
        fit_min_counts=int(getattr(settings, "profiler_fit_min_counts", d.fit_min_counts)),
        fit_max_error=float(getattr(settings, "profiler_fit_max_error", d.fit_max_error)),
        plateau_delta=getattr(settings, "profiler_plateau_delta", d.plateau_delta),
    )


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    """Run the profiler until ``stop`` is set."""
    clock = make_clock(settings)
    async with contextlib.AsyncExitStack() as resources:
        bus = await connect_bus(settings, "profiler")
        resources.push_async_callback(bus.close)
        service = ProfilerService(
            bus,
            holder=holder_id("profiler"),
            clock=clock,
            params=params_from(settings),
            min_interval_s=float(getattr(settings, "profiler_min_interval_s", MIN_INTERVAL_S)),
            material_change=float(getattr(settings, "profiler_material_change", 0.05)),
            lease_ttl_s=settings.lease_ttl_s,
            snapshot_every=settings.snapshot_every,
            snapshot_interval_s=settings.snapshot_interval_s,
        )
        probes.watch(bus=bus, projection=service.projection, role=lambda: service.role)
        await service.run(stop)
