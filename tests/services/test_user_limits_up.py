"""Per-user quotas through the shipped commands: `shoal up` started with the
installation's defaults as ``SHOAL_*`` settings, the admin's `shoal limits`, a user's
`shoal submit` with that user's own credentials (`shoal creds add user`), and
`shoal users`. Every step is a CLI process against a real `shoal up`."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from shoal.commands.run import CLI_ARGV as CLI

from tests.services.test_liveness import shoal_up

pytestmark = pytest.mark.integration


def _cli(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *argv], env=env, capture_output=True, text=True, timeout=60)


def _submit(
    env: dict[str, str], name: str, min_gpus: int = 1, user: str | None = "alice"
) -> subprocess.CompletedProcess[str]:
    # Long enough to stay active for the whole test (time scale 20).
    return _cli(
        env,
        "submit",
        *(("--user", user) if user else ()),
        "--name",
        name,
        "--min-gpus",
        str(min_gpus),
        "--max-gpus",
        "2",
        "--requested-gpus",
        str(min_gpus),
        "--iterations",
        "100000000",
    )


async def test_an_admin_sets_a_users_quota_and_admission_holds_the_user_to_it(tmp_path: Path) -> None:
    settings = {
        "SHOAL_MAX_ACTIVE_JOBS_PER_USER": "2",
        "SHOAL_REGISTERED_USERS_ONLY": "true",
    }
    async with shoal_up(tmp_path, nodes=1, **settings):
        base = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_"))}
        admin = {**base, "SHOAL_STATE_DIR": str(tmp_path / "state")}
        added = _cli(admin, "creds", "add", "user", "alice")
        assert added.returncode == 0, added.stderr
        alice = {**admin, "NATS_CREDS": added.stdout.split()[0]}

        # Not registered yet: refused with the code and a way out. (No --user: the job is
        # the authenticated user's, not the login name's.)
        first = _submit(alice, "a0", user=None)
        assert first.returncode == 1, (first.stdout, first.stderr)
        assert "unknown_user" in first.stdout + first.stderr
        assert "shoal limits alice" in first.stdout + first.stderr

        # A user may not set its own quota; the admin may.
        own = _cli(alice, "limits", "alice", "--max-jobs", "100")
        assert own.returncode != 0
        assert "forbidden" in own.stdout + own.stderr
        bare = _cli(admin, "limits", "alice")
        assert bare.returncode == 2 and "--max-jobs" in bare.stderr
        registered = _cli(admin, "limits", "alice", "--max-jobs", "0")
        assert registered.returncode == 0, registered.stderr
        assert _cli(admin, "limits", "alice", "--max-jobs", "0").stdout.startswith("user alice already has")

        # 0: the installation's default (SHOAL_MAX_ACTIVE_JOBS_PER_USER=2) applies.
        for name in ("a1", "a2"):
            ok = _submit(alice, name)
            assert ok.returncode == 0, (ok.stdout, ok.stderr)
        over = _submit(alice, "a3")
        assert over.returncode == 1 and "limit_exceeded" in over.stdout + over.stderr
        assert "limit 2" in over.stdout + over.stderr

        # The user's own limits replace the default; a limit not given keeps its value.
        assert _cli(admin, "limits", "alice", "--max-jobs", "3", "--max-gpus", "3").returncode == 0
        third = _submit(alice, "a3")
        assert third.returncode == 0, (third.stdout, third.stderr)
        assert _submit(alice, "a4").returncode == 1  # 3 active jobs
        assert _cli(admin, "limits", "alice", "--max-jobs", "10").returncode == 0
        wide = _submit(alice, "a4", min_gpus=2)  # 3 + 2 guaranteed GPUs > 3
        assert wide.returncode == 1 and "guaranteed GPUs (limit 3)" in wide.stdout + wide.stderr

        listed = _cli(alice, "users", "--json")  # any identity may read it, as the log
        assert listed.returncode == 0, listed.stderr
        rows = {r["user"]: r for r in json.loads(listed.stdout)}
        assert rows["alice"] | {"gpus": 0, "tickets": 0} == {
            "user": "alice",
            "tickets": 0,
            "registered": True,
            "max_active_jobs": 10,
            "max_gpus": 3,
            "active_jobs": 3,
            "guaranteed_gpus": 3,
            "gpus": 0,
        }
        table = _cli(admin, "users")
        assert table.returncode == 0 and "3/10" in table.stdout and "3/3" in table.stdout, table.stdout
