"""Issue 21, bounded log growth: ``shoal up`` compacts the log on its own
(``SHOAL_COMPACT_EVERY_S``). Jobs run to completion through the shipped commands; the
periodic ``shoal compact`` removes their progress reports, while they run and after,
but the one each fold keeps, a fresh fold of what is left still has every job completed at its last
iteration, and the installation goes on scheduling."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import pytest
from shoal import events as ev
from shoal import state
from shoal.bus import Bus
from shoal.client import Client

from tests.services.test_liveness import shoal_up

pytestmark = pytest.mark.integration


def _spec() -> ev.JobSpec:
    # 10 iterations/s of virtual time at time scale 20: 1,000 iterations in about 5 s.
    return ev.JobSpec(user="alice", max_gpus=1, total_iterations=1000, profile={"V100": {1: 10.0}})


def _compactions(err: Path) -> list[int]:
    """Reports removed by each ``log_compacted`` line of shoal up's log."""
    removed = []
    for line in err.read_text().splitlines():
        if '"log_compacted"' in line:
            match = re.search(r"removed (\d+) progress reports", json.loads(line)["summary"])
            assert match, line
            removed.append(int(match.group(1)))
    return removed


async def _wait_completed(client: Client, jobs: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        jobs_now = (await client.state()).jobs
        if all(j in jobs_now and jobs_now[j].status == "completed" for j in jobs):
            return
        assert time.monotonic() < deadline, {j: jobs_now[j].status for j in jobs if j in jobs_now}
        await asyncio.sleep(0.5)


async def test_shoal_up_removes_the_progress_reports_of_finished_jobs(tmp_path: Path) -> None:
    settings = {
        "SHOAL_REPORT_MAX_EVERY_S": "0.25",  # many reports per job
        "SHOAL_COMPACT_EVERY_S": "3",
        "SHOAL_COMPACT_AFTER_S": "0",  # the default keeps the last week of reports
        "SHOAL_SNAPSHOT_INTERVAL_S": "1",
    }
    err = tmp_path / "up.err"
    async with (
        shoal_up(tmp_path, nodes=2, **settings) as up,
        await Client.connect(up.url, "shoal", **up.admin()) as client,
    ):
        jobs = [f"c{i}" for i in range(3)]
        for j in jobs:
            await client.submit(_spec(), job_id=j)
        await _wait_completed(client, jobs, 90)

        async def fold_and_count() -> tuple[state.ClusterState, dict[str, int]]:
            bus = await Bus.connect(up.url, "shoal", declare=False, **up.admin())
            try:
                fold = state.ClusterState()
                reports = dict.fromkeys(jobs, 0)
                async for _, env in bus.replay():
                    state.apply(fold, env)
                    if isinstance(env.event, ev.ProgressReported) and env.event.job_id in reports:
                        reports[env.event.job_id] += 1
                return fold, reports
            finally:
                await bus.close()

        # Compactions every 3 s; once the snapshots cover a finished job's last report,
        # the next one leaves it only the report its fold keeps.
        deadline = time.monotonic() + 60
        while True:
            fold, reports = await fold_and_count()
            if max(reports.values()) == 1:
                break
            assert time.monotonic() < deadline, (reports, _compactions(err))
            await asyncio.sleep(1.0)
        # The fold may have seen a run still deleting: its summary line comes when it
        # ends. Runs are sequential, so once one more line is logged every removal is.
        logged = len(_compactions(err))
        while len(_compactions(err)) <= logged:
            assert time.monotonic() < deadline + 30, _compactions(err)
            await asyncio.sleep(0.5)
        assert "log_compaction_failed" not in err.read_text()
        assert sum(_compactions(err)) >= 3 * 5, _compactions(err)
        for j in jobs:
            assert fold.jobs[j].status == "completed" and fold.jobs[j].iteration == 1000
            assert fold.jobs[j].last_progress_at is not None

        # The installation goes on: a job submitted after the compaction runs and completes.
        await client.submit(_spec(), job_id="after")
        await _wait_completed(client, ["after"], 60)
