"""The sidecar side of ``shoal.train``: worker processes, generations, reconfiguration.

One :class:`Controller` per job, run by the job's leader sidecar. It turns
``Reconfigure(epoch, gpus)`` orders into generations (see :mod:`shoal.train` for
the protocol) and reports what happened through ``emit`` as shoal events:
``ReconfigurationStarted/Phase/Completed/Cancelled/Failed`` and ``ProgressReported``.
It knows nothing of NATS, so it is driven the same way by the sidecar and by tests.

Workers are started through a *launcher* (:mod:`shoal.train.launch`): by default
children of this process; the real sidecar passes one that starts the workers of
GPUs on other nodes through those nodes' sidecars of the same job and hands back a
process handle with the same interface. Workers find the control server and the
``TCPStore`` at ``host`` (the address this controller advertises), so ``host`` must
be reachable from every node the job runs on.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import math
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import structlog

from shoal import events as ev
from shoal.events import GpuRef
from shoal.reporting import ReportBackoff
from shoal.train import protocol as pr
from shoal.train.config import TrainConfig
from shoal.train.launch import Launcher, LaunchRequest, WorkerProcess, launch_local

log = structlog.get_logger("shoal.train.controller")

Emit = Callable[[ev.Event], Awaitable[None]]


class OrderError(ValueError):
    """A reconfiguration order that can never be carried out (bad GPU ids, too many GPUs)."""


class ReconfigurationFailedError(RuntimeError):
    pass


class _Superseded(Exception):
    """A newer epoch cancelled the reconfiguration at a safe point."""


@dataclass
class Worker:
    id: int
    gpu: GpuRef
    proc: WorkerProcess
    writer: asyncio.StreamWriter | None = None
    plan: pr.Plan | None = None
    exited: bool = False
    expected_exit: bool = False
    ready: set[int] = field(default_factory=set)
    reported_failure: bool = False
    """It sent ``WorkerFailed``: a collective broke under it (a peer failed first)."""


@dataclass
class Generation:
    gen: int
    members: tuple[int, ...]
    gpus: tuple[GpuRef, ...]


@dataclass
class ReconfigurationRecord:
    """What one reconfiguration cost; the benchmark reads these."""

    epoch: int
    kind: str
    from_world: int
    to_world: int
    outcome: str = "in_flight"
    started: float = 0.0
    finished: float = 0.0
    stop_time_s: float = 0.0
    gpu_time_lost_s: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    cancel_latency_s: float = 0.0


@dataclass
class _InFlight:
    epoch: int
    kind: str
    target: tuple[GpuRef, ...]
    record: ReconfigurationRecord
    task: asyncio.Task[None] | None = None
    gen: int = -1
    committed: bool = False
    cancel_by: int = -1
    cancel_at: float = 0.0
    reason: str = "superseded"


class Controller:
    """Runs one job's workers on this node; see the module docstring.

    Args:
        job_id: the job.
        argv: the user's command (``JobSpec.entrypoint``).
        workdir: checkpoints and worker logs go here.
        gpu_index: maps a ``GpuRef`` to its device index (CUDA) or slot (CPU) on its
            node; raises :class:`OrderError` for a GPU the job cannot use.
        max_gpus: the job's ``max_gpus``.
        emit: publishes an event.
        api: the script uses ``shoal.train`` (stop-free changes possible); else every
            change is a checkpoint-restart and workers get torchrun's variables.
        restart_only: force checkpoint-restart (a per-job choice; also the baseline).
        allowance_s: EDL's ``T_a``: the switch is committed ``ceil(T_a / T_b)`` steps ahead.
        host: the address the control server and the rendezvous store bind to and that
            workers connect to.
        launch: starts one worker; default: a child of this process on
            ``gpu_index(gpu)`` (:func:`shoal.train.launch.launch_local`).
        failure_settle_s: how long a recovery waits to learn which worker failed when
            the first death it sees is a worker whose collective broke under it.
        leader_id: this controller's id, given to its workers as ``SHOAL_TRAIN_LEADER``
            (default: a random one); see :meth:`detach` and :meth:`adopt`.
    """

    def __init__(
        self,
        *,
        job_id: str,
        argv: Sequence[str],
        workdir: Path,
        gpu_index: Callable[[GpuRef], int],
        max_gpus: int,
        emit: Emit,
        env: dict[str, str] | None = None,
        train: TrainConfig | None = None,
        api: bool = True,
        restart_only: bool = False,
        allowance_s: float = 0.5,
        report_every_s: float = 1.0,
        report_max_every_s: float | None = None,
        measure_window_s: float | None = None,
        gpu_type: str = "cpu",
        host: str = "127.0.0.1",
        launch: Launcher | None = None,
        failure_settle_s: float = 3.0,
        leader_id: str = "",
    ) -> None:
        if not argv:
            raise ValueError(f"job {job_id} has no entrypoint to run")
        self.job_id = job_id
        self.argv = list(argv)
        self.workdir = Path(workdir)
        self.gpu_index = gpu_index
        self.max_gpus = max_gpus
        self.emit = emit
        self.env = dict(env or {})
        self.train = train or TrainConfig()
        self.api = api
        self.restart_only = restart_only
        self.allowance_s = allowance_s
        self.reports = ReportBackoff(report_every_s, report_max_every_s)
        """The interval of ``ProgressReported``: ``report_every_s`` after each new
        generation (a change of shape, a recovery), doubling up to ``report_max_every_s``
        (unset: a fixed interval; :mod:`shoal.reporting`)."""
        self.measure_window_s = measure_window_s
        """The profiler's measurement window (seconds): a report is due once it has passed
        since a new generation's first step, plus 1 s for the profiler's rounding up to a
        whole second (None: no such report)."""
        self._reported_gen = -1
        self.gpu_type = gpu_type
        self.host = host
        self.launch: Launcher = launch or self.launch_local
        self.failure_settle_s = failure_settle_s
        self.leader_id = leader_id or f"ctl-{uuid.uuid4().hex[:12]}"
        self._failed: dict[int, Worker] = {}
        """Members that died unexpectedly since the last recovery (see :meth:`_culprits`)."""
        self.epoch = -1
        self.workers: dict[int, Worker] = {}
        self.current: Generation | None = None
        self.inflight: _InFlight | None = None
        self.history: list[ReconfigurationRecord] = []
        self.progress: pr.Progress | None = None
        self.done = asyncio.Event()
        self.failed: str | None = None
        """Why the job failed: it needed a restart beyond ``train.max_restarts`` (see
        :meth:`_restart_allowed`); its workers are stopped and nothing starts them again."""
        self.restarts = 0
        """Restarts made after a worker death or a failed start (``train.max_restarts``), by
        this controller: a new leader's controller counts from 0 again."""
        self._changed = asyncio.Condition()
        self._next_worker = 0
        self._next_gen = 0
        self._switched: dict[int, tuple[pr.Switched, float]] = {}
        self._aborted: set[int] = set()
        self._stopped: pr.Stopped | None = None
        self._stopped_at = 0.0
        self._server: asyncio.Server | None = None
        self._store: Any = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._last_report = 0.0
        self._recovering = False
        self._closing = False
        self._queued: tuple[int, tuple[GpuRef, ...]] | None = None
        """The newest order waiting for a cancelled reconfiguration to settle."""
        self._given_back: set[GpuRef] = set()
        """GPUs whose worker died and that a recovery kept for the job since the newest
        order (:meth:`_recover`): each once, so a GPU whose worker keeps dying is left out."""

    # -- lifetime ----------------------------------------------------------------------

    async def start(self) -> None:
        import torch.distributed as dist  # the sidecar's only torch use: the rendezvous store

        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(exist_ok=True)
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        self._store = dist.TCPStore(
            self.host,
            0,
            None,
            True,
            timeout=dt.timedelta(seconds=self.train.rendezvous_timeout_s),
            wait_for_workers=False,
        )

    @property
    def control_address(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"{self.host}:{port}"

    async def close(self, *, checkpoint: bool = True, grace_s: float = 10.0) -> None:
        """Stop every worker (with a checkpoint when asked) and the servers."""
        self._closing = True
        if self.inflight is not None and self.inflight.task is not None:
            self.inflight.task.cancel()
            with contextlib.suppress(BaseException):
                await self.inflight.task
        await self._cleanup_new_workers()
        if checkpoint and self.current is not None and self.api:
            with contextlib.suppress(Exception):
                await self._checkpoint_stop(grace_s)
        await self._kill(list(self.workers.values()))
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
        self._store = None

    @property
    def checkpoint_dir(self) -> str:
        """The job's checkpoint directory; it also holds the leader file (:data:`protocol.LEADER_FILE`)."""
        return self.train.checkpoint_dir or str(self.workdir / "checkpoint")

    def can_hand_over(self) -> bool:
        """Whether :meth:`detach` may hand the running generation over: the API is used,
        training runs and is not over, and no reconfiguration or recovery is under way."""
        return (
            self.api
            and self.current is not None
            and self.inflight is None
            and self._queued is None
            and not self._recovering
            and not self.done.is_set()
            and all(m in self.workers for m in self.current.members)
        )

    async def detach(self) -> pr.Handover:
        """Leave the job without stopping it (EDL §4.2, the leader's graceful exit): close the
        control server and every worker's connection and drop the rendezvous store, but
        kill no worker. The workers keep training in their process group (gloo's connections
        are between the workers and the store is only needed to build a group; NCCL has not
        been tried) and look for the next leader (:meth:`adopt`) through the leader file.

        The caller decides whether the workers outlive this process: the ones it started as
        its own children die with it. Returns what the next leader needs.

        Raises:
            ReconfigurationFailedError: :meth:`can_hand_over` is false.
        """
        if not self.can_hand_over():
            raise ReconfigurationFailedError("nothing to hand over: no running generation, or one in flux")
        cur = self.current
        assert cur is not None
        handover = pr.Handover(
            leader=self.leader_id,
            gen=cur.gen,
            members=cur.members,
            gpus=tuple((g.node_id, g.index) for g in cur.gpus),
            next_worker=self._next_worker,
            epoch=self.epoch,
            step=self.progress.step if self.progress else 0,
        )
        self._closing = True
        for w in self.workers.values():
            w.expected_exit = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            self._server.close()
        for w in self.workers.values():
            if w.writer is not None:
                w.writer.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
        self._store = None
        self.current = None
        self.workers = {}  # no longer this controller's: close() must not kill them
        log.info("leader_detached", job_id=self.job_id, gen=handover.gen, members=handover.members)
        return handover

    async def adopt(self, handover: pr.Handover, procs: dict[int, WorkerProcess]) -> None:
        """Take over the generation another leader handed over (:meth:`detach`), after
        :meth:`start`: its workers become this controller's, in place, with their model,
        optimizer and data progress in memory; nothing is restarted or reloaded. Writes the
        leader file so that they reconnect here; later plans name this controller's store.

        ``procs`` holds a process handle for every member (a child here, or a worker on
        another node through its sidecar). Reconfigurations wait until every member has
        reconnected (up to the rendezvous timeout).

        Raises:
            ReconfigurationFailedError: this controller already runs a generation, or a
                member has no process handle.
        """
        if self.current is not None or self.workers:
            raise ReconfigurationFailedError("cannot adopt workers: this controller already runs some")
        missing = [m for m in handover.members if m not in procs]
        if missing:
            raise ReconfigurationFailedError(f"cannot adopt workers {missing}: no process handle")
        gpus = tuple(GpuRef(node, index) for node, index in handover.gpus)
        self.epoch = max(self.epoch, handover.epoch)
        self._next_worker = max(self._next_worker, handover.next_worker)
        self._next_gen = max(self._next_gen, handover.gen)
        for wid, gpu in zip(handover.members, gpus, strict=True):
            w = Worker(id=wid, gpu=gpu, proc=procs[wid])
            self.workers[wid] = w
            self._spawn_task(self._on_exit(w))
        self.current = Generation(handover.gen, handover.members, gpus)
        pr.write_leader_file(
            self.checkpoint_dir, pr.LeaderAddress(control=self.control_address, leader=self.leader_id)
        )
        log.info("workers_adopted", job_id=self.job_id, gen=handover.gen, members=handover.members)

    def connected(self) -> bool:
        """Every member of the running generation has a control connection to this controller."""
        cur = self.current
        return cur is not None and all(
            (w := self.workers.get(m)) is not None and w.writer is not None and not w.writer.is_closing()
            for m in cur.members
        )

    # -- orders ---------------------------------------------------------------------------

    def validate(self, order: ev.Reconfigure) -> tuple[GpuRef, ...]:
        """The order's GPU set, sorted, or a clear error.

        Raises:
            OrderError: another job's order, duplicate or unknown GPUs, or more GPUs than
                the job's ``max_gpus``.
        """
        if order.job_id != self.job_id:
            raise OrderError(f"order for job {order.job_id!r} sent to the sidecar of {self.job_id!r}")
        gpus = tuple(sorted(order.gpus))
        if len(set(gpus)) != len(gpus):
            raise OrderError(f"order for epoch {order.epoch} names a GPU twice: {list(gpus)}")
        if len(gpus) > self.max_gpus:
            raise OrderError(
                f"order for epoch {order.epoch} asks for {len(gpus)} GPUs; job {self.job_id} allows at most {self.max_gpus}"
            )
        for g in gpus:
            self.gpu_index(g)  # raises OrderError for an unknown GPU
        return gpus

    async def apply(self, order: ev.Reconfigure) -> str:
        """Handle one order: ``stale``, ``rejected``, ``unchanged``, ``queued`` or ``started``.

        A stale epoch (at or below the newest seen) is ignored. A malformed order is
        reported as ``ReconfigurationFailed`` and changes nothing. A newer order cancels
        the reconfiguration in flight at its earliest safe point (CoDDL §4.3) and is
        ``queued``: it starts as soon as the cancelled one has settled (cancelled, or
        completed when it was past its last safe point). ``apply`` never waits for that,
        so a burst of orders is taken in as fast as it comes, and only the newest queued
        order ever starts (the ones it replaced in the queue never began, so they have
        nothing to report).
        """
        if order.epoch <= self.epoch:
            log.info("stale_order_ignored", job_id=self.job_id, epoch=order.epoch, newest=self.epoch)
            return "stale"
        try:
            gpus = self.validate(order)
        except OrderError as exc:
            log.error("order_rejected", job_id=self.job_id, epoch=order.epoch, error=str(exc))
            await self.emit(ev.ReconfigurationFailed(job_id=self.job_id, epoch=order.epoch, reason=str(exc)))
            return "rejected"
        self.epoch = order.epoch
        self._given_back.clear()
        inflight = self.inflight
        if self._recovering or (inflight is not None and inflight.task is not None):
            if self._queued is not None:
                log.info("queued_order_replaced", job_id=self.job_id, epoch=self._queued[0], by=order.epoch)
            self._queued = (order.epoch, gpus)
            if inflight is not None and inflight.cancel_by < 0:
                inflight.cancel_by = order.epoch
                inflight.cancel_at = time.monotonic()
                await self._notify()
            return "queued"
        return await self._begin(order.epoch, gpus)

    async def _begin(self, epoch: int, gpus: tuple[GpuRef, ...]) -> str:
        """Start the reconfiguration to ``gpus`` for ``epoch`` (nothing is in flight)."""
        if self.done.is_set() or self._closing:
            return "unchanged"
        current = self.current.gpus if self.current is not None else ()
        if gpus == current:
            return "unchanged"
        kind = self._classify(current, gpus)
        record = ReconfigurationRecord(
            epoch=epoch,
            kind=kind,
            from_world=len(current),
            to_world=len(gpus),
            started=time.monotonic(),
        )
        self.history.append(record)
        inflight = _InFlight(epoch=epoch, kind=kind, target=gpus, record=record)
        self.inflight = inflight
        await self.emit(
            ev.ReconfigurationStarted(
                job_id=self.job_id, epoch=epoch, kind=kind, from_world=len(current), to_world=len(gpus)
            )
        )
        inflight.task = self._spawn_task(self._run_reconfiguration(inflight))
        return "started"

    async def _start_queued(self) -> None:
        """After a reconfiguration settled: start the newest order that waited for it."""
        queued, self._queued = self._queued, None
        if queued is None or self.inflight is not None:
            self._queued = queued if self.inflight is not None else None
            return
        await self._begin(*queued)

    def _classify(self, current: tuple[GpuRef, ...], target: tuple[GpuRef, ...]) -> str:
        if not target:
            return "stop"
        if not current:
            return "start"
        if self.restart_only or not self.api or not set(current) & set(target):
            return "restart"
        if set(current) <= set(target):
            return "scale_out"
        if set(target) <= set(current):
            return "scale_in"
        return "migrate"

    async def wait_idle(self, timeout_s: float) -> None:
        """Until no reconfiguration is in flight or waiting to start, and no recovery is
        under way (its give-back scale-out is queued only once it has recovered)."""
        await self._wait(
            lambda: self.inflight is None and self._queued is None and not self._recovering,
            timeout_s,
            "reconfiguration to finish",
        )

    # -- the reconfigurations ----------------------------------------------------------------

    async def _run_reconfiguration(self, inflight: _InFlight) -> None:
        rec = inflight.record
        try:
            if inflight.kind in ("scale_out", "scale_in", "migrate"):
                await self._warm(inflight)
            elif inflight.kind == "stop":
                await self._checkpoint_stop(self.train.collective_timeout_s)
                rec.stop_time_s = 0.0
            else:
                await self._cold(inflight)
            rec.outcome = "completed"
            rec.finished = time.monotonic()
            world = len(self.current.members) if self.current else 0
            await self.emit(
                ev.ReconfigurationCompleted(
                    job_id=self.job_id,
                    epoch=inflight.epoch,
                    world_size=world,
                    gpus=self.current.gpus if self.current else (),
                    stop_time_s=rec.stop_time_s,
                    duration_s=rec.finished - rec.started,
                )
            )
        except _Superseded:
            rec.outcome = "cancelled"
            rec.finished = time.monotonic()
            rec.cancel_latency_s = rec.finished - inflight.cancel_at
            await self.emit(
                ev.ReconfigurationCancelled(
                    job_id=self.job_id,
                    epoch=inflight.epoch,
                    by_epoch=inflight.cancel_by,
                    reason=inflight.reason,
                )
            )
        except Exception as exc:
            rec.outcome = "failed"
            rec.finished = time.monotonic()
            log.error("reconfiguration_failed", job_id=self.job_id, epoch=inflight.epoch, error=str(exc))
            await self._cleanup_new_workers()
            await self.emit(
                ev.ReconfigurationFailed(job_id=self.job_id, epoch=inflight.epoch, reason=str(exc)[:4000])
            )
            if (
                self.current is None
                and inflight.kind != "stop"
                and self._queued is None
                and not self._closing
                and self._restart_allowed(f"{inflight.kind} failed: {str(exc)[:2000]}")
            ):
                # No worker runs and no order would start one: start again, at once.
                self._queued = (inflight.epoch, inflight.target)
        finally:
            if self.inflight is inflight:
                self.inflight = None
            await self._notify()
            if self._queued is not None and not self._recovering:
                await self._start_queued()

    async def _phase(self, inflight: _InFlight, name: str, since: float) -> float:
        now = time.monotonic()
        inflight.record.phases[name] = now - since
        await self.emit(
            ev.ReconfigurationPhase(
                job_id=self.job_id, epoch=inflight.epoch, phase=name, duration_s=now - since
            )
        )
        return now

    def _check_cancel(self, inflight: _InFlight) -> None:
        if inflight.cancel_by >= 0:
            raise _Superseded()

    async def _warm(self, inflight: _InFlight) -> None:
        """Stop-free scale-out, graceful scale-in or both at once (EDL §4.2)."""
        assert self.current is not None
        cur = self.current
        t0 = inflight.record.started
        # Worker objects stay valid after their process exits (self.workers forgets them).
        ws = {w: self.workers[w] for w in cur.members if w in self.workers}
        if len(ws) != len(cur.members):
            raise ReconfigurationFailedError("a worker of the current generation has exited")
        # Adopted workers (a leader handover) may still be on their way to this control server.
        await self._wait(
            lambda: self.connected() or inflight.cancel_by >= 0,
            self.train.rendezvous_timeout_s,
            "the current workers to connect",
            watch=list(ws.values()),
        )
        self._check_cancel(inflight)
        keep = tuple(w for w in cur.members if ws[w].gpu in inflight.target)
        leave = tuple(w for w in cur.members if w not in keep)
        held = {ws[w].gpu for w in keep}
        gen = self._new_gen()
        inflight.gen = gen
        new_workers = await self._spawn_workers(inflight, [(g, {}) for g in inflight.target if g not in held])
        ws.update((w.id, w) for w in new_workers)
        members = keep + tuple(w.id for w in new_workers)
        plan = self._plan(gen, members, cold=False, broadcast=bool(new_workers))
        for w in new_workers:
            self._send_plan(w, plan)
        for wid in cur.members:
            self._send(ws[wid], plan)
        everyone = set(members) | set(leave)
        try:
            await self._wait(
                lambda: all(gen in ws[w].ready for w in everyone) or inflight.cancel_by >= 0,
                self.train.rendezvous_timeout_s,
                f"generation {gen} to be ready",
                watch=new_workers,
            )
            self._check_cancel(inflight)
        except _Superseded:
            await self._abort(gen, cur, new_workers)
            raise
        except BaseException:
            await self._abort(gen, cur, new_workers)
            raise
        t1 = await self._phase(inflight, "prepare", t0)
        step_time = self.progress.step_time_s if self.progress else 0.0
        t_cur = self.progress.step if self.progress else 0
        ahead = max(1, math.ceil(self.allowance_s / step_time)) if step_time > 0 else 1
        commit = pr.Commit(gen=gen, at_step=t_cur + ahead)
        # Leavers exit on their own at the switch, possibly before rank 0 reports it.
        for wid in leave:
            ws[wid].expected_exit = True
        for wid in cur.members:
            self._send(ws[wid], commit)
        inflight.committed = True
        abort_sent = [False]

        def settled() -> bool:
            return (
                gen in self._switched
                or gen in self._aborted
                or (inflight.cancel_by >= 0 and not abort_sent[0])
            )

        while gen not in self._switched:
            await self._wait(
                settled,
                self.train.rendezvous_timeout_s,
                f"switch to generation {gen}",
                watch=[ws[w] for w in keep],
            )
            if gen in self._switched:
                break
            if gen in self._aborted:
                for wid in leave:
                    ws[wid].expected_exit = False
                await self._abort(gen, cur, new_workers)
                raise _Superseded()
            # Cancelled after the commit: rank 0 drops it unless it already announced it.
            abort_sent[0] = True
            self._send(ws[cur.members[0]], pr.Abort(gen=gen))
        switched, at = self._switched[gen]
        for wid in leave:
            ws[wid].expected_exit = True
        self.current = Generation(gen, members, tuple(ws[w].gpu for w in members))
        inflight.record.stop_time_s = switched.stop_time_s
        await self._phase(inflight, "switch", t1)
        # Resource loss: old workers idle for the stop time; new ones from the order to the switch.
        inflight.record.gpu_time_lost_s = len(keep) * switched.stop_time_s + len(new_workers) * (at - t0)
        await self._reap([ws[w] for w in leave], self.train.collective_timeout_s)

    async def _cold(self, inflight: _InFlight) -> None:
        """Start, checkpoint-restart (SideCar) or recovery: a fresh generation from the checkpoint."""
        t0 = inflight.record.started
        stop_from = t0
        if self.current is not None:
            # The checkpoint is the safe point: it is not interrupted by a newer order.
            stop_from = await self._checkpoint_stop(self.train.collective_timeout_s)
            await self._phase(inflight, "checkpoint", t0)
        self._check_cancel(inflight)
        gen = self._new_gen()
        inflight.gen = gen
        extra = self._torchrun_env(len(inflight.target)) if not self.api else [{}] * len(inflight.target)
        workers = await self._spawn_workers(inflight, list(zip(inflight.target, extra, strict=True)))
        members = tuple(w.id for w in workers)
        if not self.api:
            for w in workers:
                w.expected_exit = False
            self.current = Generation(gen, members, inflight.target)
            inflight.record.stop_time_s = time.monotonic() - stop_from
            return
        plan = self._plan(gen, members, cold=True, broadcast=True)
        for w in workers:
            self._send_plan(w, plan)
        try:
            await self._wait(
                lambda: gen in self._switched or inflight.cancel_by >= 0,
                self.train.rendezvous_timeout_s,
                f"generation {gen} to start",
                watch=workers,
            )
            self._check_cancel(inflight)
        except BaseException:
            await self._kill(workers)
            raise
        _switched, at = self._switched[gen]
        self.current = Generation(gen, members, inflight.target)
        await self._phase(inflight, "restore", t0)
        inflight.record.stop_time_s = at - stop_from
        inflight.record.gpu_time_lost_s = len(members) * (at - t0)

    async def _checkpoint_stop(self, grace_s: float) -> float:
        """SIGTERM: every worker stops at the next step and rank 0 checkpoints. Returns when it stopped."""
        cur = self.current
        if cur is None:
            return time.monotonic()
        workers = [self.workers[w] for w in cur.members if w in self.workers]
        self._stopped = None
        for w in workers:
            w.expected_exit = True
            with contextlib.suppress(ProcessLookupError):
                w.proc.send_signal(signal.SIGTERM)
        await self._reap(workers, grace_s)
        self.current = None
        return self._stopped_at if self._stopped is not None else time.monotonic()

    async def _abort(self, gen: int, cur: Generation, new_workers: list[Worker]) -> None:
        for wid in cur.members:
            if wid in self.workers:
                self._send(self.workers[wid], pr.Abort(gen=gen))
        await self._kill(new_workers)

    async def _cancel_inflight(self, by_epoch: int) -> None:
        inflight = self.inflight
        if inflight is None or inflight.task is None:
            return
        inflight.cancel_by = by_epoch
        inflight.cancel_at = time.monotonic()
        await self._notify()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(inflight.task), self.train.rendezvous_timeout_s + 5)

    async def _cleanup_new_workers(self) -> None:
        members = set(self.current.members) if self.current else set()
        await self._kill([w for w in self.workers.values() if w.id not in members])

    # -- failures -------------------------------------------------------------------------

    async def _on_exit(self, w: Worker) -> None:
        rc = await w.proc.wait()
        w.exited = True
        self.workers.pop(w.id, None)
        await self._notify()
        cur = self.current
        if self._closing or w.expected_exit or cur is None or w.id not in cur.members:
            return
        if rc == 0:
            # The script ended normally (training over): not a failure, whatever order the
            # exits and rank 0's Done message arrive in.
            if all(m not in self.workers for m in cur.members):
                self.done.set()
            return
        log.warning("worker_died", job_id=self.job_id, worker=w.id, returncode=rc)
        self._failed[w.id] = w
        if not self._recovering:
            self._recovering = True
            self._spawn_task(self._recover(w))

    def _restart_allowed(self, why: str) -> bool:
        """Count one restart for ``why``; past ``train.max_restarts`` set :attr:`failed`
        instead and say no."""
        if self.restarts >= self.train.max_restarts:
            self.failed = f"{why}; no restart left (SHOAL_TRAIN_MAX_RESTARTS={self.train.max_restarts})"
            log.error("job_failed", job_id=self.job_id, reason=self.failed)
            return False
        self.restarts += 1
        return True

    async def _recover(self, dead: Worker) -> None:
        """Recovery from a dead worker while restarts are left (:meth:`_restart_allowed`);
        else the job's workers stop.

        A worker that exited (killed, crashed) leaves its GPU to the job: the order still
        gives the job that GPU, and nobody else could use it until the next order (which
        may be hours away under a stable allocation). So consistent recovery restarts the
        job from its checkpoint on all the order's GPUs, as TorchElastic restarts every
        worker of a failed group; approximate recovery regroups the survivors in place
        and then gives the GPU back with a scale-out, as EDL §5 has a straggler's machine
        rejoin "to restore to the original parallelism". A GPU is kept that way once per
        order: if its worker dies again, or it was lost with its node's sidecar (the
        node is gone: the next order moves the job), the dead worker is a forced scale-in
        (EDL §4.2) and the job runs smaller until the next order."""
        try:
            if self.inflight is not None:
                await self._cancel_inflight(self.epoch)
            cur = self.current
            if cur is None:
                return
            if not self._restart_allowed(f"worker {dead.id} exited with status {dead.proc.returncode}"):
                # No generation from here on (set with ``failed``, before any wait): the
                # workers' exits below are expected, and nobody sees a failed job running.
                self.current = None
                await self._kill([self.workers[m] for m in cur.members if m in self.workers])
                await self._notify()
                return
            culprits = await self._culprits(cur, dead)
            survivors = tuple(g for m, g in zip(cur.members, cur.gpus, strict=False) if m not in culprits)
            survivors = survivors or cur.gpus
            back = {
                g
                for m, g in zip(cur.members, cur.gpus, strict=False)
                if m in culprits
                and not getattr(culprits[m].proc, "lost", False)
                and g not in self._given_back
            }
            back -= set(survivors)
            restore = tuple(g for g in cur.gpus if g in back or g in survivors)
            alive = tuple(m for m in cur.members if m in self.workers)
            approximate = self.train.recovery == "approximate" and self.api
            if (
                approximate
                and alive
                and len(alive) == len(survivors)
                and await self._regroup(cur, alive, dead)
            ):
                self._give_back(back, restore)
                return
            if back:  # consistent recovery on the order's GPUs, the dead worker's kept
                self._given_back |= back
                survivors = restore
            await self._kill([self.workers[m] for m in cur.members if m in self.workers])
            self.current = None
            record = ReconfigurationRecord(
                epoch=self.epoch,
                kind="recover",
                from_world=len(cur.gpus),
                to_world=len(survivors),
                started=time.monotonic(),
            )
            self.history.append(record)
            inflight = _InFlight(epoch=self.epoch, kind="recover", target=survivors, record=record)
            self.inflight = inflight
            await self.emit(
                ev.ReconfigurationStarted(
                    job_id=self.job_id,
                    epoch=self.epoch,
                    kind="recover",
                    from_world=len(cur.gpus),
                    to_world=len(survivors),
                )
            )
            inflight.task = asyncio.current_task()
            await self._run_reconfiguration(inflight)
        finally:
            self._recovering = False
            if self._queued is not None and self.inflight is None:
                await self._start_queued()
            await self._notify()

    def _give_back(self, back: set[GpuRef], restore: tuple[GpuRef, ...]) -> None:
        """After the survivors regrouped: queue the scale-out to ``restore`` (the order's
        GPUs less those not kept), in the order's epoch, unless a newer order is queued
        (the queue is started when the recovery ends)."""
        if not back or self._queued is not None or self.done.is_set() or self._closing:
            return
        if self.current is None or set(self.current.gpus) == set(restore):
            return
        self._given_back |= back
        log.info(
            "giving_back", job_id=self.job_id, epoch=self.epoch, gpus=[f"{g.node_id}/{g.index}" for g in back]
        )
        self._queued = (self.epoch, restore)

    async def _culprits(self, cur: Generation, dead: Worker) -> dict[int, Worker]:
        """The members that failed, with their workers: those that died without reporting
        a failed collective (killed, crashed, lost with their node).

        A worker that reported ``WorkerFailed`` first died *because* a peer did (its
        all-reduce broke); when it is the first death noticed, the peer's own end (a remote
        worker's is noticed by a poll) gets ``failure_settle_s`` to show up, so that the job
        shrinks by the failed peer and not by the healthy worker. Failing that (a hung
        peer), the first death noticed is the culprit.
        """

        def known() -> dict[int, Worker]:
            return {
                m: w for m in cur.members if (w := self._failed.get(m)) is not None and not w.reported_failure
            }

        if not known():
            with contextlib.suppress(ReconfigurationFailedError):
                await self._wait(lambda: bool(known()), self.failure_settle_s, "the failed peer")
        culprits = known() or {dead.id: dead}
        self._failed.clear()
        return culprits

    async def _regroup(self, cur: Generation, alive: tuple[int, ...], dead: Worker) -> bool:
        """Approximate recovery: the survivors form a new group at once and finish the step."""
        record = ReconfigurationRecord(
            epoch=self.epoch,
            kind="recover",
            from_world=len(cur.members),
            to_world=len(alive),
            started=time.monotonic(),
        )
        self.history.append(record)
        await self.emit(
            ev.ReconfigurationStarted(
                job_id=self.job_id,
                epoch=self.epoch,
                kind="recover",
                from_world=len(cur.members),
                to_world=len(alive),
            )
        )
        gen = self._new_gen()
        plan = self._plan(gen, alive, cold=False, broadcast=False)
        workers = [self.workers[m] for m in alive]
        for w in workers:
            self._send(w, plan)
        try:
            await self._wait(
                lambda: gen in self._switched,
                self.train.rendezvous_timeout_s + self.train.collective_timeout_s,
                f"survivors to regroup in generation {gen}",
                watch=workers,
            )
        except ReconfigurationFailedError as exc:
            log.warning("regroup_failed", job_id=self.job_id, error=str(exc))
            record.outcome = "failed"
            await self.emit(ev.ReconfigurationFailed(job_id=self.job_id, epoch=self.epoch, reason=str(exc)))
            return False
        _, at = self._switched[gen]
        self.current = Generation(gen, alive, tuple(w.gpu for w in workers))
        record.outcome, record.finished = "completed", at
        record.stop_time_s = at - record.started
        record.gpu_time_lost_s = len(alive) * record.stop_time_s
        await self.emit(
            ev.ReconfigurationCompleted(
                job_id=self.job_id,
                epoch=self.epoch,
                world_size=len(alive),
                gpus=self.current.gpus,
                stop_time_s=record.stop_time_s,
                duration_s=at - record.started,
            )
        )
        return True

    # -- workers ---------------------------------------------------------------------------

    def _new_gen(self) -> int:
        self._next_gen += 1
        return self._next_gen

    def _plan(self, gen: int, members: tuple[int, ...], *, cold: bool, broadcast: bool) -> pr.Plan:
        assert self._store is not None
        return pr.Plan(
            gen=gen,
            members=members,
            src=0,
            cold=cold,
            broadcast=broadcast,
            store_host=self.host,
            store_port=self._store.port,
        )

    async def launch_local(self, request: LaunchRequest) -> WorkerProcess:
        """The default launcher: a child of this process on ``gpu_index(request.gpu)``."""
        index = self.gpu_index(request.gpu)
        return await launch_local(request, device_index=index, log_dir=self.workdir / "logs")

    async def _spawn_workers(
        self, inflight: _InFlight, specs: list[tuple[GpuRef, dict[str, str]]]
    ) -> list[Worker]:
        """Start one worker per (GPU, extra environment), concurrently (a remote start is
        a round trip, and may wait for the sidecar of a node that is still starting).

        Waiting for the starts is a safe point: a newer order cancels it (CoDDL §4.3), and
        the starts still under way are reaped in the background when they land.

        Raises:
            _Superseded: a newer order came first.
            Exception: a start failed (the workers that did start are killed).
        """
        if not specs:
            return []
        starts = asyncio.gather(*(self._spawn_worker(g, e) for g, e in specs), return_exceptions=True)
        starts.add_done_callback(lambda _: self._spawn_task(self._notify()))
        try:
            await self._wait(
                lambda: starts.done() or inflight.cancel_by >= 0,
                self.train.rendezvous_timeout_s + 10,
                f"{len(specs)} worker(s) to start",
            )
        except BaseException:
            self._spawn_task(self._reap_starts(starts))
            raise
        if not starts.done():
            self._spawn_task(self._reap_starts(starts))
            raise _Superseded()
        results = starts.result()
        workers = [r for r in results if isinstance(r, Worker)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self._kill(workers)
            raise errors[0]
        return workers

    async def _reap_starts(self, starts: asyncio.Future[list[Any]]) -> None:
        """Kill the workers of an abandoned start as soon as they exist."""
        results = await starts
        await self._kill([r for r in results if isinstance(r, Worker)])

    async def _spawn_worker(self, gpu: GpuRef, extra_env: dict[str, str] | None = None) -> Worker:
        wid = self._next_worker
        self._next_worker += 1
        self.gpu_index(gpu)  # an OrderError for a GPU the job cannot use, before anything starts
        train = TrainConfig(
            **{
                **{k: getattr(self.train, k) for k in self.train.__struct_fields__},
                "control": self.control_address if self.api else "",
                "worker": wid,
                "job": self.job_id,
                "leader": self.leader_id,
                "checkpoint_dir": self.checkpoint_dir,
            }
        )
        request = LaunchRequest(
            job_id=self.job_id,
            worker=wid,
            gpu=gpu,
            argv=tuple(self.argv),
            env={**self.env, **train.to_env(), **(extra_env or {})},
            device=train.device,
            log_name=f"worker-{wid}.log",
        )
        proc = await self.launch(request)
        w = Worker(id=wid, gpu=gpu, proc=proc)
        self.workers[wid] = w
        self._spawn_task(self._on_exit(w))
        log.info(
            "worker_started", job_id=self.job_id, worker=wid, pid=proc.pid, gpu=f"{gpu.node_id}/{gpu.index}"
        )
        return w

    def _torchrun_env(self, world: int) -> list[dict[str, str]]:
        """torchrun's variables for a non-API script restarted on ``world`` workers."""
        with socket.socket() as sock:
            sock.bind((self.host, 0))
            port = sock.getsockname()[1]
        common = {"MASTER_ADDR": self.host, "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}
        common["LOCAL_WORLD_SIZE"] = str(world)
        return [{**common, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(world)]

    async def _kill(self, workers: list[Worker]) -> None:
        for w in workers:
            w.expected_exit = True
            if w.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.kill()
        await asyncio.gather(*(w.proc.wait() for w in workers), return_exceptions=True)

    async def _reap(self, workers: list[Worker], grace_s: float) -> None:
        try:
            await asyncio.wait_for(
                asyncio.gather(*(w.proc.wait() for w in workers), return_exceptions=True), grace_s
            )
        except TimeoutError:
            log.warning("workers_killed_after_grace", job_id=self.job_id, workers=[w.id for w in workers])
            await self._kill(workers)

    def _send(self, w: Worker, msg: pr.Msg) -> None:
        if w.writer is not None and not w.writer.is_closing():
            w.writer.write(pr.encode(msg))

    def _send_plan(self, w: Worker, plan: pr.Plan) -> None:
        w.plan = plan
        self._send(w, plan)

    def _spawn_task(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _wait(
        self, pred: Callable[[], bool], timeout_s: float, what: str, watch: Sequence[Worker] = ()
    ) -> None:
        """Until ``pred``; a deadline, and an error as soon as a watched worker dies."""

        def check() -> bool:
            return pred() or any(w.exited for w in watch)

        try:
            async with self._changed:
                await asyncio.wait_for(self._changed.wait_for(check), timeout_s)
        except TimeoutError:
            raise ReconfigurationFailedError(f"timed out after {timeout_s}s waiting for {what}") from None
        if not pred():
            dead = [w.id for w in watch if w.exited]
            raise ReconfigurationFailedError(f"worker(s) {dead} exited while waiting for {what}")

    # -- the control server -------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        worker: Worker | None = None
        try:
            while line := await reader.readline():
                try:
                    msg = pr.decode_to_sidecar(line)
                except ValueError as exc:
                    log.error("bad_control_message", job_id=self.job_id, error=str(exc))
                    continue
                if isinstance(msg, pr.Hello):
                    worker = self.workers.get(msg.worker)
                    if worker is None:
                        writer.close()
                        return
                    worker.writer = writer
                    if msg.gen >= 0:
                        log.info("worker_reconnected", job_id=self.job_id, worker=msg.worker, gen=msg.gen)
                    await self._notify()
                    if worker.plan is not None:
                        self._send(worker, worker.plan)
                    continue
                await self._on_message(msg)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _on_message(self, msg: pr.ToSidecar) -> None:
        now = time.monotonic()
        if isinstance(msg, pr.Progress):
            self.progress = msg
            if msg.gen != self._reported_gen:
                # A new generation runs (a change of shape, a recovery): report often
                # again, for the profiler's measurements of the shape.
                self._reported_gen = msg.gen
                window = self.measure_window_s
                self.reports.changed(now + window + 1.0 if window else None)
            if self.reports.due(now - self._last_report, now):
                self._last_report = now
                await self.emit(self.progress_event())
                self.reports.reported(now)
            return
        if isinstance(msg, pr.Ready):
            w = self.workers.get(msg.worker)
            if w is not None:
                w.ready.add(msg.gen)
        elif isinstance(msg, pr.Switched):
            self._switched[msg.gen] = (msg, now)
        elif isinstance(msg, pr.Left):
            w = self.workers.get(msg.worker)
            if w is not None:
                w.expected_exit = True
        elif isinstance(msg, pr.Aborted):
            self._aborted.add(msg.gen)
        elif isinstance(msg, pr.Stopped):
            self._stopped, self._stopped_at = msg, now - msg.checkpoint_s
        elif isinstance(msg, pr.Done):
            if self.progress is not None:
                # Progress reports are rate-limited; Done carries the final step.
                self.progress = msgspec.structs.replace(self.progress, step=msg.step)
            for w in self.workers.values():
                w.expected_exit = True
            self.done.set()
            if self.inflight is not None and self.inflight.cancel_by < 0:
                # Training is over: a pending generation will never be switched to.
                self.inflight.cancel_by = self.epoch
                self.inflight.cancel_at = now
                self.inflight.reason = "job finished"
        elif isinstance(msg, pr.WorkerFailed):
            if (w := self.workers.get(msg.worker)) is not None:
                w.reported_failure = True
            log.warning("worker_failed", job_id=self.job_id, worker=msg.worker, reason=msg.reason)
        await self._notify()

    def progress_event(self) -> ev.ProgressReported:
        p = self.progress
        assert p is not None
        return ev.ProgressReported(
            job_id=self.job_id,
            iteration=p.step,
            loss=p.loss if math.isfinite(p.loss) else None,
            samples_per_s=p.samples / p.step_time_s if p.step_time_s > 0 else 0.0,
            num_gpus=p.world,
            gpu_type=self.gpu_type,
            step_time_s=p.step_time_s,
            epoch=max(self.epoch, 0),
            data_epoch=p.data_epoch,
        )
