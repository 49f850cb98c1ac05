"""schemas/ is generated from the code: the drift test, determinism, and the raw JSON
submit protocol documented in SUBJECTS.md checked against a real admission service."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest
from shoal import admission
from shoal import events as ev
from shoal.bus import Bus
from shoal.projection import Projection
from shoal.schema_export import INDEX, SUBJECTS, export, generate, stale_files, subject_pattern
from shoal_services.admission.service import AdmissionService

SCHEMAS = Path(__file__).resolve().parents[1] / "schemas"


def test_committed_schemas_are_up_to_date() -> None:
    stale = stale_files(SCHEMAS)
    assert not stale, f"schemas/ is out of date, run `shoal schemas export`: {stale}"


def test_generation_is_deterministic_and_complete() -> None:
    first, second = generate(), generate()
    assert first == second
    for name, content in first.items():
        assert content.endswith("\n") and not content.endswith("\n\n"), name
        if name.endswith(".json"):
            data = json.loads(content)
            assert content == json.dumps(data, sort_keys=True, indent=2, ensure_ascii=False) + "\n"
    index = json.loads(first[INDEX])["types"]
    tags = {entry.get("tag") for entry in index.values()}
    for cls in (*ev.EVENT_TYPES, *ev.COMMAND_TYPES, ev.CommandAccepted, ev.CommandRejected):
        assert cls.__name__ in index, cls
        assert f"{cls.__name__}.json" in first
        assert cls.__struct_config__.tag in tags
    for name in ("Envelope", "JobSpec", "AnyEvent", "AnyCommand", "AnyReply"):
        assert f"{name}.json" in first
    any_event = json.loads(first["AnyEvent.json"])
    assert set(any_event["$defs"]) >= {cls.__name__ for cls in ev.EVENT_TYPES}
    submitted = json.loads(first["JobSubmitted.json"])
    body = submitted["$defs"]["JobSubmitted"]
    assert body["properties"]["type"] == {"enum": ["job.submitted"]}
    assert "spec" in body["required"]


def test_subject_patterns_match_the_bus() -> None:
    samples: list[ev.Event] = [
        ev.JobSubmitted(job_id="J1", spec=ev.JobSpec(user="u", total_iterations=1)),
        ev.ReconfigurationCompleted(job_id="J1", epoch=1, world_size=2),
        ev.ThroughputModelUpdated(job_id="J1", gpu_type="V100"),
        ev.NodeHeartbeat(node_id="N1"),
        ev.TicketsSet(user="U1", tickets=5),
        ev.SharesDecided(epoch=1, shares={}),
        ev.TradeUndone(trade_id="T1"),
    ]
    for event in samples:
        cls = type(event)
        key = getattr(event, cls.key_field) if cls.key_field else None
        pattern = subject_pattern(cls, "p")
        expected = pattern.replace(f"<{cls.key_field}>", key) if key else pattern
        assert ev.subject_for(event, "p") == expected


def test_check_reports_stale_missing_and_extra_files(tmp_path: Path) -> None:
    target = tmp_path / "schemas"
    assert set(export(target)) == set(generate())
    assert stale_files(target) == []
    assert export(target) == []  # idempotent
    (target / "JobSpec.json").write_text("{}\n")
    (target / "SubmitJob.json").unlink()
    (target / "Removed.json").write_text("{}\n")
    assert stale_files(target) == ["JobSpec.json", "Removed.json", "SubmitJob.json"]
    assert set(export(target)) == {"JobSpec.json", "Removed.json", "SubmitJob.json"}
    assert stale_files(target) == []
    assert not (target / "Removed.json").exists()


def _json_blocks(markdown: str) -> list[dict[str, object]]:
    return [json.loads(block) for block in re.findall(r"```json\n(.*?)\n```", markdown, flags=re.S)]


@pytest.mark.integration
async def test_documented_json_submission_works_against_admission(bus: Bus) -> None:
    """The request and replies in SUBJECTS.md are what a raw JSON client really gets."""
    request, accepted, rejected = _json_blocks(generate()[SUBJECTS])
    projection = Projection(bus)
    await projection.start()
    await projection.wait_ready()
    service = AdmissionService(bus, projection, admission.Limits())
    await service.start()
    headers = {"Content-Type": "application/json"}
    try:
        subject = bus.names.cmd("submit_job")  # the documented shoal.cmd.submit_job, under the test's prefix
        reply = await bus.nc.request(subject, json.dumps(request).encode(), timeout=10, headers=headers)
        got = json.loads(reply.data)
        assert got["type"] == accepted["type"] == "reply.accepted"
        assert got["id"] == accepted["id"] == request["job_id"]
        assert got["duplicate"] is False
        assert set(got) == set(accepted)
        again = json.loads(
            (await bus.nc.request(subject, json.dumps(request).encode(), timeout=10, headers=headers)).data
        )
        assert again["type"] == "reply.accepted" and again["duplicate"] is True
        bad = {**request, "spec": {**request["spec"], "max_gpus": 0}}  # type: ignore[dict-item]
        refused = json.loads(
            (await bus.nc.request(subject, json.dumps(bad).encode(), timeout=10, headers=headers)).data
        )
        assert refused == rejected
        # Exactly one JobSubmitted reached the log, and it carries the documented spec.
        await projection.wait_for(await bus.last_seq())
        assert list(projection.state.jobs) == [request["job_id"]]
        spec = projection.state.jobs[request["job_id"]].spec
        assert msgspec.to_builtins(spec) == msgspec.to_builtins(msgspec.convert(request["spec"], ev.JobSpec))
    finally:
        await service.stop()
        await projection.stop()


def _admission_accepts(body: dict) -> bool:
    """Admission's own verdict on a JSON submission, short of what depends on the
    cluster or the operator (GPU types, size, allowed commands): the command decoder
    (types, ranges, unknown fields) and the spec's cross-field checks."""
    from shoal import codec

    try:
        cmd = codec.decode_command(json.dumps(body).encode(), json=True)
    except codec.MalformedMessage:
        return False
    return not admission.validate_spec(cmd.spec)


def test_the_schema_and_admission_agree_on_submissions() -> None:
    """A client that validates against `schemas/SubmitJob.json` (and `JobSpec.json`)
    before sending gets the verdict admission gives: both accept the same specs and both
    refuse an unknown field, a control character in a name, a job with no length, a
    wrong type or range. (What depends on the cluster or the operator, like min_gpus >
    max_gpus across fields, is admission's alone: the schema cannot state it.)"""
    from jsonschema import Draft202012Validator

    submit = Draft202012Validator(json.loads((SCHEMAS / "SubmitJob.json").read_text()))
    spec_schema = Draft202012Validator(json.loads((SCHEMAS / "JobSpec.json").read_text()))
    good = {"user": "alice", "model": "resnet50", "max_gpus": 2, "total_iterations": 100}
    cases = {
        "plain": ({}, True),
        "unknown length": ({"total_iterations": None, "convergence_target": 0.5}, True),
        "a name": ({"name": "nightly sweep #3"}, True),
        "misspelt field": ({"max_gpu": 4}, False),
        "newline in name": ({"name": "a\nfake row"}, False),
        "escape in model": ({"model": "resnet\x1b[2J"}, False),
        "no length": ({"total_iterations": None}, False),
        "both lengths": ({"convergence_target": 0.5}, False),
        "zero gpus": ({"max_gpus": 0}, False),
        "negative target": ({"total_iterations": None, "convergence_target": -1.0}, False),
        "text for a number": ({"max_gpus": "two"}, False),
    }
    for case, (override, expected) in cases.items():
        spec = {k: v for k, v in {**good, **override}.items() if v is not None}
        body = {"type": "cmd.submit_job", "spec": spec}
        verdicts = {
            "admission": _admission_accepts(body),
            "SubmitJob.json": submit.is_valid(body),
            "JobSpec.json": spec_schema.is_valid(spec),
        }
        assert set(verdicts.values()) == {expected}, (case, verdicts)
    # An unknown field beside the spec, too.
    body = {"type": "cmd.submit_job", "spec": good, "jobid": "x"}
    assert not _admission_accepts(body) and not submit.is_valid(body)
