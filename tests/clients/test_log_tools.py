"""`shoal explain`, `shoal replay` and `shoal top` as real processes against a log on
a real nats-server: the CLI shows what the pure functions compute, and top follows
the live stream."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest
from shoal import codec, explain
from shoal import events as ev
from shoal import state as st
from shoal.bus import Bus

from tests.clients.conftest import RunCli
from tests.clients.story import T0, items, story

pytestmark = pytest.mark.integration


@pytest.fixture
async def logged(bus: Bus) -> Bus:
    await bus.publish_many(story())
    return bus


async def test_explain_cli(logged: Bus, run_cli: RunCli) -> None:
    logged_items = [x async for x in logged.replay()]
    assert [env.type for _, env in logged_items] == [env.type for _, env in items()]
    expected = explain.explain_job("j1", logged_items)
    rc, out, err = await run_cli("explain", "j1")
    assert rc == 0, err
    assert out == explain.render_explanation(expected) + "\n"
    assert "because: job.completed j2 [seq 14]" in out
    rc, out, _ = await run_cli("explain", "j1", "--json")
    assert json.loads(out) == json.loads(codec.to_json(expected))
    rc, out, err = await run_cli("explain", "ghost")
    assert (rc, out, err) == (1, "", "shoal: no job 'ghost' in the log\n")
    rc, _, err = await run_cli("explain", "j1", "--catalog", "nope")
    assert rc == 2 and "nope" in err


async def test_replay_cli(logged: Bus, run_cli: RunCli) -> None:
    rc, out, err = await run_cli("replay", "--until", "seq:12", "--json")
    assert rc == 0, err
    summary = json.loads(out)
    assert summary["digest"] == st.digest(st.fold(story()[:12]))
    assert summary["shares"] == {"j1": 2, "j2": 2} and summary["seq"] == 12 and summary["more_events_after"]
    iso = explain.iso(T0 + 55)
    rc, out, _ = await run_cli("replay", "--until", iso)
    assert rc == 0 and out.startswith(f"cluster as of {explain.iso(T0 + 50)} (seq 15, 15 events")
    assert "completed (1)" in out and "running (1)" in out
    # Relative to the newest event (t0+100): 45 s before is t0+55, the same moment.
    rc, ago, _ = await run_cli("replay", "--ago", "45s")
    rc2, until, _ = await run_cli("replay", "--until=-45s")
    assert rc == rc2 == 0 and ago == until == out
    rc, out, _ = await run_cli("replay", "--json")
    assert json.loads(out)["digest"] == st.digest(st.fold(story()))
    rc, _, err = await run_cli("replay", "--until", "last tuesday")
    assert rc == 2 and "invalid --until 'last tuesday'" in err


async def test_top_once_and_live(logged: Bus, run_cli: RunCli, cli_env: dict[str, str]) -> None:
    # A terminal wide enough for the header whatever the test's prefix (Rich reads COLUMNS).
    cli_env = {**cli_env, "COLUMNS": "200"}
    rc, out, err = await run_cli("top", "--once", env=cli_env)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("shoal top · ") and "seq 17 · epoch 4 (afs-l)" in lines[0]
    assert lines[1] == "GPUs 0/4 allocated, 4 free · utilisation 0% · jobs 0 running, 0 pending, 2 finished"
    assert any(line.split()[:3] == ["j1", "alice", "completed"] for line in lines)
    assert any("epoch 3" in line and "completion" in line and "j1 2→4" in line for line in lines)

    # Live: frames follow the stream (stdout is a pipe, so frames come one after another).
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import sys; from shoal.cli import main; sys.exit(main())",
        "top",
        "--interval",
        "0.05",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=cli_env,
    )
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(60):
            while b"seq 17" not in await proc.stdout.readline():
                pass
            await logged.publish_many(
                [
                    ev.JobSubmitted(
                        job_id="late", spec=ev.JobSpec(user="carol", max_gpus=2, total_iterations=10)
                    ),
                    ev.SharesDecided(epoch=5, shares={"late": 2}, policy="afs-l", trigger="arrival"),
                ]
            )
            seen = b""
            while b"late 0\xe2\x86\x922" not in seen:
                line = await proc.stdout.readline()
                assert line, "top exited"
                seen += line
    finally:
        proc.terminate()
        await proc.wait()
