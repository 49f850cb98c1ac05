"""The real sidecar's controller reports progress at backing-off intervals
(:mod:`shoal.reporting`): often after each new generation, rarely in a steady stretch.
Driven through its control protocol's messages, as rank 0 sends them after every step;
no worker runs."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
from shoal import events as ev
from shoal.train import controller as controller_module
from shoal.train import protocol as pr
from shoal.train.controller import Controller

from tests.train.conftest import Recorder


def step(gen: int, n: int) -> pr.Progress:
    return pr.Progress(
        worker=0, gen=gen, step=n, data_epoch=0, cursor=n, loss=1.0, samples=8, step_time_s=0.01, world=1
    )


async def run_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_every_s: float | None) -> list[int]:
    """Steps every 0.125 s (on a clock the test moves): 600 in generation 1, then 100 in
    generation 2; the steps reported."""
    now = [1000.0]
    monkeypatch.setattr(controller_module.time, "monotonic", lambda: now[0])
    rec = Recorder()
    ctl = Controller(
        job_id="j",
        argv=[sys.executable, "-c", "pass"],
        workdir=tmp_path,
        gpu_index=lambda g: g.index,
        max_gpus=1,
        emit=rec,
        report_every_s=0.5,
        report_max_every_s=max_every_s,
    )
    n = 0
    for gen, count in ((1, 600), (2, 100)):
        for _ in range(count):
            n += 1
            now[0] += 0.125
            await ctl._on_message(step(gen, n))
    return [e.iteration for e in rec.of(ev.ProgressReported)]


async def test_reports_back_off_to_the_maximum_and_start_over_in_a_new_generation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fixed = await run_steps(tmp_path, monkeypatch, None)
    # Every 0.5 s (4 steps) for 87.5 s.
    assert len(fixed) == 175
    backoff = await run_steps(tmp_path, monkeypatch, 8.0)
    # Generation 1 (75 s): its first step reported, then intervals of 1, 2, 4, 8, 8, ...
    # s (0.5 s doubled at each report); generation 2 (12.5 s): the same again.
    gen1 = [s for s in backoff if s <= 600]
    gen2 = [s for s in backoff if s > 600]
    gaps = [b - a for a, b in itertools.pairwise(gen1)]
    assert gen1[0] == 1 and gaps[:3] == [8, 16, 32] and set(gaps[3:]) == {64}, gen1
    assert gen2[0] == 601, "the new generation's first step is reported"
    assert [b - a for a, b in itertools.pairwise(gen2)][:3] == [8, 16, 32], gen2
    assert len(backoff) < len(fixed) / 5
