"""Bad input through the SDK and the CLI: every malformed spec gets its own specific
error back, and nothing reaches the log; duplicates are idempotent; cancelling an
unknown job is a clear error. Real nats-server, real admission service, real CLI
processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from shoal import events as ev
from shoal import state as st
from shoal.bus import Bus
from shoal.client import Client, CommandError
from shoal_services.admission.service import AdmissionService

from tests.clients.conftest import RunCli

pytestmark = pytest.mark.integration

GOOD: dict[str, Any] = {
    "user": "alice",
    "min_gpus": 1,
    "max_gpus": 2,
    "requested_gpus": 1,
    "total_iterations": 100,
}

# (spec overrides, expected code, a fragment of the message)
BAD_SPECS: list[tuple[str, dict[str, Any], str, str]] = [
    ("zero_gpus", {"min_gpus": 0}, "invalid_command", "Expected `int` >= 1 - at `$.spec.min_gpus`"),
    ("negative_gpus", {"max_gpus": -2}, "invalid_command", "Expected `int` >= 1 - at `$.spec.max_gpus`"),
    (
        "min_above_max",
        {"min_gpus": 4, "max_gpus": 2, "requested_gpus": 2},
        "invalid_spec",
        "min_gpus (4) is greater than max_gpus (2)",
    ),
    (
        "unknown_gpu_type",
        {"gpu_type": "H100"},
        "invalid_spec",
        "unknown gpu_type 'H100'; the cluster has ['V100']",
    ),
    (
        "non_numeric",
        {"max_gpus": "eight"},
        "invalid_command",
        "Expected `int`, got `str` - at `$.spec.max_gpus`",
    ),
    ("float_gpus", {"requested_gpus": 1.5}, "invalid_command", "Expected `int`, got `float`"),
    ("oversized", {"name": "x" * 300_000}, "too_large", "exceeds the 262144-byte limit"),
    ("beyond_nats_limit", {"env": {"k": "v" * 2_000_000}}, "too_large", "exceeds the server's"),
    ("unknown_user", {"user": "mallory"}, "unknown_user", "user 'mallory' is not registered"),
    ("typo_field", {"max_gpu": 8}, "invalid_spec", "unknown field 'max_gpu' in job spec"),
    ("bad_user_name", {"user": "al ice"}, "invalid_command", "at `$.spec.user`"),
    (
        "rigid_mismatch",
        {"elastic": False, "min_gpus": 1, "max_gpus": 2, "requested_gpus": 2},
        "invalid_spec",
        "a non-elastic job needs min_gpus == max_gpus == requested_gpus",
    ),
    (
        "too_big_for_cluster",
        {"min_gpus": 8, "max_gpus": 8, "requested_gpus": 8},
        "invalid_spec",
        "exceeds the cluster's 4 GPUs",
    ),
    (
        "negative_convergence_target",
        {"total_iterations": None, "convergence_target": -0.5},
        "invalid_command",
        "Expected `float` > 0.0 - at `$.spec.convergence_target`",
    ),
    (
        "no_length",
        {"total_iterations": None},
        "invalid_spec",
        "set total_iterations (known length) or convergence_target (unknown length)",
    ),
    (
        "nan_convergence_target",
        {"total_iterations": None, "convergence_target": float("nan")},
        "invalid_command",
        "at `$.spec.convergence_target`",
    ),
    (
        "infinite_convergence_target",
        {"total_iterations": None, "convergence_target": float("inf")},
        "invalid_command",
        "at `$.spec.convergence_target`",
    ),
    ("user_trailing_newline", {"user": "alice\n"}, "invalid_command", "at `$.spec.user`"),
    ("ansi_name", {"name": "\x1b[2J\nFAKE"}, "invalid_spec", "name must not contain control characters"),
]


async def log_fingerprint(bus: Bus, service: AdmissionService) -> tuple[int, str]:
    return await bus.last_seq(), st.digest(service.projection.state)


@pytest.mark.parametrize(("case", "override", "code", "fragment"), BAD_SPECS, ids=[c[0] for c in BAD_SPECS])
async def test_sdk_bad_spec_is_rejected_specifically_and_writes_nothing(
    bus: Bus, client: Client, service: AdmissionService, case: str, override: dict, code: str, fragment: str
) -> None:
    before = await log_fingerprint(bus, service)
    with pytest.raises(CommandError) as info:
        await client.submit({**GOOD, **override}, job_id=f"bad-{case}")
    assert info.value.code == code
    assert fragment in info.value.message
    assert info.value.errors, "every rejection lists its problems"
    assert await log_fingerprint(bus, service) == before


@pytest.mark.parametrize(
    ("case", "override", "code", "fragment"),
    [c for c in BAD_SPECS if c[0] != "beyond_nats_limit"],
    ids=[c[0] for c in BAD_SPECS if c[0] != "beyond_nats_limit"],
)
async def test_cli_bad_spec_file_is_rejected_specifically_and_writes_nothing(
    bus: Bus,
    service: AdmissionService,
    run_cli: RunCli,
    tmp_path: Path,
    case: str,
    override: dict,
    code: str,
    fragment: str,
) -> None:
    job_file = tmp_path / f"{case}.json"
    job_file.write_text(json.dumps({**GOOD, **override, "job_id": f"cli-{case}"}))
    before = await log_fingerprint(bus, service)
    rc, out, err = await run_cli("submit", str(job_file))
    assert rc == 1, (out, err)
    assert out == ""
    assert err.startswith(f"shoal: rejected ({code}): ")
    assert fragment in err
    assert len(err.strip().splitlines()) == 1, "one line, no traceback"
    assert await log_fingerprint(bus, service) == before


async def test_cli_flags_bad_values(bus: Bus, service: AdmissionService, run_cli: RunCli) -> None:
    before = await log_fingerprint(bus, service)
    rc, _, err = await run_cli("submit", "--user", "alice", "--min-gpus", "0")
    assert rc == 1 and "Expected `int` >= 1 - at `$.spec.min_gpus`" in err
    rc, _, err = await run_cli("submit", "--user", "alice", "--min-gpus", "3", "--max-gpus", "2")
    assert rc == 1 and "min_gpus (3) is greater than max_gpus (2)" in err
    rc, _, err = await run_cli("submit", "--user", "alice", "--max-gpus", "eight")
    assert rc == 2 and "argument --max-gpus: invalid int value: 'eight'" in err
    rc, _, err = await run_cli("submit", "--user", "alice", "--gpu-type", "K80", "--iterations", "5")
    assert rc == 1 and "rejected (invalid_spec): unknown gpu_type 'K80'" in err
    rc, _, err = await run_cli("submit", "--user", "nobody", "--iterations", "5")
    assert rc == 1 and "rejected (unknown_user): user 'nobody' is not registered" in err
    assert await log_fingerprint(bus, service) == before


async def test_cli_unreadable_job_files(
    bus: Bus, service: AdmissionService, run_cli: RunCli, tmp_path: Path
) -> None:
    before = await log_fingerprint(bus, service)
    rc, _, err = await run_cli("submit", str(tmp_path / "missing.yaml"))
    assert rc == 2 and "cannot read job file" in err and "No such file or directory" in err
    broken = tmp_path / "broken.yaml"
    broken.write_text("user: alice\nmax_gpus: [1, 2\n")
    rc, _, err = await run_cli("submit", str(broken))
    assert rc == 2 and "is not valid YAML or JSON" in err and "line" in err
    listy = tmp_path / "list.yaml"
    listy.write_text("- user: alice\n")
    rc, _, err = await run_cli("submit", str(listy))
    assert rc == 2 and "must hold a mapping of job spec fields, not list" in err
    rc, _, err = await run_cli("submit")
    assert rc == 2 and "nothing to submit" in err
    assert await log_fingerprint(bus, service) == before


async def test_a_job_id_with_a_trailing_newline_is_refused_and_writes_nothing(
    bus: Bus, client: Client, service: AdmissionService
) -> None:
    """The SDK refuses it before sending; admission refuses it when it arrives anyway (a
    raw request, as another client sends it); the subject-token check the auth callout
    uses refuses it too (``$`` alone matches before a final newline)."""
    from shoal.ids import is_subject_token

    before = await log_fingerprint(bus, service)
    with pytest.raises(CommandError) as info:
        await client.submit(GOOD, job_id="j1\n")
    assert info.value.code == "invalid_job_id" and info.value.errors
    raw = {"type": "cmd.submit_job", "job_id": "j1\n", "spec": GOOD}
    reply = await bus.nc.request(
        f"{bus.names.prefix}.cmd.submit_job.@admin",
        json.dumps(raw).encode(),
        timeout=5,
        headers={"Content-Type": "application/json"},
    )
    answer = json.loads(reply.data)
    assert answer["type"] == "reply.rejected" and answer["errors"], answer
    assert "job_id" in answer["message"], answer
    assert not is_subject_token("j1\n") and is_subject_token("j1")
    assert await log_fingerprint(bus, service) == before


async def test_duplicate_submission_is_idempotent(
    bus: Bus, client: Client, service: AdmissionService, run_cli: RunCli, tmp_path: Path
) -> None:
    first = await client.submit_command(GOOD, job_id="dup-1")
    assert first.id == "dup-1" and not first.duplicate
    seq = await bus.last_seq()
    again = await client.submit_command(ev.JobSpec(**GOOD), job_id="dup-1")
    assert again.id == "dup-1" and again.duplicate
    job_file = tmp_path / "dup.yaml"
    job_file.write_text("job_id: dup-1\n" + "".join(f"{k}: {v}\n" for k, v in GOOD.items()))
    rc, out, err = await run_cli("submit", str(job_file))
    assert rc == 0 and out.strip() == "dup-1" and "already submitted" in err
    assert await bus.last_seq() == seq, "a duplicate adds nothing to the log"
    submitted = [e.event.job_id async for _, e in bus.replay() if isinstance(e.event, ev.JobSubmitted)]
    assert submitted == ["dup-1"]
    # The same id with a different spec is refused, not silently merged.
    with pytest.raises(CommandError) as info:
        await client.submit({**GOOD, "max_gpus": 4}, job_id="dup-1")
    assert info.value.code == "job_exists"
    assert await bus.last_seq() == seq


async def test_cancel_unknown_job_is_a_clear_error(
    bus: Bus, client: Client, service: AdmissionService, run_cli: RunCli
) -> None:
    seq = await bus.last_seq()
    with pytest.raises(CommandError) as info:
        await client.cancel("nope")
    assert info.value.code == "unknown_job" and info.value.message == "no job 'nope'"
    rc, out, err = await run_cli("cancel", "nope")
    assert (rc, out, err) == (1, "", "shoal: rejected (unknown_job): no job 'nope'\n")
    rc, _, err = await run_cli("cancel", "bad.id")
    assert rc == 1 and "rejected (invalid_job_id): invalid job id 'bad.id'" in err
    rc, _, err = await run_cli("status", "nope")
    # This installation runs admission without its query endpoint: the CLI says it replayed.
    assert rc == 1 and err.endswith("shoal: no job 'nope'\n"), err
    assert await bus.last_seq() == seq


async def test_bad_tickets(bus: Bus, client: Client, service: AdmissionService, run_cli: RunCli) -> None:
    seq = await bus.last_seq()
    rc, _, err = await run_cli("tickets", "alice", "-5")
    assert rc == 1 and "rejected (invalid_command): Expected `int` >= 0 - at `$.tickets`" in err
    with pytest.raises(CommandError) as info:
        await client.set_tickets("al.ice", 10)
    assert info.value.code == "invalid_command" and "`$.user`" in info.value.message
    assert await bus.last_seq() == seq


async def test_sdk_jobspec_objects_are_checked_by_admission_too(
    bus: Bus, client: Client, service: AdmissionService
) -> None:
    # A JobSpec built in Python is not validated on construction; admission still is the judge.
    before = await log_fingerprint(bus, service)
    with pytest.raises(CommandError) as info:
        await client.submit(ev.JobSpec(user="alice", min_gpus=0, total_iterations=10))
    assert info.value.code == "invalid_command" and "`$.spec.min_gpus`" in info.value.message
    with pytest.raises(CommandError) as info:
        await client.submit(ev.JobSpec(user="alice", min_gpus=3, max_gpus=2, requested_gpus=2))
    assert info.value.code == "invalid_spec"
    with pytest.raises(CommandError) as info:
        await client.submit("not a spec")  # type: ignore[arg-type]
    assert info.value.code == "invalid_spec" and "must be a mapping" in info.value.message
    assert await log_fingerprint(bus, service) == before


BILLION_LAUGHS = (
    'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    + "".join(f"{n}: &{n} [{','.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi", strict=True))
    + "user: alice\ntotal_iterations: 5\nenv: *i\n"
)


HOSTILE = [
    ("billion_laughs", BILLION_LAUGHS, "anchors and aliases (&name, *name) are not allowed"),
    ("deep", "user: alice\nname: " + "[" * 5000 + "]" * 5000 + "\n", "nested more than 32 levels deep"),
    (
        "int64_overflow",
        "user: alice\ntotal_iterations: " + "9" * 30 + "\n",
        "'total_iterations' is out of range",
    ),
    ("huge_int", "user: alice\npriority: " + "9" * 5000 + "\n", "holds a value that cannot be read"),
    ("over_1mib", "user: alice\n#" + "x" * (1024 * 1024) + "\n", "is larger than 1048576 bytes"),
    ("nul_byte", "user: alice\x00\n", "unacceptable character #x0000"),
]


@pytest.mark.parametrize(
    ("case", "text", "fragment"),
    HOSTILE,
    # Named by case: a megabyte of text in the test's id would reach the CLI's environment
    # (PYTEST_CURRENT_TEST) and exceed the kernel's limit on one variable.
    ids=[case for case, _, _ in HOSTILE],
)
async def test_cli_hostile_job_files_exit_2_without_traceback(
    bus: Bus, service: AdmissionService, run_cli: RunCli, tmp_path: Path, case: str, text: str, fragment: str
) -> None:
    assert case != "billion_laughs" or len(BILLION_LAUGHS) < 600
    job_file = tmp_path / f"{case}.yaml"
    job_file.write_text(text)
    before = await log_fingerprint(bus, service)
    rc, out, err = await run_cli("submit", str(job_file))
    assert rc == 2, (out, err[-500:])
    assert out == ""
    assert err.startswith("shoal: ") and fragment in err, err[-500:]
    assert len(err.strip().splitlines()) == 1, "one line, no traceback"
    assert await log_fingerprint(bus, service) == before


async def test_cli_flag_beyond_64_bits_exits_2(bus: Bus, service: AdmissionService, run_cli: RunCli) -> None:
    before = await log_fingerprint(bus, service)
    rc, out, err = await run_cli("submit", "--user", "alice", "--iterations", "5", "--priority", "9" * 25)
    assert rc == 2 and out == "" and "'priority' is out of range" in err, err[-500:]
    assert len(err.strip().splitlines()) == 1
    assert await log_fingerprint(bus, service) == before


async def test_cli_escapes_control_characters_from_the_log(
    bus: Bus, service: AdmissionService, run_cli: RunCli
) -> None:
    """A name with escapes (admission refuses them now; an older log may hold one) is
    printed escaped: no screen clearing, no extra table rows; --json stays parseable."""
    hostile = "\x1b[2J\x1b[HFAKE\nevil  bob  running"
    await bus.publish(_submitted_with_name("old-1", hostile))
    await service.projection.wait_for(await bus.last_seq())
    rc, out, err = await run_cli("jobs")
    assert rc == 0, err
    assert "\x1b" not in out and "\\x1b[2J" in out
    assert len(out.strip().splitlines()) == 2, out  # header and one row
    rc, out, err = await run_cli("status", "old-1")
    assert rc == 0 and "\x1b" not in out and "\\n" in out, out
    rc, out, err = await run_cli("jobs", "--json")
    assert rc == 0 and json.loads(out)[0]["name"] == hostile
    # Invisible and direction-changing characters: a right-to-left override would show
    # "old-2 gpj.exe" reversed, a zero-width space would hide in a name.
    await bus.publish(_submitted_with_name("old-2", "safe\u202eexe.jpg\u200b"))
    await service.projection.wait_for(await bus.last_seq())
    rc, out, err = await run_cli("status", "old-2")
    assert rc == 0 and "\u202e" not in out and "\u200b" not in out, out
    assert "safe\\u202eexe.jpg\\u200b" in out, out


def _submitted_with_name(job_id: str, name: str) -> Any:
    """A ``JobSubmitted`` envelope whose name admission would refuse today."""
    from shoal import codec

    spec = ev.JobSpec(user="alice", total_iterations=5, name=name)
    return codec.wrap(ev.JobSubmitted(job_id=job_id, spec=spec))
