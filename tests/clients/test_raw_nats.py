"""A client in "any language": a program that uses only nats-py, json and asyncio
(shoal and msgspec are blocked from importing) submits, re-submits, gets rejections,
cancels and sets tickets with plain NATS requests, as docs/clients.md describes."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from pathlib import Path

import pytest
from shoal import events as ev
from shoal.bus import Bus
from shoal_services.admission.service import AdmissionService

pytestmark = pytest.mark.integration

CLIENT = textwrap.dedent(
    """
    import asyncio
    import json
    import os

    import nats


    async def main(url, prefix):
        # The admin's nkey seed (NATS_CREDS): it may send any command, set_tickets included.
        nc = await nats.connect(url, nkeys_seed=os.environ["NATS_CREDS"])
        headers = {"Content-Type": "application/json"}

        async def request(command, body):
            subject = f"{prefix}.cmd.{command}.@admin"
            msg = await nc.request(subject, json.dumps(body).encode(), timeout=5, headers=headers)
            return json.loads(msg.data)

        spec = {"user": "alice", "model": "resnet50", "min_gpus": 1, "max_gpus": 2,
                "requested_gpus": 1, "total_iterations": 100}
        replies = [
            await request("submit_job", {"type": "cmd.submit_job", "job_id": "raw-1", "spec": spec}),
            await request("submit_job", {"type": "cmd.submit_job", "job_id": "raw-1", "spec": spec}),
            await request("submit_job", {"type": "cmd.submit_job", "spec": spec}),
            await request("submit_job", {"type": "cmd.submit_job", "job_id": "raw-bad",
                                         "spec": dict(spec, min_gpus=0)}),
            await request("cancel_job", {"type": "cmd.cancel_job", "job_id": "no-such-job"}),
            await request("cancel_job", {"type": "cmd.cancel_job", "job_id": "raw-1", "reason": "demo"}),
            await request("set_tickets", {"type": "cmd.set_tickets", "user": "alice", "tickets": 400}),
        ]
        print(json.dumps(replies))
        await nc.close()


    if __name__ == "__main__":
        import sys
        asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


async def test_plain_nats_json_client(
    bus: Bus, service: AdmissionService, nats_url: str, tmp_path: Path
) -> None:
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    guard = (
        "import runpy, sys; sys.modules['shoal'] = None; sys.modules['msgspec'] = None; "
        f"sys.argv = [{str(script)!r}, {nats_url!r}, {bus.names.prefix!r}]; "
        f"runpy.run_path({str(script)!r}, run_name='__main__')"
    )
    # The admission service runs in this event loop: wait for the client without blocking it.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-c", guard, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    first, again, generated, bad, unknown, cancelled, tickets = json.loads(out)
    assert first == {
        "type": "reply.accepted",
        "id": "raw-1",
        "event_id": first["event_id"],
        "duplicate": False,
    }
    assert again["type"] == "reply.accepted" and again["duplicate"] is True and again["id"] == "raw-1"
    assert generated["type"] == "reply.accepted" and len(generated["id"]) == 26
    assert bad["type"] == "reply.rejected" and bad["code"] == "invalid_command"
    assert "Expected `int` >= 1 - at `$.spec.min_gpus`" in bad["message"]
    assert unknown == {
        "type": "reply.rejected",
        "code": "unknown_job",
        "message": "no job 'no-such-job'",
        "errors": ["no job 'no-such-job'"],
    }
    assert cancelled["type"] == "reply.accepted" and tickets["type"] == "reply.accepted"

    # The log holds exactly what was accepted, once.
    log = [env.event async for _, env in bus.replay()]
    submitted = [e.job_id for e in log if isinstance(e, ev.JobSubmitted)]
    assert submitted == ["raw-1", generated["id"]]
    assert [e.job_id for e in log if isinstance(e, ev.JobCancelled)] == ["raw-1"]
    assert [(e.user, e.tickets) for e in log if isinstance(e, ev.TicketsSet)] == [("alice", 400)]
    spec = next(e.spec for e in log if isinstance(e, ev.JobSubmitted))
    assert spec == ev.JobSpec(user="alice", model="resnet50", max_gpus=2, total_iterations=100)
