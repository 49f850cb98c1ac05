"""`shoal drain` and `shoal undrain` against an installation started as a user starts it
(`shoal up`, 2 emulated nodes of 2 GPUs), run as a user runs them (the CLI, in its own
process).

Draining the node a running elastic job is on moves the job to the other node without
losing its progress, and the command returns once no job holds a GPU on the node. A
connection that is not the admin's is refused before anything is sent, and so is an
unknown node; a second drain changes nothing. Undraining brings the node back: a job
that needs all four GPUs then runs on both nodes."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from shoal import events as ev
from shoal import state as st
from shoal.bus import Bus
from shoal.client import Client
from shoal.commands.run import CLI_ARGV

from tests.services.test_liveness import Watch, run_job, shoal_up, wait_until

pytestmark = pytest.mark.integration


def shoal(tmp_path: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_"))}
    env["SHOAL_STATE_DIR"] = str(tmp_path / "state")
    return subprocess.run([*CLI_ARGV, *args], env=env, capture_output=True, text=True, timeout=timeout)


def nodes_of(state: st.ClusterState, job_id: str) -> set[str]:
    return {ref.node_id for ref in state.jobs[job_id].placement}


async def test_drain_moves_a_running_job_off_the_node_and_undrain_brings_it_back(tmp_path: Path) -> None:
    async with shoal_up(tmp_path, nodes=2) as up:
        bus = await Bus.connect(up.url, prefix="shoal", **up.admin())
        watch = Watch(bus)
        await watch.projection.start()
        try:
            await wait_until(lambda: watch.nodes_up() == {"node0", "node1"}, 30, "both nodes registered")
            long = ev.JobSpec(
                user="alice", min_gpus=1, max_gpus=2, requested_gpus=2, elastic=True, total_iterations=10**8
            )
            async with await Client.connect(up.url, "shoal", **up.admin()) as client:
                await client.submit(long, job_id="long")
            await wait_until(
                lambda: (
                    "long" in watch.state.jobs
                    and watch.state.jobs["long"].status == st.RUNNING
                    and len(nodes_of(watch.state, "long")) == 1
                    and watch.state.jobs["long"].iteration > 0
                ),
                90,
                "the job running on one node",
            )
            (node,) = nodes_of(watch.state, "long")
            other = ({"node0", "node1"} - {node}).pop()

            # Refused before anything is sent: another identity, an unknown node.
            async def drains_in_log() -> int:
                info = await bus.js.stream_info(
                    bus.names.events_stream, subjects_filter="shoal.node.*.drained"
                )
                return sum((info.state.subjects or {}).values())

            outsider = shoal(tmp_path, "drain", node, "--creds", str(up.creds / "profiler.nk"))
            assert outsider.returncode == 2, outsider
            assert "needs the admin's credentials" in outsider.stderr, outsider.stderr
            unknown = shoal(tmp_path, "drain", "nope")
            assert unknown.returncode == 2, unknown
            assert "unknown node 'nope'; nodes: node0, node1" in unknown.stderr, unknown.stderr
            assert watch.state.nodes[node].status == st.NODE_UP
            assert await drains_in_log() == 0, "a refused drain reached the log"

            progress = watch.state.jobs["long"].iteration
            t0 = time.monotonic()
            drained = shoal(tmp_path, "drain", node, "--reason", "disk swap", "--wait", "150")
            assert drained.returncode == 0, drained
            assert f"node {node} drained; no job holds a GPU on it" in drained.stdout, drained.stdout
            print(f"drain returned after {time.monotonic() - t0:.1f} s")
            # The command read this through admission's view; the watch folds on its own.
            await wait_until(
                lambda: watch.state.nodes[node].status == st.NODE_DRAINED, 10, "drained here too"
            )
            state = watch.state
            assert nodes_of(state, "long") == {other}, state.jobs["long"].placement
            assert state.jobs["long"].status == st.RUNNING
            await wait_until(
                lambda: watch.state.jobs["long"].iteration > progress, 60, "the moved job going on"
            )
            assert watch.state.jobs["long"].iteration >= progress, "the move lost work"

            listed = shoal(tmp_path, "nodes", "--json")
            assert listed.returncode == 0, listed
            rows = {row["node_id"]: row for row in json.loads(listed.stdout)}
            assert rows[node]["status"] == "drained" and rows[node]["allocated"] == 0, rows[node]
            again = shoal(tmp_path, "drain", node, "--no-wait")
            assert again.returncode == 0 and "already drained; nothing changed" in again.stdout, again
            assert await drains_in_log() == 1
            # Still out while its node daemon heartbeats: it never registers itself again.
            await asyncio.sleep(3)
            assert watch.state.nodes[node].status == st.NODE_DRAINED

            healthy = sum(g.healthy for g in watch.state.nodes[node].gpus)
            back = shoal(tmp_path, "undrain", node)
            assert back.returncode == 0 and f"node {node} is up again" in back.stdout, back
            await wait_until(lambda: watch.state.nodes[node].status == st.NODE_UP, 30, "the node up again")
            assert sum(g.healthy for g in watch.state.nodes[node].gpus) == healthy
            not_drained = shoal(tmp_path, "undrain", node)
            assert not_drained.returncode == 0 and "is up, not drained" in not_drained.stdout, not_drained

            async with await Client.connect(up.url, "shoal", **up.admin()) as client:
                await client.cancel("long")
            assert await run_job(up, "wide", 4, timeout_s=120) == {"node0", "node1"}
        finally:
            await watch.projection.stop()
            await bus.close()
