"""The worker side of ``shoal.train``: process groups per generation, state sync, the batch hook.

See :mod:`shoal.train` for the design. This module holds :class:`ElasticJob`,
which a user's script gets from :func:`shoal.train.init`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import math
import os
import queue
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from shoal.train import protocol as pr
from shoal.train.config import TrainConfig
from shoal.train.data import ElasticSampler, Scaling

# Slots appended to the gradient buffer of every step: one all-reduce carries both
# the gradients and the control decisions, so every worker learns a switch or a
# stop in the same step (no extra collective, no clock agreement needed).
_SLOT_SAMPLES, _SLOT_LOSS, _SLOT_SWITCH, _SLOT_STOP = range(4)
_NUM_SLOTS = 4

CHECKPOINT_NAME = "checkpoint.pt"
_PROGRESS_EVERY_S = 0.05


class TrainingStopped(SystemExit):
    """Raised out of :meth:`ElasticJob.step` when this worker must end (left, stopped)."""

    def __init__(self, reason: str) -> None:
        super().__init__(0)
        self.reason = reason


class _Comm:
    """Collectives over one process group, each with a timeout (no worker blocks forever)."""

    def __init__(self, pg: Any, timeout_s: float, *, default_group: bool = False) -> None:
        self.pg = pg
        self.timeout = dt.timedelta(seconds=timeout_s)
        self.default_group = default_group

    def allreduce(self, t: torch.Tensor, timeout_s: float | None = None) -> None:
        if self.default_group:
            dist.all_reduce(t)
            return
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
        opts.timeout = dt.timedelta(seconds=timeout_s) if timeout_s else self.timeout
        self.pg.allreduce([t], opts).wait()

    def broadcast(self, t: torch.Tensor, src: int, timeout_s: float | None = None) -> None:
        if self.default_group:
            dist.broadcast(t, src)
            return
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = dt.timedelta(seconds=timeout_s) if timeout_s else self.timeout
        self.pg.broadcast([t], opts).wait()


@dataclass
class _Pending:
    """A planned generation this worker has heard of but not switched to."""

    plan: pr.Plan
    pg: Any = None
    error: BaseException | None = None
    built: threading.Event = field(default_factory=threading.Event)
    aborted: bool = False


def _regroup_plan(
    pending: dict[int, _Pending], gen: int, members: tuple[int, ...], worker: int
) -> _Pending | None:
    """The plan a survivor of generation ``gen`` (of ``members``) regroups into, once built:
    the oldest newer one, not aborted, with ``worker`` and with no member from outside
    the group. None while that plan is still being built or has not come yet."""
    group = set(members)
    for g in sorted(pending):
        p = pending[g]
        if (
            g > gen
            and worker in p.plan.members
            and not p.plan.cold
            and not p.aborted
            and set(p.plan.members) <= group
        ):
            return p if p.built.is_set() else None
    return None


@dataclass
class Step:
    """One training step as the user's loop sees it."""

    indices: np.ndarray
    """This worker's sample indices (its share of the global batch)."""
    iteration: int
    """Steps completed before this one (global, across resizes)."""
    data_epoch: int
    global_batch: int
    world_size: int
    rank: int


class _Control:
    """The worker's connection to its sidecar: a reader thread and a locked writer.

    With ``checkpoint_dir`` and ``leader`` set, a closed connection is not the end: the
    reader looks in ``checkpoint_dir/leader.json`` for a leader other than the one it
    lost, for up to ``timeout_s``, connects to it and says hello again (``hello()``
    gives the worker's generation and step). Messages sent while it has no leader are
    dropped (progress reports; nothing is in flight during a handover).
    """

    def __init__(
        self,
        address: str,
        worker: int,
        timeout_s: float,
        *,
        leader: str = "",
        checkpoint_dir: str = "",
        hello: Callable[[], pr.Hello] | None = None,
    ) -> None:
        self.worker = worker
        self.timeout_s = timeout_s
        self.leader = leader
        self.checkpoint_dir = checkpoint_dir
        self._hello = hello or (lambda: pr.Hello(worker=worker, pid=os.getpid()))
        self._closing = False
        self.sock = self._connect(address, timeout_s)
        self.inbox: queue.Queue[pr.ToWorker | None] = queue.Queue()
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="shoal-control", daemon=True)
        self._reader.start()
        self.send(pr.Hello(worker=worker, pid=os.getpid()))

    @staticmethod
    def _connect(address: str, timeout_s: float) -> socket.socket:
        host, _, port = address.rpartition(":")
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock = socket.create_connection((host, int(port)), timeout=5.0)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise ConnectionError(f"no trainer sidecar at {address} after {timeout_s}s") from None
                time.sleep(0.05)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        # A stalled sidecar must not block a worker's progress report for ever.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 10, 0))
        return sock

    def _read(self) -> None:
        while True:
            f = self.sock.makefile("rb")
            try:
                for line in f:
                    self.inbox.put(pr.decode_to_worker(line))
            except (OSError, ValueError):
                pass
            if self._closing or not self._follow_leader():
                break
        # The sidecar is gone: nothing will coordinate this worker any more.
        self.inbox.put(None)

    def _follow_leader(self) -> bool:
        """After the connection closed: connect to the next leader (see the class docstring)."""
        if not (self.checkpoint_dir and self.leader):
            return False
        lost = self.leader
        deadline = time.monotonic() + self.timeout_s
        while not self._closing and time.monotonic() < deadline:
            found = pr.read_leader_file(self.checkpoint_dir)
            if found is not None and found.leader != lost:
                try:
                    sock = self._connect(found.control, 2.0)
                except ConnectionError:
                    time.sleep(0.1)
                    continue
                with self._lock:
                    old, self.sock = self.sock, sock
                    self.leader = found.leader
                with contextlib.suppress(OSError):
                    old.close()
                self.send(self._hello())
                return True
            time.sleep(0.05)
        return False

    def send(self, msg: pr.Msg) -> None:
        data = pr.encode(msg)
        with self._lock, contextlib.suppress(OSError):
            self.sock.sendall(data)

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class ElasticJob:
    """A training job that shoal can resize in place; see :mod:`shoal.train`.

    Created by :func:`shoal.train.init`. The same script runs under shoal (elastic),
    under torchrun (a fixed world) or as one process.
    """

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.model: torch.nn.Module | None = None
        self._params: list[torch.nn.Parameter] = []
        self._flat: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.sampler: ElasticSampler | None = None
        self.iteration = 0
        self.rank = 0
        self.world = 1
        self.gen = -1
        self.members: tuple[int, ...] = ()
        """The workers of generation ``gen``, in rank order."""
        self.loss: float = math.nan
        """Mean loss over the global batch of the last step."""
        self._comm: _Comm | None = None
        self._control: _Control | None = None
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self._commit: pr.Commit | None = None
        self._announced = -1
        self._stop_requested = False
        self._step: Step | None = None
        self._stepped = True
        self._synced = False
        self._switch_to = -1
        self._stop_now = False
        self._step_started = 0.0
        self._step_time = 0.0
        self._progress_sent = 0.0
        self._trace: Any = None
        self._plans: queue.Queue[pr.Plan | None] = queue.Queue()
        self.device = torch.device("cpu")
        self.mode = "single"
        if cfg.device == "cuda":
            self.device = torch.device("cuda", 0)
        if cfg.control:
            self.mode = "elastic"
            self._control = _Control(
                cfg.control,
                cfg.worker,
                cfg.rendezvous_timeout_s,
                leader=cfg.leader,
                checkpoint_dir=cfg.checkpoint_dir,
                hello=lambda: pr.Hello(worker=cfg.worker, pid=os.getpid(), gen=self.gen, step=self.iteration),
            )
            threading.Thread(target=self._dispatch, name="shoal-dispatch", daemon=True).start()
        elif int(os.environ.get("WORLD_SIZE", "1")) > 1 or "TORCHELASTIC_RUN_ID" in os.environ:
            self.mode = "torchrun"
            backend = "nccl" if cfg.device == "cuda" else "gloo"
            if cfg.device == "cuda":
                self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                torch.cuda.set_device(self.device)
            if not dist.is_initialized():
                dist.init_process_group(backend, timeout=dt.timedelta(seconds=cfg.collective_timeout_s))
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            self._comm = _Comm(None, cfg.collective_timeout_s, default_group=True)
        # A signal asks for a checkpoint at the next batch boundary (the SideCar path).
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, self._on_sigterm)

    # -- user API -------------------------------------------------------------------

    def register(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Register the model and optimizer whose state is broadcast and checkpointed."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.model = model
        self.optimizer = optimizer
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._flat = None

    def elastic_sampler(
        self,
        dataset_size: int,
        *,
        global_batch_size: int = 0,
        scaling: str = "strong",
        per_worker_batch: int = 0,
        weak_range: tuple[int, int] = (1, 1 << 30),
        seed: int = 0,
        shuffle: bool = True,
    ) -> ElasticSampler:
        """The data pipeline: each step hands this worker its share of the global batch.

        Strong scaling (default) keeps ``global_batch_size`` fixed; ``scaling="weak"``
        keeps ``per_worker_batch`` fixed while the world size is within ``weak_range``.
        """
        self.sampler = ElasticSampler(
            dataset_size,
            Scaling(
                mode=scaling,
                global_batch_size=global_batch_size,
                per_worker_batch=per_worker_batch,
                weak_min=weak_range[0],
                weak_max=weak_range[1],
            ),
            seed=seed,
            shuffle=shuffle,
        )
        return self.sampler

    def train(self, *, max_steps: int | None = None, epochs: int | None = None) -> Iterator[Step]:
        """The training loop: yields one :class:`Step` per global batch until the end.

        The loop body computes the loss on ``step.indices``, calls ``loss.backward()``
        and then :meth:`step`. It ends after ``max_steps`` steps or ``epochs`` data
        epochs (counted globally, across resizes and restarts).
        """
        if self.model is None or self.optimizer is None:
            raise RuntimeError("call job.register(model, optimizer) before job.train()")
        if self.sampler is None:
            raise RuntimeError("call job.elastic_sampler(...) before job.train()")
        if max_steps is None and epochs is None:
            raise ValueError("train() needs max_steps or epochs")
        self._start()
        sampler = self.sampler
        while (max_steps is None or self.iteration < max_steps) and (
            epochs is None or sampler.data_epoch < epochs
        ):
            global_batch = len(sampler.global_indices(self.world))
            step = Step(
                indices=sampler.local_indices(self.world, self.rank),
                iteration=self.iteration,
                data_epoch=sampler.data_epoch,
                global_batch=global_batch,
                world_size=self.world,
                rank=self.rank,
            )
            self._step, self._stepped, self._synced = step, False, False
            self._step_started = time.perf_counter()
            yield step
            if not self._stepped:
                raise RuntimeError("the loop body must call job.step(loss) once per step")
        self._finish()

    def step(self, loss: torch.Tensor) -> None:
        """Average the gradients over the global batch, apply the optimizer, end the batch.

        ``loss`` is the mean loss over this worker's samples (the usual reduction);
        gradients are weighted by sample counts, so the update equals what one
        process computes on the whole global batch.
        """
        if not self._synced:
            self.sync_gradients(loss)
        assert self.optimizer is not None
        self.optimizer.step()
        if self._flat is not None:
            self._flat.zero_()  # every gradient is a view of it: one memset zeroes them all
        else:
            self.optimizer.zero_grad()
        self.batch_end()

    def _gradient_buffer(self) -> tuple[torch.Tensor, int]:
        """The flat buffer the all-reduce runs on, with every ``p.grad`` a view into it.

        As DDP's ``gradient_as_bucket_view``: backward accumulates straight into the
        buffer, so a step needs no copy in or out. A gradient replaced behind our back
        (``zero_grad(set_to_none=True)``) is copied in and re-pointed at its view.
        """
        params = self._params
        if self._flat is None:
            dtype = params[0].dtype if params else torch.float32
            device = params[0].device if params else self.device
            if any(p.dtype != dtype or p.device != device for p in params):
                raise TypeError("shoal.train needs every trainable parameter on one device with one dtype")
            numel = sum(p.numel() for p in params)
            self._flat = torch.zeros(numel + _NUM_SLOTS, dtype=dtype, device=device)
            offsets = [0]
            for p in params:
                offsets.append(offsets[-1] + p.numel())
            self._views = [
                self._flat[a:b].view_as(p) for p, a, b in zip(params, offsets, offsets[1:], strict=False)
            ]
        for p, view in zip(params, self._views, strict=True):
            g = p.grad
            if g is None:
                view.zero_()
                p.grad = view
            elif g.data_ptr() != view.data_ptr():
                view.copy_(g)
                p.grad = view
        return self._flat, self._flat.numel() - _NUM_SLOTS

    def sync_gradients(self, loss: torch.Tensor) -> None:
        """The all-reduce part of :meth:`step`, for loops that clip or inspect gradients."""
        step = self._require_step()
        n = len(step.indices)
        buf, numel = self._gradient_buffer()
        # Slots as a plain list: one small tensor write, no per-slot indexing.
        slot_values = [0.0] * _NUM_SLOTS
        slot_values[_SLOT_SAMPLES] = float(n)
        slot_values[_SLOT_LOSS] = float(loss.detach()) * n if n else 0.0
        slot_values[_SLOT_SWITCH] = float(self._announce())
        slot_values[_SLOT_STOP] = 1.0 if self._stop_requested else 0.0
        buf[numel:] = torch.tensor(slot_values, dtype=buf.dtype)
        if n == 0:
            buf[:numel].zero_()  # an empty share at an epoch's tail: its gradients are NaN
        elif n != 1:
            buf[:numel].mul_(n)
        if self._comm is not None:
            local = buf.clone() if self.cfg.recovery == "approximate" and self.mode == "elastic" else None
            try:
                self._comm.allreduce(buf)
            except RuntimeError as exc:
                if local is None:
                    self._fail(f"all-reduce failed: {exc}")
                self._regroup_after_failure(str(exc))
                buf.copy_(local)
                try:
                    # Twice the collective timeout: a survivor told of the failure at once
                    # (its peer's connection reset) retries here while another survivor,
                    # waiting on a peer that left the collective, learns of it only when
                    # its own timeout ends, up to one collective timeout later. With one
                    # timeout the first one gave up just as the other arrived.
                    self._comm.allreduce(buf, timeout_s=2 * self.cfg.collective_timeout_s)
                except RuntimeError as again:
                    self._fail(f"all-reduce failed again after regrouping: {again}")
        total = float(buf[numel + _SLOT_SAMPLES])
        if total != 1.0:
            buf[:numel].div_(max(total, 1.0))
        tail = buf[numel:].tolist()
        self.loss = tail[_SLOT_LOSS] / max(total, 1.0)
        self._switch_to = round(tail[_SLOT_SWITCH])
        self._stop_now = tail[_SLOT_STOP] > 0
        self._synced = True

    def batch_end(self) -> None:
        """The batch-boundary hook (EDL's ``notify_batch_end``): progress, checkpoints, switches."""
        step = self._require_step()
        if not self._synced:
            raise RuntimeError("sync_gradients(loss) must run before batch_end()")
        assert self.sampler is not None
        self._stepped = True
        self.iteration += 1
        self.sampler.advance(step.global_batch)
        self._step_time = time.perf_counter() - self._step_started
        self._record(step)
        now = time.monotonic()
        if self.rank == 0 and self._control is not None and now - self._progress_sent >= _PROGRESS_EVERY_S:
            # Rate-limited: the sidecar needs a recent step count and step time, not every step.
            self._progress_sent = now
            self._control.send(
                pr.Progress(
                    worker=self.cfg.worker,
                    gen=self.gen,
                    step=self.iteration,
                    data_epoch=self.sampler.data_epoch,
                    cursor=self.sampler.cursor,
                    loss=self.loss,
                    samples=step.global_batch,
                    step_time_s=self._step_time,
                    world=self.world,
                )
            )
        if self._stop_now:
            self._checkpoint_and_stop()
        if self.rank == 0 and self.cfg.checkpoint_every and self.iteration % self.cfg.checkpoint_every == 0:
            self.save_checkpoint()
        if self._switch_to > self.gen and self.mode == "elastic":
            self._switch(self._switch_to)

    # -- checkpoints ------------------------------------------------------------------

    @property
    def checkpoint_path(self) -> Path | None:
        return Path(self.cfg.checkpoint_dir) / CHECKPOINT_NAME if self.cfg.checkpoint_dir else None

    def state_bytes(self) -> bytes:
        """Model, optimizer and progress (iteration, data epoch, cursor) as one blob."""
        assert self.model is not None and self.optimizer is not None and self.sampler is not None
        buf = io.BytesIO()
        torch.save(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "iteration": self.iteration,
                "sampler": self.sampler.state(),
            },
            buf,
        )
        return buf.getvalue()

    def load_state_bytes(self, blob: bytes) -> None:
        assert self.model is not None and self.optimizer is not None and self.sampler is not None
        state = torch.load(io.BytesIO(blob), map_location=self.device, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.iteration = int(state["iteration"])
        self.sampler.load_state(state["sampler"])

    def save_checkpoint(self) -> str:
        """Write the state atomically to the checkpoint directory (rank 0); returns the path."""
        path = self.checkpoint_path
        if path is None:
            return ""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(self.state_bytes())
        os.replace(tmp, path)
        return str(path)

    def _restore_checkpoint(self) -> int:
        path = self.checkpoint_path
        if path is None or not path.exists():
            return -1
        self.load_state_bytes(path.read_bytes())
        return self.iteration

    # -- generations --------------------------------------------------------------------

    def _require_step(self) -> Step:
        if self._step is None:
            raise RuntimeError("no step in progress: iterate job.train() first")
        return self._step

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._stop_requested = True
        if self._step is None or (self._comm is None and self.mode == "elastic"):
            # Not training yet (joining): nothing to checkpoint.
            raise TrainingStopped("signalled before training")

    def _announce(self) -> int:
        """Rank 0 writes a committed switch into the step's control slot when its step is due."""
        if self.rank != 0:
            return 0
        with self._lock:
            commit = self._commit
            if commit is None or commit.gen <= self.gen or self.iteration + 1 < commit.at_step:
                return 0
            self._announced = commit.gen
            return commit.gen

    def _dispatch(self) -> None:
        """Control-thread side: plans start background rendezvous; commits and aborts are recorded."""
        assert self._control is not None
        while True:
            msg = self._control.inbox.get()
            if msg is None:
                self._plans.put(None)
                return
            if isinstance(msg, pr.Plan):
                pending = _Pending(msg)
                with self._lock:
                    self._pending[msg.gen] = pending
                if self.gen < 0:
                    self._plans.put(msg)
                elif self.cfg.worker in msg.members:
                    threading.Thread(target=self._build, args=(pending,), daemon=True).start()
                else:
                    pending.built.set()
                    self._control.send(pr.Ready(worker=self.cfg.worker, gen=msg.gen))
            elif isinstance(msg, pr.Commit):
                with self._lock:
                    if msg.gen in self._pending and not self._pending[msg.gen].aborted:
                        self._commit = msg
            elif isinstance(msg, pr.Abort):
                with self._lock:
                    dropped = self._pending.get(msg.gen)
                    if dropped is not None:
                        dropped.aborted = True
                    if self._commit is not None and self._commit.gen == msg.gen and self._announced < msg.gen:
                        self._commit = None
                        self._control.send(pr.Aborted(worker=self.cfg.worker, gen=msg.gen))

    def _connect_store(self, plan: pr.Plan) -> Any:
        # One client connection per generation: a TCPStore client serialises its
        # requests, so a rendezvous left waiting by a cancelled generation must not
        # hold up the next one.
        return dist.TCPStore(
            plan.store_host,
            plan.store_port,
            None,
            False,
            timeout=dt.timedelta(seconds=self.cfg.rendezvous_timeout_s),
        )

    def _new_group(self, plan: pr.Plan) -> Any:
        """Rendezvous for generation ``plan.gen``: a fresh group under its own store prefix."""
        store = dist.PrefixStore(f"gen{plan.gen}/", self._connect_store(plan))
        rank, world = plan.members.index(self.cfg.worker), len(plan.members)
        timeout = dt.timedelta(seconds=self.cfg.rendezvous_timeout_s)
        if self.cfg.device == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return dist.ProcessGroupNCCL(store, rank, world, opts)
        return dist.ProcessGroupGloo(store, rank, world, timeout)

    def _build(self, pending: _Pending) -> None:
        try:
            pending.pg = self._new_group(pending.plan)
        except BaseException as exc:
            pending.error = exc
        finally:
            pending.built.set()
        if pending.error is None and not pending.aborted and self._control is not None:
            self._control.send(pr.Ready(worker=self.cfg.worker, gen=pending.plan.gen))

    def _start(self) -> None:
        """Join the first generation (elastic), or restore and align (torchrun, single)."""
        if self.mode != "elastic":
            self.gen = 0
            restored = self._restore_checkpoint()
            if self._comm is not None:
                self._broadcast_state(0)
            if restored >= 0 and self.rank == 0:
                print(f"shoal.train: restored step {restored} from {self.checkpoint_path}", flush=True)
            return
        assert self._control is not None
        try:
            plan = self._plans.get(timeout=self.cfg.rendezvous_timeout_s)
        except queue.Empty:
            self._fail(f"no plan from the sidecar within {self.cfg.rendezvous_timeout_s}s")
        if plan is None:
            raise TrainingStopped("sidecar gone before the first plan")
        t0 = time.perf_counter()
        try:
            pg = self._new_group(plan)
        except RuntimeError as exc:
            self._fail(f"rendezvous for generation {plan.gen} failed: {exc}")
        restored = self._restore_checkpoint() if plan.cold else -1
        restore_s = time.perf_counter() - t0
        self._control.send(pr.Ready(worker=self.cfg.worker, gen=plan.gen, restored_step=restored))
        t1 = time.perf_counter()
        self._adopt(plan, pg)
        if restored >= 0 and self.rank == 0:
            print(f"shoal.train: restored step {restored} from {self.checkpoint_path}", flush=True)
        if plan.broadcast and self.world > 1:
            self._broadcast_state(plan.src, timeout_s=self.cfg.rendezvous_timeout_s)
        if plan.cold and self.rank == 0:
            self._control.send(
                pr.Switched(
                    worker=self.cfg.worker,
                    gen=plan.gen,
                    step=self.iteration,
                    stop_time_s=time.perf_counter() - t1,
                    restore_s=restore_s,
                )
            )

    def _adopt(self, plan: pr.Plan, pg: Any) -> None:
        self.gen = plan.gen
        self.members = plan.members
        self.rank = plan.members.index(self.cfg.worker)
        self.world = len(plan.members)
        self._comm = _Comm(pg, self.cfg.collective_timeout_s)
        with self._lock:
            for gen in [g for g in self._pending if g <= plan.gen]:
                del self._pending[gen]
            if self._commit is not None and self._commit.gen <= plan.gen:
                self._commit = None

    def _broadcast_state(self, src: int, timeout_s: float | None = None) -> float:
        """One worker sends model, optimizer and progress to the others (EDL §4.2)."""
        assert self._comm is not None
        t0 = time.perf_counter()
        blob = self.state_bytes() if self.rank == src else b""
        size = torch.tensor([len(blob)], dtype=torch.int64, device=self.device)
        try:
            self._comm.broadcast(size, src, timeout_s)
            payload = (
                torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device)
                if self.rank == src
                else torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
            )
            self._comm.broadcast(payload, src, timeout_s)
        except RuntimeError as exc:
            self._fail(f"state broadcast failed: {exc}")
        if self.rank != src:
            self.load_state_bytes(payload.cpu().numpy().tobytes())
        return time.perf_counter() - t0

    def _switch(self, gen: int) -> None:
        """Leave or join generation ``gen`` at this batch boundary (stop-free / graceful)."""
        assert self._control is not None
        t0 = time.perf_counter()
        with self._lock:
            pending = self._pending.get(gen)
        if pending is None:
            self._fail(f"switch to generation {gen} announced, but this worker has no plan for it")
        plan = pending.plan
        if self.cfg.worker not in plan.members:
            self._control.send(pr.Left(worker=self.cfg.worker, gen=gen, step=self.iteration))
            self._exit_now()
        if not pending.built.wait(self.cfg.rendezvous_timeout_s) or pending.error is not None:
            self._fail(f"process group for generation {gen} not ready: {pending.error}")
        self._adopt(plan, pending.pg)
        bcast = self._broadcast_state(plan.src) if plan.broadcast else 0.0
        if self.rank == 0:
            self._control.send(
                pr.Switched(
                    worker=self.cfg.worker,
                    gen=gen,
                    step=self.iteration,
                    stop_time_s=time.perf_counter() - t0,
                    broadcast_s=bcast,
                )
            )

    def _regroup_after_failure(self, reason: str) -> None:
        """Approximate recovery (EDL §4.2): wait for the sidecar's plan of survivors, adopt it.

        The plan to adopt is the oldest newer one, not aborted, made of this group's members
        only (a regrouping only drops members), once it built. A newer plan with a joiner (the
        dead worker's GPU given back once the survivors regrouped) is a scale-out, to be
        switched to at a batch boundary like any other; it can arrive while a slow
        survivor still waits here, and adopting it then would leave that survivor in a
        different group from the others, each all-reducing alone.
        """
        assert self._control is not None
        t0 = time.perf_counter()
        self._control.send(
            pr.WorkerFailed(worker=self.cfg.worker, gen=self.gen, step=self.iteration, reason=reason[:2000])
        )
        deadline = time.monotonic() + self.cfg.rendezvous_timeout_s
        while True:
            with self._lock:
                pending = _regroup_plan(self._pending, self.gen, self.members, self.cfg.worker)
            if pending is not None:
                break
            if time.monotonic() > deadline:
                self._fail(f"no regrouping plan within {self.cfg.rendezvous_timeout_s}s after: {reason}")
            time.sleep(0.01)
        if pending.error is not None or pending.aborted:
            self._fail(f"regrouping for generation {pending.plan.gen} failed: {pending.error}")
        self._adopt(pending.plan, pending.pg)
        if self.rank == 0:
            self._control.send(
                pr.Switched(
                    worker=self.cfg.worker,
                    gen=self.gen,
                    step=self.iteration,
                    stop_time_s=time.perf_counter() - t0,
                )
            )

    def _checkpoint_and_stop(self) -> None:
        t0 = time.perf_counter()
        path = self.save_checkpoint() if self.rank == 0 else ""
        if self.rank == 0 and self._control is not None:
            self._control.send(
                pr.Stopped(
                    worker=self.cfg.worker,
                    step=self.iteration,
                    checkpoint=path,
                    checkpoint_s=time.perf_counter() - t0,
                )
            )
        self._exit_now()

    def _exit_now(self) -> None:
        """End this worker at once: its state lives on in the others or in the checkpoint.

        ``os._exit`` because a clean interpreter exit can wait seconds on the
        destructors of process groups other workers still use.
        """
        if self._trace is not None:
            self._trace.close()
        if self._control is not None:
            self._control.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def _finish(self) -> None:
        if self.rank == 0:
            self.save_checkpoint()
            if self._control is not None:
                self._control.send(pr.Done(worker=self.cfg.worker, step=self.iteration))

    def _fail(self, reason: str) -> NoReturn:
        if self._control is not None:
            self._control.send(
                pr.WorkerFailed(
                    worker=self.cfg.worker, gen=self.gen, step=self.iteration, reason=reason[:2000]
                )
            )
        raise RuntimeError(f"shoal.train worker {self.cfg.worker}: {reason}")

    # -- tracing (tests and debugging) -----------------------------------------------------

    def _record(self, step: Step) -> None:
        if not self.cfg.trace_dir:
            return
        if self._trace is None:
            Path(self.cfg.trace_dir).mkdir(parents=True, exist_ok=True)
            # Unbuffered: each line goes out in one write(2), so a worker killed while
            # recording (a close without checkpoint, a kill -9) leaves no half line. A
            # buffered text file wrote a line longer than its 8 KiB buffer (one with
            # the parameters) in pieces, and CI once read such a torn last line.
            self._trace = open(  # noqa: SIM115 - kept open for the process's life
                Path(self.cfg.trace_dir) / f"steps-w{self.cfg.worker}-p{os.getpid()}.jsonl", "ab", buffering=0
            )
        line = {
            "step": step.iteration,
            "gen": self.gen,
            "world": step.world_size,
            "rank": step.rank,
            "data_epoch": step.data_epoch,
            "indices": step.indices.tolist(),
            "loss": self.loss,
        }
        every = self.cfg.trace_params_every
        if self.rank == 0 and every and (self.iteration % every == 0 or self._switch_to > self.gen):
            assert self.model is not None
            line["params_after"] = torch.cat(
                [p.detach().reshape(-1).double().cpu() for p in self.model.parameters()]
            ).tolist()
        self._trace.write((json.dumps(line) + "\n").encode())
