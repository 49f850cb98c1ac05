"""The real trainer sidecar: runs a ``shoal.train`` job's worker processes.

It reads the same ``Reconfigure`` order stream on stdin as the emulated trainer
(one JSON object per line, from the node daemon) and reports the same events, so
the node daemon treats both modes alike.

One sidecar per job per node: the node daemon of every node the job is placed on
starts one and sends it the job's whole GPU set at each epoch.

Leadership (EDL §4.1): the job's sidecars campaign for the lease ``train.<job>`` in
JetStream KV. Only the leader runs the :class:`~shoal.train.controller.Controller`
(rendezvous store, control server, the job's generations). The others follow the
order stream and campaign; when the leader's lease lapses (it died) one of them
takes over and starts the job from the newest order, restoring the checkpoint named
in the job metadata. A leader that leaves on purpose (stdin closed, SIGTERM)
checkpoints, writes the metadata (checkpoint directory, step, epoch) to the KV
bucket ``<P>_TRAIN_META`` and releases the lease, so the next leader takes over at
once instead of after the TTL.

Leader handover without a restart (EDL §4.2, "if the leader is instructed to leave"):
when the leader is stopped and the newest order places the job only on other nodes
(the leader's node was taken out of the share), it first carries that order out (a
graceful scale-in: its own workers leave at the switch), then detaches
(:meth:`~shoal.train.controller.Controller.detach`): it closes its control server
without killing the surviving workers, writes the running generation (members,
GPUs, epoch) into the metadata as ``handover`` and releases the lease. The survivors
keep training in their process group meanwhile. The next leader adopts them
(:meth:`~shoal.train.controller.Controller.adopt`): those of its own node from its
worker host, those of other nodes through their sidecars (``adopt`` in
``remote.py``); the workers find its control server through the leader file in the
checkpoint directory. Nobody reloads the checkpoint. Followers keep the workers of
a leader that handed over (instead of killing them as orphans) for
``handover_keep_s``. A leader that is killed cannot hand over: its own workers die
with it, the survivors' collective fails, and the next leader restarts the job from
the checkpoint (consistent recovery, EDL §4.2).

Workers run on the nodes the placement names (see ``remote.py``): the leader starts
those of its own node as its children, and those of another node through that
node's sidecar of the job, which runs them as its children (they die with it) and
reports their exits. A GPU of another node is valid when the node registered it
(``NodeRegistered`` in the log); the worker start then waits (up to the rendezvous
timeout) for the node's sidecar to answer, since the node daemons start a job's
sidecars at the same time. Workers reach the leader's control server and rendezvous
store at ``advertise_host`` (``--advertise-host``, ``SHOAL_SIDECAR_HOST`` through
the node daemon): the default ``127.0.0.1`` only serves a job whose nodes share one
machine; across machines it must be an address of the leader's node that the others
reach (and gloo may need ``GLOO_SOCKET_IFNAME`` in ``spec.env``). The checkpoint
directory must be storage that every node of the job sees, as for a leader
handover.

A job that needs more restarts (worker deaths, failed starts) than its
``SHOAL_TRAIN_MAX_RESTARTS`` (:class:`~shoal.train.config.TrainConfig`) has its workers
stopped by the controller, and the leader publishes ``JobFailed`` with the reason.

A follower that is stopped (the job left its node) gives the workers it hosts
``drain_s`` to leave at the switch of the graceful scale-in before it kills them; a
worker that dies with its node reaches the leader as a worker death, which the
controller recovers from.

What the job runs comes from its ``JobSubmitted``: ``spec.entrypoint`` is the
worker command, ``spec.env`` its extra environment. ``SHOAL_TRAIN_API=0`` in
``spec.env`` marks a script that does not use ``shoal.train``: every change is a
checkpoint-restart. ``SHOAL_TRAIN_RESHAPE=restart`` asks for checkpoint-restart
even with the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec
import nats.js.errors
import structlog
from nats.js import api
from opentelemetry import trace
from opentelemetry.util.types import AnyValue
from shoal import codec
from shoal import events as ev
from shoal.bus import Bus, ConcurrencyConflict, LeaderLease
from shoal.events import GpuRef
from shoal.log import bound_job
from shoal.telemetry import extract
from shoal.train import protocol as pr
from shoal.train.config import ENV_PREFIX, TrainConfig
from shoal.train.controller import Controller, OrderError, ReconfigurationFailedError
from shoal.train.launch import LaunchRequest, WorkerProcess, launch_local
from shoal_services.trainer_sidecar.remote import RemoteWorkers, WorkerHost

log = structlog.get_logger("shoal.sidecar.real")


class RealSidecar:
    """One job's sidecar on one node in real mode; see the module docstring."""

    def __init__(
        self,
        bus: Bus,
        job_id: str,
        node_id: str,
        *,
        devices: Sequence[int],
        device: str = "cpu",
        gpu_type: str = "cpu",
        workdir: Path,
        train: TrainConfig | None = None,
        lease_ttl_s: float = 3.0,
        report_every_s: float = 1.0,
        report_max_every_s: float | None = None,
        measure_window_s: float | None = None,
        allowance_s: float = 0.5,
        advertise_host: str = "127.0.0.1",
        drain_s: float = 5.0,
        poll_s: float = 1.0,
        handover_keep_s: float | None = None,
    ) -> None:
        self.bus = bus
        self.job_id = job_id
        self.node_id = node_id
        self.devices = tuple(devices)
        self.device = device
        self.gpu_type = gpu_type
        self.workdir = workdir
        self.train = train or TrainConfig(device=device)
        self.lease_ttl_s = lease_ttl_s
        self.report_every_s = report_every_s
        self.report_max_every_s = report_max_every_s
        self.measure_window_s = measure_window_s
        self.allowance_s = allowance_s
        self.advertise_host = advertise_host
        self.drain_s = drain_s
        self.poll_s = poll_s
        self.handover_keep_s = self.train.rendezvous_timeout_s if handover_keep_s is None else handover_keep_s
        """How long followers keep the workers of a leader that handed over, unadopted."""
        self.holder = f"{node_id}-{os.getpid()}"
        self.commands: asyncio.Queue[ev.Reconfigure] = asyncio.Queue()
        self.order_context: dict[int, dict[str, str]] = {}
        """Epoch -> W3C fields that came with that order (set by the order reader)."""
        self.newest: ev.Reconfigure | None = None
        self.controller: Controller | None = None
        self.spec: ev.JobSpec | None = None
        self._meta_kv: object = None
        self._completed = False
        self.node_gpus: dict[str, frozenset[int]] = {}
        """GPU indices other nodes registered (``NodeRegistered``), learnt as orders name them."""
        self.remote: RemoteWorkers | None = None
        """The leader's launcher for workers on other nodes."""
        self.host: WorkerHost | None = None
        """Runs the workers a leader on another node asks this node for."""
        self._leading = False

    # -- what the job is ------------------------------------------------------------------

    async def _last_event(self, name: str, aggregate: str = "job", key: str = "") -> ev.Event | None:
        subject = f"{self.bus.names.prefix}.{aggregate}.{key or self.job_id}.{name}"
        try:
            raw = await self.bus.js.get_last_msg(self.bus.names.events_stream, subject)
        except nats.js.errors.NotFoundError:
            return None
        return codec.decode(raw.data or b"").event

    async def load(self) -> ev.JobSpec:
        submitted = await self._last_event("submitted")
        if not isinstance(submitted, ev.JobSubmitted):
            raise RuntimeError(f"job {self.job_id} has no JobSubmitted in the log")
        if not submitted.spec.entrypoint:
            raise RuntimeError(f"job {self.job_id} has no entrypoint: real mode needs spec.entrypoint")
        self.spec = submitted.spec
        return submitted.spec

    def gpu_index(self, gpu: GpuRef) -> int:
        """The GPU's device index (CUDA) or CPU slot on its own node.

        Raises:
            OrderError: a GPU this node does not have, or another node did not register.
        """
        if gpu.node_id == self.node_id:
            if gpu.index not in self.devices:
                raise OrderError(
                    f"unknown GPU {gpu.node_id}/{gpu.index}: node {self.node_id} has {list(self.devices)}"
                )
            return gpu.index
        known = self.node_gpus.get(gpu.node_id)
        if known is None:
            raise OrderError(f"unknown GPU {gpu.node_id}/{gpu.index}: node {gpu.node_id} is not registered")
        if gpu.index not in known:
            raise OrderError(
                f"unknown GPU {gpu.node_id}/{gpu.index}: node {gpu.node_id} registered {sorted(known)}"
            )
        return gpu.index  # the node's sidecar resolves it to its own device

    def own_gpu_index(self, gpu: GpuRef) -> int:
        """:meth:`gpu_index` for a GPU that must be on this node (a spawn from the leader)."""
        if gpu.node_id != self.node_id:
            raise OrderError(f"GPU {gpu.node_id}/{gpu.index} is not on node {self.node_id}")
        return self.gpu_index(gpu)

    async def learn_nodes(self, gpus: Sequence[GpuRef]) -> None:
        """Read the registration of every other node ``gpus`` name that is not known yet
        (or lacks a GPU named: the node may have registered again)."""
        for node in sorted({g.node_id for g in gpus} - {self.node_id}):
            known = self.node_gpus.get(node, frozenset())
            if all(g.index in known for g in gpus if g.node_id == node):
                continue
            try:
                registered = await self._last_event("registered", aggregate="node", key=node)
            except Exception as exc:  # the order is then rejected as naming an unknown node
                log.warning("node_lookup_failed", job_id=self.job_id, node=node, error=str(exc))
                continue
            if isinstance(registered, ev.NodeRegistered):
                self.node_gpus[node] = frozenset(g.index for g in registered.gpus)

    async def _launch(self, request: LaunchRequest) -> WorkerProcess:
        """The controller's launcher: a child here, or a child of the GPU's node's sidecar."""
        if request.gpu.node_id == self.node_id:
            log_dir = self.workdir / self.job_id / self.holder / "logs"
            return await launch_local(request, device_index=self.gpu_index(request.gpu), log_dir=log_dir)
        assert self.remote is not None
        return await self.remote.launch(request)

    # -- events -------------------------------------------------------------------------------

    async def _emit(self, event: ev.Event) -> None:
        await self.bus.publish(codec.wrap(event, at=time.time()))

    async def _meta(self) -> object:
        if self._meta_kv is None:
            bucket = self.bus.names.train_meta_bucket
            self._meta_kv = await self.bus.key_value(
                api.KeyValueConfig(bucket=bucket, history=1, storage=api.StorageType.FILE)
            )
        return self._meta_kv

    async def read_meta(self) -> dict[str, object]:
        kv = await self._meta()
        try:
            entry = await kv.get(f"train.{self.job_id}")  # type: ignore[attr-defined]
        except nats.js.errors.KeyNotFoundError:
            return {}
        return json.loads(entry.value or b"{}")

    async def write_meta(self, handover: pr.Handover | None = None) -> None:
        ctl = self.controller
        if ctl is None:
            return
        meta: dict[str, object] = {
            "checkpoint_dir": ctl.train.checkpoint_dir,
            "step": ctl.progress.step if ctl.progress else 0,
            "epoch": ctl.epoch,
            "leader": self.holder,
        }
        if handover is not None:
            meta["handover"] = msgspec.to_builtins(handover)
            meta["handover_at"] = time.time()
        kv = await self._meta()
        await kv.put(f"train.{self.job_id}", json.dumps(meta).encode())  # type: ignore[attr-defined]

    # -- leadership ----------------------------------------------------------------------------

    async def _lead(self) -> None:
        """Became leader: start the controller on the newest order, from the handed-over state."""
        assert self.spec is not None
        self._leading = True
        meta = await self.read_meta()
        handover = self._handover_in(meta)
        adopted_here: dict[int, asyncio.subprocess.Process] = {}
        if self.host is not None:
            if handover is not None:
                adopted_here = self.host.release(handover.leader, handover.members)
            # Other workers this node ran for the previous leader belong to no generation now.
            await self.host.drop_others(self.holder)
        checkpoint_dir = str(meta.get("checkpoint_dir") or self.workdir / self.job_id / "checkpoint")
        env = dict(self.spec.env)
        train = self.train
        per_job = {k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}
        if per_job:
            # Per-job options (e.g. SHOAL_TRAIN_RECOVERY=approximate) ride in spec.env.
            try:
                train = TrainConfig.from_env({**train.to_env(), **per_job})
            except ValueError as exc:
                log.error("bad_job_train_options", job_id=self.job_id, error=str(exc))
        train = msgspec.structs.replace(train, checkpoint_dir=checkpoint_dir)
        self.remote = RemoteWorkers(
            self.bus.nc,
            self.bus.names.prefix,
            self.job_id,
            self.holder,
            spawn_timeout_s=train.rendezvous_timeout_s,
            poll_s=self.poll_s,
        )
        await self.remote.start()
        self.controller = Controller(
            job_id=self.job_id,
            argv=self.spec.entrypoint,
            workdir=self.workdir / self.job_id / self.holder,
            gpu_index=self.gpu_index,
            max_gpus=self.spec.max_gpus,
            emit=self._emit,
            env=env,
            train=train,
            api=env.get("SHOAL_TRAIN_API", "1") != "0",
            restart_only=env.get("SHOAL_TRAIN_RESHAPE", "") == "restart",
            allowance_s=self.allowance_s,
            report_every_s=self.report_every_s,
            report_max_every_s=self.report_max_every_s,
            measure_window_s=self.measure_window_s,
            gpu_type=self.gpu_type,
            host=self.advertise_host,
            launch=self._launch,
            leader_id=self.holder,
        )
        await self.controller.start()
        if handover is not None:
            await self._adopt(handover, adopted_here)
        await self.write_meta()
        log.info("sidecar_leads", job_id=self.job_id, holder=self.holder, meta=meta)
        if self.newest is not None:
            await self.controller.apply(self.newest)

    def _handover_in(self, meta: dict[str, object]) -> pr.Handover | None:
        """The generation a previous leader handed over in ``meta``, if it is recent."""
        raw = meta.get("handover")
        at = meta.get("handover_at")
        if not raw or meta.get("leader") == self.holder or not isinstance(at, int | float):
            return None
        if time.time() - at > self.handover_keep_s:
            return None  # the followers no longer keep its workers
        try:
            return msgspec.convert(raw, pr.Handover)
        except msgspec.ValidationError as exc:
            log.error("bad_handover", job_id=self.job_id, error=str(exc))
            return None

    async def _adopt(self, handover: pr.Handover, here: dict[int, asyncio.subprocess.Process]) -> bool:
        """Take over the workers ``handover`` names (see the module docstring); on any
        missing one, kill the ones taken and let the newest order start the job afresh."""
        assert self.controller is not None and self.remote is not None
        procs: dict[int, WorkerProcess] = {}
        for wid, (node, _index) in zip(handover.members, handover.gpus, strict=True):
            if node == self.node_id:
                if wid in here:
                    procs[wid] = here.pop(wid)
            elif (remote := await self.remote.adopt(node, handover.leader, wid)) is not None:
                procs[wid] = remote
        try:
            if len(procs) != len(handover.members):
                raise ReconfigurationFailedError(
                    f"workers {sorted(set(handover.members) - set(procs))} are gone"
                )
            await self.controller.adopt(handover, procs)
        except ReconfigurationFailedError as exc:
            log.warning("handover_not_adopted", job_id=self.job_id, error=str(exc))
            for proc in [*procs.values(), *here.values()]:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            return False
        for proc in here.values():  # this node's workers of the old leader outside the generation
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        log.info("handover_adopted", job_id=self.job_id, previous=handover.leader, gen=handover.gen)
        return True

    async def _hand_over(self) -> bool:
        """A leader that is stopped: hand the job over in place when the newest order
        places it only on other nodes (see the module docstring). Returns whether it did;
        if not, the caller resigns with a checkpoint."""
        # Orders that came with the end of stdin are carried out first.
        while not self.commands.empty():
            await self._on_order(self.commands.get_nowait())
        ctl, newest = self.controller, self.newest
        if ctl is None or newest is None or not newest.gpus:
            return False
        if any(g.node_id == self.node_id for g in newest.gpus):
            return False  # the job goes on here: this node is not leaving it
        try:
            await ctl.wait_idle(self.train.rendezvous_timeout_s + self.train.collective_timeout_s)
        except ReconfigurationFailedError as exc:
            log.warning("handover_impossible", job_id=self.job_id, error=str(exc))
            return False
        if ctl.current is None or set(ctl.current.gpus) != set(newest.gpus) or not ctl.can_hand_over():
            return False
        handover = await ctl.detach()
        with contextlib.suppress(Exception):
            await self.write_meta(handover)
        self.controller = None
        if self.remote is not None:
            await self.remote.close()  # stops polling; the followers keep the workers
            self.remote = None
        self._leading = False
        log.info("leader_handed_over", job_id=self.job_id, gen=handover.gen, members=handover.members)
        return True

    async def _resign(self, *, checkpoint: bool) -> None:
        if self.controller is None:
            return
        await self.controller.close(checkpoint=checkpoint)
        with contextlib.suppress(Exception):
            await self.write_meta()
        self.controller = None
        if self.remote is not None:
            await self.remote.close()
            self.remote = None
        self._leading = False

    async def _complete(self) -> None:
        ctl = self.controller
        if ctl is None or self._completed:
            return
        self._completed = True
        step = ctl.progress.step if ctl.progress else 0
        if ctl.progress is not None:
            await self._emit(ctl.progress_event())
        try:
            await self.bus.publish_first(
                codec.wrap(ev.JobCompleted(job_id=self.job_id, iterations=step), at=time.time())
            )
        except ConcurrencyConflict:
            pass  # another sidecar of this job completed it first
        log.info("job_completed", job_id=self.job_id, iterations=step)

    async def _fail(self, reason: str) -> None:
        """The job needed a restart beyond its ``max_restarts``: ``JobFailed`` (once, as
        :meth:`_complete`); the node daemons then stop its sidecars."""
        if self._completed:
            return
        self._completed = True
        try:
            await self.bus.publish_first(
                codec.wrap(ev.JobFailed(job_id=self.job_id, reason=reason[:4096]), at=time.time())
            )
        except ConcurrencyConflict:
            pass  # another sidecar of this job ended it first
        log.error("job_failed", job_id=self.job_id, reason=reason)

    async def _campaign(self, lease: LeaderLease, stop: asyncio.Event, changed: asyncio.Event) -> None:
        """Renew or try to take the lease every TTL/3, on its own task so that slow work never
        delays a renewal; ``changed`` wakes the main loop when leadership flips."""
        while not stop.is_set():
            was = lease.is_leader
            try:
                await lease.try_acquire()
            except Exception as exc:  # the bus is briefly unreachable: not leader until renewed
                log.warning("lease_error", job_id=self.job_id, error=str(exc))
                lease.revision = None
            if lease.is_leader != was:
                changed.set()
            if not lease.is_leader and self.host is not None and self.host.leaders():
                # Workers run here for a leader that no longer holds the lease (it died):
                # they must not outlive it, unless it handed them over to the next leader.
                # The grace covers a lease read that lags a spawn.
                with contextlib.suppress(Exception):
                    holder = await lease.holder_now()
                    keep: set[str] = set()
                    if self.host.leaders() - {holder}:
                        handover = self._handover_in(await self.read_meta())
                        keep = {handover.leader} if handover is not None else set()
                    await self.host.drop_others(holder, grace_s=self.lease_ttl_s, keep=keep)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.lease_ttl_s / 3)

    def _refuse_spawn(self) -> str:
        return f"the sidecar on {self.node_id} leads job {self.job_id}" if self._leading else ""

    async def run(self, stop: asyncio.Event) -> None:
        spec = await self.load()
        # Serve the leader's worker starts at once: it may be waiting for this node.
        self.host = WorkerHost(
            self.bus.nc,
            self.bus.names.prefix,
            self.job_id,
            self.node_id,
            resolve=self.own_gpu_index,
            log_dir=self.workdir / self.job_id / self.holder / "logs",
            refuse=self._refuse_spawn,
            argv=spec.entrypoint,
            env=spec.env,
        )
        await self.host.start()
        # torch's import takes seconds: do it before campaigning, off the event loop.
        await asyncio.to_thread(importlib.import_module, "torch.distributed")
        lease: LeaderLease = await self.bus.lease(f"train.{self.job_id}", self.holder, ttl_s=self.lease_ttl_s)
        changed = asyncio.Event()
        # Its own stop: a leader keeps its lease while it hands over after ``stop``.
        campaigning = asyncio.Event()
        campaign = asyncio.create_task(self._campaign(lease, campaigning, changed))
        try:
            while not stop.is_set():
                order: ev.Reconfigure | None = None
                with contextlib.suppress(TimeoutError):
                    order = await asyncio.wait_for(self.commands.get(), 0.2)
                # Leadership first: an order that arrives as the lease is won is the leader's.
                if changed.is_set():
                    changed.clear()
                    if lease.is_leader and self.controller is None:
                        await self._lead()
                    elif not lease.is_leader and self.controller is not None:
                        log.warning("sidecar_lost_lease", job_id=self.job_id, holder=self.holder)
                        await self._resign(checkpoint=False)
                if order is not None:
                    await self._on_order(order)
                if self.controller is not None and self.controller.done.is_set():
                    await self._complete()
                elif self.controller is not None and self.controller.failed is not None:
                    await self._fail(self.controller.failed)
        finally:
            handed = False
            if lease.is_leader and self.controller is not None:
                try:
                    handed = await self._hand_over()
                except Exception as exc:
                    log.error("handover_failed", job_id=self.job_id, error=str(exc))
            campaigning.set()
            campaign.cancel()
            await asyncio.gather(campaign, return_exceptions=True)
            if lease.is_leader or handed:
                if not handed:
                    await self._resign(checkpoint=True)
                await lease.release()
            await self.host.close(drain_s=self.drain_s)

    async def _on_order(self, order: ev.Reconfigure) -> None:
        """One order, in a span ``sidecar.reconfigure`` that continues the node daemon's
        trace; the controller's events (and the reconfiguration task it starts, which
        inherits the context) carry it on."""
        parent = extract(self.order_context.pop(order.epoch, None))
        attributes: dict[str, AnyValue] = {
            "shoal.job_id": self.job_id,
            "shoal.epoch": order.epoch,
            "shoal.node_id": self.node_id,
            "shoal.gpus": len(order.gpus),
            "shoal.leader": self.controller is not None,
        }
        tracer = trace.get_tracer("shoal.sidecar.real")
        with (
            tracer.start_as_current_span(
                "sidecar.reconfigure", context=parent, kind=trace.SpanKind.CONSUMER, attributes=attributes
            ) as span,
            bound_job(job_id=self.job_id, epoch=order.epoch),
        ):
            outcome = await self._take_order(order)
            if outcome:
                span.set_attribute("shoal.outcome", outcome)

    async def _take_order(self, order: ev.Reconfigure) -> str | None:
        await self.learn_nodes(order.gpus)
        if self.newest is None or order.epoch > self.newest.epoch:
            # A follower keeps the newest valid order to start from if it takes over.
            try:
                if self.controller is None:
                    for g in order.gpus:
                        self.gpu_index(g)
                self.newest = order
            except OrderError:
                pass
        if self.controller is not None:
            return await self.controller.apply(order)
        return None


def parse_devices(spec: str) -> tuple[int, ...]:
    """``--devices 0,1,3`` or ``--devices 4`` (slots 0..3).

    Raises:
        ValueError: not a count or a comma-separated list of indices.
    """
    spec = spec.strip()
    try:
        if "," in spec:
            out = tuple(int(x) for x in spec.split(",") if x.strip())
        else:
            out = tuple(range(int(spec)))
    except ValueError:
        raise ValueError(f"--devices must be a count or a list like 0,1,3; got {spec!r}") from None
    if not out or any(i < 0 for i in out) or len(set(out)) != len(out):
        raise ValueError(f"--devices must name distinct non-negative indices; got {spec!r}")
    return out


async def run_with_stdin_orders(
    sidecar: RealSidecar, stop: asyncio.Event, stdin: asyncio.StreamReader | None = None
) -> None:
    """Run ``sidecar`` on the node daemon's order stream (stdin) until ``stop`` or end of stdin.

    The one call an entry point needs for ``--mode real`` (``__main__`` and any other).
    Where the process has no tracing yet, it is set up from the variables the node
    daemon exports (``SHOAL_TRACE_JSONL``, ``OTEL_EXPORTER_OTLP_ENDPOINT``), so that the
    sidecar's spans continue the daemon's traces.
    """
    from shoal.tasks import critical
    from shoal.telemetry import setup_tracing, tracing_enabled
    from shoal_services.trainer_sidecar.__main__ import _read_orders

    tracing = None
    if not tracing_enabled():
        tracing = setup_tracing(
            "trainer-sidecar",
            trace_jsonl=os.environ.get("SHOAL_TRACE_JSONL") or None,
            node_id=getattr(sidecar, "node_id", None),
        )
    reader = critical(asyncio.create_task(_read_orders(sidecar, stop, stdin)))
    try:
        await sidecar.run(stop)
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        if tracing is not None:
            tracing.shutdown()
