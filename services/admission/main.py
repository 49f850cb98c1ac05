"""``shoal run admission``: the admission service as its own process.

Wiring only: connect, follow the log (:class:`~shoal.projection.Projection`), answer
commands and queries (:mod:`shoal_services.admission.query`) until ``stop``; then stop
taking requests, let in-flight ones finish (``drain`` of the request subscriptions)
and close the connection.
"""

from __future__ import annotations

import asyncio
import contextlib

from shoal import admission, probes
from shoal.projection import CLUSTER_SNAPSHOT, Projection
from shoal.runtime import connect_bus, make_clock
from shoal.settings import Settings
from shoal_services.admission.query import QueryService
from shoal_services.admission.service import AdmissionService


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    """Run admission until ``stop`` is set, then drain."""
    clock = make_clock(settings)
    async with contextlib.AsyncExitStack() as resources:
        bus = await connect_bus(settings, "admission")
        resources.push_async_callback(bus.close)
        projection = Projection(bus, snapshot_name=CLUSTER_SNAPSHOT)
        probes.watch(bus=bus, projection=projection)
        await projection.start()
        resources.push_async_callback(projection.stop)
        await projection.wait_ready()
        limits = admission.Limits(
            max_active_jobs_per_user=settings.max_active_jobs_per_user,
            max_gpus_per_user=settings.max_gpus_per_user,
            enforce_users=settings.registered_users_only,
            entrypoints=settings.entrypoints,
            job_env=settings.job_env,
        )
        # The MQTT bridge runs when the installation has an MQTT listener (`shoal up --mqtt`).
        service = AdmissionService(
            bus, projection, limits, clock=clock, mqtt_bridge=settings.mqtt_port is not None
        )
        await service.start()
        resources.push_async_callback(service.stop)
        # Reads (shoal jobs/status/nodes) from the same folded state (shoal.queries).
        queries = QueryService(bus, projection)
        await queries.start()
        resources.push_async_callback(queries.stop)
        await stop.wait()
