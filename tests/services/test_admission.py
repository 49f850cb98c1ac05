"""admission against a real nats-server: every bad command gets a specific error and
changes nothing; a good one lands in the log exactly once."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from collections.abc import AsyncIterator

import pytest
from shoal import admission, codec
from shoal import events as ev
from shoal import state as st
from shoal.bus import Bus
from shoal.projection import Projection
from shoal_services.admission.service import AdmissionService

pytestmark = pytest.mark.integration


@pytest.fixture
async def service(bus: Bus) -> AsyncIterator[AdmissionService]:
    await bus.publish_many(
        [
            ev.NodeRegistered(
                node_id="n0", gpus=tuple(ev.GpuInfo(index=i, gpu_type="V100") for i in range(4))
            ),
            ev.UserRegistered(user="alice", tickets=100, max_active_jobs=3),
        ]
    )
    projection = Projection(bus)
    await projection.start()
    await projection.wait_ready()
    svc = AdmissionService(bus, projection, admission.Limits(enforce_users=True))
    await svc.start()
    try:
        yield svc
    finally:
        await svc.stop()
        await projection.stop()


async def request(bus: Bus, name: str, body: dict, *, as_json: bool = True) -> dict:
    if as_json:
        msg = await bus.nc.request(
            bus.names.cmd(name),
            json.dumps(body).encode(),
            timeout=5,
            headers={"Content-Type": "application/json"},
        )
        return json.loads(msg.data)
    import msgspec

    msg = await bus.nc.request(bus.names.cmd(name), msgspec.msgpack.encode(body), timeout=5)
    return msgspec.msgpack.decode(msg.data)


def submit(spec: dict, job_id: str | None = "job1") -> dict:
    length = {} if "convergence_target" in spec else {"total_iterations": 100}
    body: dict = {"type": "cmd.submit_job", "spec": {"user": "alice", **length, **spec}}
    if job_id:
        body["job_id"] = job_id
    return body


async def test_submission_lands_once_and_is_idempotent(bus: Bus, service: AdmissionService) -> None:
    body = submit({"min_gpus": 1, "max_gpus": 4, "requested_gpus": 2, "total_iterations": 1000})
    first = await request(bus, "submit_job", body)
    again = await request(bus, "submit_job", body, as_json=False)
    assert first["type"] == "reply.accepted" and first["id"] == "job1" and not first["duplicate"]
    assert again["type"] == "reply.accepted" and again["duplicate"]
    submitted = [e for _, e in [x async for x in bus.replay()] if isinstance(e.event, ev.JobSubmitted)]
    assert len(submitted) == 1
    assert service.projection.state.jobs["job1"].spec.requested_gpus == 2


async def test_concurrent_duplicate_submissions_land_once(bus: Bus, service: AdmissionService) -> None:
    body = submit({"total_iterations": 10}, job_id="racy")
    replies = await asyncio.gather(*(request(bus, "submit_job", body) for _ in range(10)))
    assert all(r["type"] == "reply.accepted" for r in replies)
    assert sum(not r["duplicate"] for r in replies) == 1
    submitted = [e for _, e in [x async for x in bus.replay()] if isinstance(e.event, ev.JobSubmitted)]
    assert len(submitted) == 1


@pytest.mark.parametrize(
    ("spec", "code", "fragment"),
    [
        ({"min_gpus": 0}, "invalid_command", "Expected `int` >= 1 - at `$.spec.min_gpus`"),
        ({"max_gpus": -2}, "invalid_command", "Expected `int` >= 1 - at `$.spec.max_gpus`"),
        (
            {"min_gpus": 4, "max_gpus": 2, "requested_gpus": 2},
            "invalid_spec",
            "min_gpus (4) is greater than max_gpus (2)",
        ),
        ({"gpu_type": "H100"}, "invalid_spec", "unknown gpu_type 'H100'"),
        ({"max_gpus": "eight"}, "invalid_command", "Expected `int`, got `str` - at `$.spec.max_gpus`"),
        ({"min_gpus": 8, "max_gpus": 8, "requested_gpus": 8}, "invalid_spec", "exceeds the cluster's 4 GPUs"),
        ({"user": "mallory"}, "unknown_user", "user 'mallory' is not registered"),
        ({"name": "x" * 300_000}, "too_large", "exceeds the 262144-byte limit"),
    ],
)
async def test_bad_specs_get_a_specific_error_and_change_nothing(
    bus: Bus, service: AdmissionService, spec: dict, code: str, fragment: str
) -> None:
    before_seq = await bus.last_seq()
    before = st.digest(service.projection.state)
    reply = await request(bus, "submit_job", submit(spec))
    assert reply["type"] == "reply.rejected"
    assert reply["code"] == code
    assert fragment in reply["message"]
    assert await bus.last_seq() == before_seq
    assert st.digest(service.projection.state) == before


async def test_cancel_unknown_job_is_a_clear_error(bus: Bus, service: AdmissionService) -> None:
    reply = await request(bus, "cancel_job", {"type": "cmd.cancel_job", "job_id": "nope"})
    assert reply == {
        "type": "reply.rejected",
        "code": "unknown_job",
        "message": "no job 'nope'",
        "errors": ["no job 'nope'"],
    }


async def test_per_user_limit(bus: Bus, service: AdmissionService) -> None:
    for i in range(3):
        ok = await request(bus, "submit_job", submit({"total_iterations": 5}, job_id=f"l{i}"))
        assert ok["type"] == "reply.accepted"
    over = await request(bus, "submit_job", submit({"total_iterations": 5}, job_id="l3"))
    assert over["code"] == "limit_exceeded" and "limit 3" in over["message"]
    cancel = await request(bus, "cancel_job", {"type": "cmd.cancel_job", "job_id": "l0"})
    assert cancel["type"] == "reply.accepted"
    again = await request(bus, "submit_job", submit({"total_iterations": 5}, job_id="l3"))
    assert again["type"] == "reply.accepted"


async def test_command_on_the_wrong_subject(bus: Bus, service: AdmissionService) -> None:
    reply = await request(bus, "cancel_job", submit({"total_iterations": 5}))
    assert reply["code"] == "wrong_subject"


async def test_a_client_with_only_nats_py_and_json(
    bus: Bus, service: AdmissionService, nats_url: str
) -> None:
    """The documented wire contract works from a program that does not import shoal."""
    client = textwrap.dedent(
        f"""
        import asyncio, json, os, sys
        import nats
        async def main():
            nc = await nats.connect({nats_url!r}, nkeys_seed=os.environ["NATS_CREDS"])
            body = {{"type": "cmd.submit_job", "job_id": "plain-1",
                     "spec": {{"user": "alice", "model": "resnet50", "min_gpus": 1, "max_gpus": 2,
                              "requested_gpus": 1, "total_iterations": 100}}}}
            msg = await nc.request({bus.names.cmd("submit_job")!r}, json.dumps(body).encode(),
                                   timeout=5, headers={{"Content-Type": "application/json"}})
            print(msg.data.decode())
            await nc.close()
        asyncio.run(main())
        """
    )
    # The service runs in this event loop: wait for the client without blocking it.
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-c",
        "import sys; sys.modules['shoal'] = None\n" + client,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, stderr.decode()
    reply = json.loads(stdout)
    assert reply["type"] == "reply.accepted" and reply["id"] == "plain-1"
    assert codec.to_builtins(service.projection.state.jobs["plain-1"].spec.max_gpus) == 2


def test_per_user_gpu_limit_counts_the_guaranteed_gpus_of_active_jobs() -> None:
    """``max_gpus_per_user`` (or the user's own ``max_gpus``) bounds the sum of ``min_gpus``
    over the user's active jobs; a finished job frees its part."""
    apply = st.apply
    state = st.ClusterState()
    for e in (
        ev.NodeRegistered(node_id="n0", gpus=tuple(ev.GpuInfo(index=i, gpu_type="V100") for i in range(8))),
        ev.UserRegistered(user="bob", tickets=100, max_gpus=4),
    ):
        state = apply(state, codec.wrap(e, at=0.0))
    limits = admission.Limits(max_gpus_per_user=6)

    def spec(user: str, gpus: int) -> ev.SubmitJob:
        return ev.SubmitJob(
            spec=ev.JobSpec(user=user, min_gpus=gpus, max_gpus=gpus, requested_gpus=gpus, total_iterations=5)
        )

    first = admission.decide_submit(state, spec("bob", 3), "b1", limits)
    assert isinstance(first, admission.Accepted)
    state = apply(state, codec.wrap(first.event, at=1.0))
    over = admission.decide_submit(state, spec("bob", 2), "b2", limits)
    assert isinstance(over, admission.Rejected) and over.code == "limit_exceeded"
    assert "would hold 5 guaranteed GPUs (limit 4)" in over.message  # the user's own limit wins
    # Without a per-user limit the service-wide one applies.
    carol = [admission.decide_submit(state, spec("carol", 3), f"c{i}", limits) for i in range(2)]
    assert all(isinstance(c, admission.Accepted) for c in carol)
    for i, c in enumerate(carol):
        state = apply(state, codec.wrap(c.event, at=2.0 + i))
    assert isinstance(admission.decide_submit(state, spec("carol", 1), "c9", limits), admission.Rejected)
    state = apply(state, codec.wrap(ev.JobCompleted(job_id="c0", iterations=5), at=9.0))
    assert isinstance(admission.decide_submit(state, spec("carol", 1), "c9", limits), admission.Accepted)


def test_set_user_limits_keeps_what_it_does_not_name_and_the_users_tickets() -> None:
    """``SetUserLimits`` becomes the user's ``UserRegistered``: a limit left out keeps
    its value, the tickets stay as they are, the same limits again are a duplicate, and
    a command naming no limit is refused (it would say nothing)."""
    from shoal.admin_commands import SetUserLimits

    state = st.ClusterState()
    state = st.apply(state, codec.wrap(ev.TicketsSet(user="bob", tickets=300), at=0.0))
    first = admission.decide_set_user_limits(state, SetUserLimits(user="bob", max_active_jobs=4))
    assert isinstance(first, admission.Accepted)
    assert first.event == ev.UserRegistered(user="bob", tickets=300, max_active_jobs=4, max_gpus=0)
    state = st.apply(state, codec.wrap(first.event, at=1.0))
    second = admission.decide_set_user_limits(state, SetUserLimits(user="bob", max_gpus=8))
    assert isinstance(second, admission.Accepted)
    assert second.event == ev.UserRegistered(user="bob", tickets=300, max_active_jobs=4, max_gpus=8)
    state = st.apply(state, codec.wrap(second.event, at=2.0))
    again = admission.decide_set_user_limits(state, SetUserLimits(user="bob", max_active_jobs=4, max_gpus=8))
    assert isinstance(again, admission.Accepted) and again.duplicate and again.event is None
    new = admission.decide_set_user_limits(state, SetUserLimits(user="dan", max_active_jobs=0))
    assert isinstance(new, admission.Accepted)
    assert new.event == ev.UserRegistered(user="dan", tickets=100, max_active_jobs=0, max_gpus=0)
    empty = admission.decide_set_user_limits(state, SetUserLimits(user="bob"))
    assert isinstance(empty, admission.Rejected) and empty.code == "invalid_command" and empty.errors
