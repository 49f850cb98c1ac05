"""The NCCL path on real GPUs: start, stop-free scale-out and graceful scale-in (skipped without CUDA)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from shoal import events as ev  # noqa: E402
from shoal.train.config import TrainConfig  # noqa: E402

from tests.train.conftest import Recorder, order, wait_steps  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


async def test_nccl_workers_resize_in_place(make_controller, job_id: str) -> None:
    n = torch.cuda.device_count()
    rec = Recorder()
    ctl = make_controller(
        emit=rec,
        slots=n,
        max_gpus=n,
        train=TrainConfig(device="cuda", collective_timeout_s=30, rendezvous_timeout_s=120),
    )
    await ctl.start()
    shapes = [1, 2, 1] if n >= 2 else [1]
    for epoch, k in enumerate(shapes, start=1):
        assert await ctl.apply(order(job_id, epoch, k)) == "started"
        await ctl.wait_idle(180)
        await wait_steps(ctl, 20)
        assert ctl.progress is not None and ctl.progress.world == k
    assert not rec.of(ev.ReconfigurationFailed)
    kinds = [s.kind for s in rec.of(ev.ReconfigurationStarted)]
    assert kinds == ["start", "scale_out", "scale_in"][: len(shapes)]
