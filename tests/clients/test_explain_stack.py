"""explain and replay over the log of a real run: the emulated stack (admission,
allocator with a real policy, placer, node daemons, sidecar processes) runs three
jobs submitted through the SDK; every share change of every job is then explained
by an event that is in the log, and replay reproduces the live state."""

from __future__ import annotations

import pytest
from shoal import explain
from shoal import state as st
from shoal.bus import Bus
from shoal.client import Client
from shoal.policies.registry import get_policy
from shoal_services.stack import EmulatedStack, StackConfig

pytestmark = pytest.mark.integration


async def test_explain_a_real_run(bus: Bus, nats_url: str) -> None:
    stack = EmulatedStack(
        bus,
        nats_url,
        get_policy("afs-l"),
        StackConfig(nodes=2, gpus_per_node=2, time_scale=400.0, heartbeat_s=0.5),
    )
    await stack.start()
    try:
        client = Client(bus)
        ids = []
        for i, model in enumerate(("Resnet50Model128", "VggnetModel256", "ChatbotModel256")):
            spec = {
                "user": f"u{i % 2}",
                "model": model,
                "max_gpus": 4,
                "requested_gpus": 2,
                "total_iterations": 1500,
            }
            ids.append(await client.submit(spec, job_id=f"r{i}"))
        await stack.wait(lambda s: all(s.jobs[j].status in st.FINISHED_STATUSES for j in ids), timeout_s=240)
        live_digest = st.digest(stack.projection.state)
        live_seq = stack.projection.last_seq
    finally:
        await stack.stop()
    log = [x async for x in bus.replay()]
    by_seq = dict(log)
    for job_id in ids:
        x = explain.explain_job(job_id, log)
        assert x.found and x.status == "completed"
        shares = [e for e in x.entries if e.kind == "share"]
        assert shares, f"{job_id} never got GPUs"
        assert shares[0].old_gpus == 0 and shares[0].new_gpus
        for entry in shares:
            assert entry.trigger is not None and entry.inputs is not None
            if (
                entry.trigger.seq is not None
            ):  # the triggering event is really in the log, before the decision
                assert entry.trigger.seq < entry.seq
                assert by_seq[entry.trigger.seq].type == entry.trigger.type
            else:
                assert entry.trigger.label in ("tick", "takeover")
            # Replaying to just before the decision gives the job's old share.
            before = explain.fold_until(log, explain.Until(seq=entry.seq - 1)).state
            assert before.jobs[job_id].gpus == entry.old_gpus
            after = explain.fold_until(log, explain.Until(seq=entry.seq)).state
            assert after.jobs[job_id].gpus == entry.new_gpus
        assert x.entries[-1].kind == "job.completed"
    whole = explain.fold_until([item for item in log if item[0] <= live_seq], None)
    assert st.digest(whole.state) == live_digest
