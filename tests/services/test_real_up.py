"""Real-mode training through the shipped commands in the default run: `shoal up` with
``SHOAL_SIDECAR_MODE=real`` on CPU slots, the operator's allowlists
(``SHOAL_ENTRYPOINTS``, ``SHOAL_JOB_ENV``) enforced by admission, and the shipped
example (``examples/cnn_digits.py``) trained by a torch worker until it completes.
(The longer real-mode runs, resizes and faults, are ``slow``.)"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from shoal import events as ev
from shoal.client import Client, CommandError

from tests.services.test_liveness import shoal_up

pytestmark = pytest.mark.integration

CNN = Path(__file__).resolve().parents[2] / "examples" / "cnn_digits.py"


async def test_shoal_up_in_real_mode_trains_an_allowed_job_and_refuses_the_rest(tmp_path: Path) -> None:
    settings = {
        "SHOAL_SIDECAR_MODE": "real",
        "SHOAL_ENTRYPOINTS": json.dumps([[sys.executable, str(CNN)]]),
        "SHOAL_JOB_ENV": json.dumps(["OMP_NUM_THREADS"]),
        "SHOAL_NODE_TIMEOUT_S": "300",  # a torch worker may take both cores
    }
    async with (
        shoal_up(tmp_path, nodes=1, **settings) as up,
        await Client.connect(up.url, "shoal", **up.admin()) as client,
    ):
        base = ev.JobSpec(user="alice", max_gpus=1, total_iterations=40, global_batch_size=64)

        async def refused(**fields: object) -> str:
            spec = ev.JobSpec(**{**{f: getattr(base, f) for f in base.__struct_fields__}, **fields})
            with pytest.raises(CommandError) as info:
                await client.submit(spec)
            return info.value.code

        # Refused at admission, before any node sees them.
        assert await refused(entrypoint=("sh", "-c", "id")) == "entrypoint_not_allowed"
        code = await refused(entrypoint=(sys.executable, str(CNN)), env={"LD_PRELOAD": "x.so"})
        assert code == "env_not_allowed"
        allowed = ev.JobSpec(
            user="alice",
            max_gpus=1,
            total_iterations=40,
            global_batch_size=64,
            entrypoint=(sys.executable, str(CNN), "--max-steps", "40"),
            env={"OMP_NUM_THREADS": "1"},
        )
        job_id = await client.submit(allowed, job_id="real-1")
        last = ""
        losses: list[float] = []
        deadline = time.monotonic() + 180
        async for env in client.job_events(job_id):
            last = env.type
            if isinstance(env.event, ev.ProgressReported) and env.event.loss is not None:
                losses.append(env.event.loss)
            assert time.monotonic() < deadline, f"not finished: {last}"
        assert last == "job.completed", last
        assert losses, "no loss reported by the torch worker"
        assert (await client.status(job_id)).status == "completed"
