"""Leader handover without a restart (EDL §4.2): the leader leaves, a surviving worker's
new leader adopts the running generation, and nobody reloads a checkpoint.

* fast (default run): a worker's control connection follows the leader file to the next
  leader when the old one closes it;
* slow: two controllers over real gloo workers (the old leader scales in to the survivor,
  detaches, the new one adopts it and scales out again), checked update by update against
  one process on the same global batches;
* slow: the shipped path, two real sidecar processes on two "nodes" over a real
  nats-server: the leader's node is taken out of the job's share.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from shoal import events as ev
from shoal.bus import Bus
from shoal.train import protocol as pr
from shoal.train.config import TrainConfig

from tests.services.test_allocator_placer import events_of
from tests.train.conftest import Recorder, gpus, order, processes_of, read_trace, wait_steps
from tests.train.test_sidecar import order_line, send, stop, wait_event
from tests.train.test_sidecar_nodes import (
    N0,
    N1,
    Parents,
    leader_and_follower,
    lease_holder,
    setup_job,
    start_node_sidecar,
    steps_by_gen,
    stop_all,
)

# -- fast: the worker's side of a handover -------------------------------------------------------


class _Server:
    """A control server that records the lines it gets and can close its connections."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.lines: list[pr.ToSidecar] = []
        self.conns: list[socket.socket] = []
        self.got = threading.Condition()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with conn.makefile("rb") as f:
            for line in f:
                with self.got:
                    self.lines.append(pr.decode_to_sidecar(line))
                    self.got.notify_all()

    def wait_for(self, pred, timeout: float = 10.0) -> None:
        with self.got:
            assert self.got.wait_for(lambda: pred(self.lines), timeout), self.lines

    def close(self) -> None:
        for c in self.conns:
            c.shutdown(socket.SHUT_RDWR)
            c.close()
        self.sock.close()


def test_a_worker_follows_the_leader_file_to_the_next_leader(tmp_path: Path) -> None:
    from shoal.train.runtime import _Control

    old, new = _Server(), _Server()
    ctl = _Control(
        old.address,
        7,
        5.0,
        leader="old",
        checkpoint_dir=str(tmp_path),
        hello=lambda: pr.Hello(worker=7, pid=os.getpid(), gen=3, step=42),
    )
    try:
        old.wait_for(lambda lines: any(isinstance(m, pr.Hello) for m in lines))
        # A stale file (the leader it is losing) is not followed.
        pr.write_leader_file(tmp_path, pr.LeaderAddress(control=old.address, leader="old"))
        old.close()
        time.sleep(0.3)  # the worker sees the close and polls the file meanwhile
        assert not new.lines
        pr.write_leader_file(tmp_path, pr.LeaderAddress(control=new.address, leader="new"))
        new.wait_for(lambda lines: bool(lines))
        assert new.lines[0] == pr.Hello(worker=7, pid=os.getpid(), gen=3, step=42)
        assert ctl.leader == "new"
        # It is the new leader's worker now, both ways.
        ctl.send(pr.Left(worker=7, gen=4, step=43))
        new.wait_for(lambda lines: pr.Left(worker=7, gen=4, step=43) in lines)
        new.conns[0].sendall(pr.encode(pr.Commit(gen=4, at_step=50)))
        assert ctl.inbox.get(timeout=5) == pr.Commit(gen=4, at_step=50)
        # The new leader goes away and nobody replaces it: the worker gives up after its timeout.
        ctl.timeout_s = 0.5
        new.close()
        assert ctl.inbox.get(timeout=5) is None
    finally:
        ctl.close()


def test_without_a_leader_file_a_closed_connection_ends_coordination(tmp_path: Path) -> None:
    from shoal.train.runtime import _Control

    old = _Server()
    ctl = _Control(old.address, 1, 5.0, leader="old", checkpoint_dir="")
    try:
        old.wait_for(lambda lines: bool(lines))
        old.close()
        assert ctl.inbox.get(timeout=5) is None
    finally:
        ctl.close()


def test_handover_round_trips_through_the_metadata() -> None:
    import msgspec

    h = pr.Handover(
        leader="n0-1", gen=4, members=(3, 5), gpus=(("n1", 0), ("n2", 1)), next_worker=6, epoch=9, step=120
    )
    assert msgspec.convert(msgspec.to_builtins(h), pr.Handover) == h


@pytest.mark.parametrize(
    ("role", "who", "ok"),
    [("sidecar", "n1", True), ("admin", "", True), ("client", "alice", False), ("node", "n1", False)],
)
def test_only_sidecars_may_ask_a_node_to_hand_over_its_workers(role: str, who: str, ok: bool) -> None:
    """The adopt request (``remote.py``) rides on ``<P>.sidecar.>``: an outsider identity
    cannot take over a job's workers."""
    from shoal import auth

    from tests.test_auth import allowed

    ident = auth.Identity(name=auth.identity_name(role, who), role=role, subject=who)  # type: ignore[arg-type]
    assert allowed(auth.permissions(ident, "shoal"), "publish", "shoal.sidecar.j1.n1.adopt") is ok


# -- slow: two controllers, real workers ------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.slow
async def test_a_new_leader_adopts_the_survivors_without_a_reload(
    make_controller, job_id: str, tmp_path: Path
):
    """Leader A runs 2 workers, scales in to the worker on slot 1 (the leader's own worker
    leaves), detaches; leader B adopts the survivor and later scales out to 2 again. No
    checkpoint is ever written (``checkpoint_every=0``), so nothing could be reloaded: every
    update before, across and after the handover equals one process's update on the same
    global batch (the survivor kept its model, optimizer and data position in memory)."""
    from tests.train.test_elastic import _global_batches, _load_example

    trace = tmp_path / "trace"
    ckpt = tmp_path / "shared-checkpoint"
    train = TrainConfig(
        collective_timeout_s=10,
        rendezvous_timeout_s=60,
        checkpoint_every=0,
        checkpoint_dir=str(ckpt),
        trace_dir=str(trace),
        trace_params_every=5,
    )
    rec_a, rec_b = Recorder(), Recorder()
    a = make_controller(emit=rec_a, train=train, leader_id="A")
    await a.start()
    await a.apply(order(job_id, 1, 2))
    await a.wait_idle(120)
    await wait_steps(a, 20)
    await a.apply(ev.Reconfigure(job_id=job_id, epoch=2, gpus=(gpus(2)[1],)))
    await a.wait_idle(120)
    assert a.current is not None and len(a.current.members) == 1
    survivor = a.workers[a.current.members[0]]
    handover = await a.detach()
    assert handover.members == (survivor.id,) and handover.gpus == (("n0", 1),)
    at_handover = a.progress.step if a.progress else 0

    b = make_controller(emit=rec_b, train=train, leader_id="B")
    await b.start()
    await b.adopt(handover, {survivor.id: survivor.proc})
    await wait_steps(b, 15)
    assert b.connected() and b.progress is not None and b.progress.step > at_handover
    assert processes_of(job_id) == [survivor.proc.pid], "the survivor went on; nothing restarted"
    # The adopted generation is resized like any other: B's store, B's control server.
    assert await b.apply(order(job_id, 3, 2)) == "started"
    await b.wait_idle(120)
    assert b.current is not None and b.current.members[0] == survivor.id and len(b.current.members) == 2
    await wait_steps(b, 15)
    await b.close(checkpoint=False)

    assert [s.kind for s in rec_b.of(ev.ReconfigurationStarted)] == ["scale_out"], "no start, no recovery"
    assert not (ckpt / "checkpoint.pt").exists(), "no checkpoint existed to reload"
    batches = _global_batches(read_trace(trace))  # every step ran once, at every rank
    assert [w for _, w, _, _ in batches].count(1) >= 15
    import torch
    import torch.nn.functional as F

    mod = _load_example()
    torch.set_num_threads(1)
    x, y = mod.load_digits(torch.float64)
    model, opt = mod.build(0, torch.float64, "sgd", 0.05)
    compared = 0
    for step, _, batch, row in batches:
        idx = torch.as_tensor(batch)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert abs(loss.item() - row["loss"]) <= 1e-9 * max(1.0, abs(loss.item())), f"loss at step {step}"
        if "params_after" in row:
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
            np.testing.assert_allclose(
                row["params_after"], flat, rtol=1e-8, atol=1e-10, err_msg=f"step {step}"
            )
            compared += 1
    assert compared >= 6


# -- slow: the shipped path, two sidecar processes ----------------------------------------------------


@pytest.mark.integration
@pytest.mark.slow
async def test_taking_away_the_leaders_node_hands_over_without_a_restart(
    bus: Bus, nats_url: str, job_id: str, tmp_path: Path
) -> None:
    """Two nodes, the job on both, the sidecar on n0 leads. The allocator takes n0 out of the
    job's share: n0's node daemon sends the order and closes the sidecar's stdin. The leader
    scales in to n1 (its own worker leaves), hands over, and n1's sidecar adopts the worker
    it runs: the same process goes on training from where it was (no step is redone, no
    checkpoint is restored), and the new leader then resizes the job back onto both nodes."""
    trace = tmp_path / "trace"
    await setup_job(bus, job_id, trace)
    sides: list[subprocess.Popen] = []
    try:
        s0, s1 = await leader_and_follower(bus, nats_url, job_id, tmp_path, sides)
        with Parents(job_id) as parents:
            for s in (s0, s1):
                send(s, order_line(job_id, 1, (N0, N1)))
            await wait_event(
                bus, ev.ProgressReported, lambda e: e.epoch == 1 and e.num_gpus == 2 and e.iteration >= 30
            )
            # n0 leaves the job's share: the order to both, then n0's stdin closes.
            for s in (s0, s1):
                send(s, order_line(job_id, 2, (N1,)))
            assert stop(s0) == 0
            left_at = max(e.iteration for e in await events_of(bus, ev.ProgressReported))
            await wait_event(
                bus,
                ev.ProgressReported,
                lambda e: e.epoch == 2 and e.num_gpus == 1 and e.iteration >= left_at + 30,
                timeout=120,
            )
            survivors = [pid for pid, parent in parents.of.items() if parent == s1.pid]
            # Alive: n1's sidecar (it carries the job id too) and its worker, nothing else.
            assert len(survivors) == 1 and set(processes_of(job_id)) == {s1.pid, *survivors}
            deadline = time.monotonic() + 30
            while not (await lease_holder(bus, job_id)).endswith(f"-{s1.pid}"):
                assert time.monotonic() < deadline, "n1's sidecar did not take the lease"
                await asyncio.sleep(0.1)
            # The new leader resizes the adopted job back onto both nodes.
            s0b = start_node_sidecar(bus, nats_url, job_id, "n0", tmp_path)
            sides.append(s0b)
            for s in (s1, s0b):
                send(s, order_line(job_id, 3, (N0, N1)))
            await wait_event(bus, ev.ReconfigurationCompleted, lambda e: e.epoch == 3 and e.world_size == 2)
            regrown_at = max(e.iteration for e in await events_of(bus, ev.ProgressReported))
            await wait_event(
                bus,
                ev.ProgressReported,
                lambda e: e.epoch == 3 and e.num_gpus == 2 and e.iteration >= regrown_at + 20,
            )
            assert survivors[0] in processes_of(job_id), "the adopted worker is still the same process"
        started = [(s.epoch, s.kind) for s in await events_of(bus, ev.ReconfigurationStarted)]
        assert started == [(1, "start"), (2, "scale_in"), (3, "scale_out")], "never restarted"
        assert not await events_of(bus, ev.ReconfigurationFailed)
    finally:
        stop_all(sides)
    by_gen = steps_by_gen(trace)
    rows = [r for steps in by_gen.values() for rs in steps.values() for r in rs]
    # Progress went on across the handover: every step once, none redone from a checkpoint.
    steps = sorted({r["step"] for r in rows})
    assert steps == list(range(steps[-1] + 1))
    for step in steps[:-3]:  # the last few may miss the rows of a worker stopped at the end
        at = [r for r in rows if r["step"] == step]
        assert len(at) == at[0]["world"], f"step {step} ran once per rank: {at}"
    survivor_rows = [r for r in rows if r["pid"] == survivors[0]]
    assert {r["world"] for r in survivor_rows} == {1, 2} and min(r["step"] for r in survivor_rows) < left_at
    assert not processes_of(job_id)
