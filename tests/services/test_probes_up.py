"""Health, readiness and metrics of every process `shoal up` starts, scraped over HTTP
as a supervisor, Kubernetes or Prometheus would: after a job ran the numbers say so,
AFS §2.2's QL, CE and BI follow a live queue at the installation's (scaled) clock, an
outsider on another address cannot reach them, and a service whose NATS server stops
answering is alive but not ready until it answers again."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from shoal import events as ev
from shoal.client import Client
from shoal.commands.run import CLI_ARGV as CLI

from tests.services.test_up import run_job, usable_policy, wait_line

pytestmark = pytest.mark.integration


OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy for 127.0.0.1


def get(url: str) -> tuple[int, str]:
    try:
        with OPENER.open(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_status(url: str, status: int, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    seen: tuple[int, str] = (0, "")
    while time.monotonic() < deadline:
        try:
            seen = get(url)
        except OSError as exc:  # a restarting child: nothing listens for a moment
            seen = (0, repr(exc))
        if seen[0] == status:
            return seen[1]
        time.sleep(0.2)
    raise AssertionError(f"{url}: wanted {status}, last got {seen}")


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(m: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    assert name in m, f"{name} missing; have {sorted(m)}"
    return sum(v for _, v in m[name])


def scrape(url: str) -> tuple[float, float, dict[str, list[tuple[dict[str, str], float]]]]:
    """One ``/metrics`` scrape with the wall times just before and just after it."""
    before = time.time()
    text = get(url)[1]
    return before, time.time(), samples(text)


def wait_scrape(
    url: str, ok: Callable[[dict[str, list[tuple[dict[str, str], float]]]], bool], timeout_s: float
) -> tuple[float, float, dict[str, list[tuple[dict[str, str], float]]]]:
    deadline = time.monotonic() + timeout_s
    while True:
        got = scrape(url)
        if ok(got[2]):
            return got
        assert time.monotonic() < deadline, f"{url}: condition not met; last scrape {got[2]}"
        time.sleep(0.2)


async def queue_two_jobs(url: str, creds: str, iterations: int) -> list[str]:
    """Two rigid jobs of all 4 GPUs, so one waits while the other runs."""
    async with await Client.connect(url, "shoal", creds=creds) as client:
        spec = ev.JobSpec(
            user="alice",
            min_gpus=4,
            max_gpus=4,
            requested_gpus=4,
            elastic=False,
            total_iterations=iterations,
        )
        return [await client.submit(spec, job_id=f"queued-{i}") for i in (1, 2)]


async def cancel(url: str, creds: str, job_ids: list[str]) -> None:
    async with await Client.connect(url, "shoal", creds=creds) as client:
        for job_id in job_ids:
            await client.cancel(job_id, "test over")


def other_address() -> str | None:
    """An address of this machine that is not loopback (None: there is none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent; this picks the outgoing address
        except OSError:
            return None
        addr = str(s.getsockname()[0])
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def test_probes_of_every_service(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_"))}
    env["SHOAL_STATE_DIR"] = str(tmp_path / "state")
    argv = [*CLI, "up", "--nodes", "2", "--gpus-per-node", "2", "--time-scale", "20"]
    proc = subprocess.Popen(
        [*argv, "--policy", usable_policy()],
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "up.err").open("w"),
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        url = wait_line(proc, "NATS: ", 30).split(" ", 1)[1].strip()
        services = wait_line(proc, "services: ", 30).split(":", 1)[1].strip().split(", ")
        probes: dict[str, str] = {}
        for _ in services:
            _, name, base, *_ = wait_line(proc, "probes: ", 30).split()
            probes[name] = base
        assert set(probes) == set(services)
        assert all(u.startswith("http://127.0.0.1:") for u in probes.values()), probes
        wait_line(proc, "running", 30)
        info = json.loads((tmp_path / "state" / "up.json").read_text())
        assert info["metrics"] == probes

        for base in probes.values():
            assert wait_status(base + "/healthz", 200, 30) == "ok\n"  # the child has started
            body = wait_status(base + "/readyz", 200, 30)
            assert body.startswith("ready\n"), body

        admin = tmp_path / "state" / "creds" / "admin.nk"
        asyncio.run(run_job(url, str(admin)))

        texts = {name: get(base + "/metrics")[1] for name, base in probes.items()}
        # declared everywhere; emulated trainers report no phases (real ones do: shoal.train)
        assert all("# HELP shoal_reconfiguration_phase_seconds " in t for t in texts.values())
        scraped = {name: samples(text) for name, text in texts.items()}
        alloc = scraped["allocator"]
        assert value(alloc, "shoal_leader") == 1
        assert value(alloc, "shoal_allocator_decisions_total") > 0
        assert value(alloc, "shoal_allocator_decision_seconds_count") > 0
        # The authorizer admitted the job's sidecars and, their job placed, revoked none.
        auth = scraped["authorizer"]
        allowed = [
            v for labels, v in auth["shoal_authorizer_decisions_total"] if labels["outcome"] == "allowed"
        ]
        assert sum(allowed) >= 1, auth["shoal_authorizer_decisions_total"]
        assert value(auth, "shoal_authorizer_revocations_total") == 0
        for name, m in scraped.items():
            assert value(m, "shoal_ready") == 1, name
            assert value(m, "shoal_epoch") >= 1, name
            assert value(m, "shoal_gpus_total") == 4, name
            assert value(m, "shoal_jobs_active") == 0 and value(m, "shoal_jobs_pending") == 0, name
            assert 0 <= value(m, "shoal_gpu_allocation_ratio") <= 1, name
            assert 0 <= value(m, "shoal_gpu_utilization") <= 1, name
            if name.startswith("node-daemon"):  # each of its 2 GPUs as it last read it
                gpus = m["shoal_node_gpu_utilization"]
                assert sorted(lab["gpu"] for lab, _ in gpus) == ["0", "1"], gpus
                assert all(0 <= v <= 1 for _, v in gpus), gpus
            assert value(m, "shoal_bus_lag") >= 0, name
            assert value(m, "shoal_bus_applied_seq") > 0, name
            assert value(m, "shoal_dead_lettered_total") == 0, name
            assert value(m, "shoal_reconfiguration_seconds_count") >= 1, name
            if name in ("profiler", "placer", "trader"):
                assert value(m, "shoal_leader") == 1, name
            if name == "admission" or name.startswith("node-daemon"):
                assert "shoal_leader" not in m, name

        # AFS §2.2's QL, CE and BI of a live queue: one job holds all 4 GPUs, the other waits.
        # The waiting one has no throughput model (linear: 1 iteration/s on 1 GPU), so BI is
        # its time without GPUs / its iterations, at the installation's clock when scraped:
        # between two scrapes it grows by 20 (the time scale) x the wall time between them.
        iterations = 100_000  # far more than the running job does here (4 iterations/s)
        queued = asyncio.run(queue_two_jobs(url, str(admin), iterations))
        metrics = probes["allocator"] + "/metrics"

        def one_waits(m: dict[str, list[tuple[dict[str, str], float]]]) -> bool:
            return (
                value(m, "shoal_queue_length") == 1
                and value(m, "shoal_blocking_index") > 0
                and {lab["job_id"] for lab, _ in m.get("shoal_job_share", [])} < set(queued)
            )

        for _ in range(5):  # a new decision between the two scrapes: measure again
            a1, b1, first = wait_scrape(metrics, one_waits, 30)
            bi1 = value(first, "shoal_blocking_index")
            a2, b2, second = wait_scrape(
                metrics, lambda m, bi1=bi1: value(m, "shoal_blocking_index") != bi1, 30
            )
            if one_waits(second) and second["shoal_job_share"] == first["shoal_job_share"]:
                break
        else:
            pytest.fail("the shares kept changing")
        # All 4 GPUs to one job that scales linearly (emulated trainers; before the profiler's
        # model, the allocator's belief is linear too): thr(4) / thr(1) / 4 GPUs.
        assert value(first, "shoal_cluster_efficiency") == pytest.approx(1.0, abs=0.05)
        grown = (value(second, "shoal_blocking_index") - bi1) * iterations
        assert 20 * (a2 - b1) - 1e-3 <= grown <= 20 * (b2 - a1) + 1e-3, (grown, a1, b1, a2, b2)
        asyncio.run(cancel(url, str(admin), queued))
        wait_scrape(metrics, lambda m: value(m, "shoal_queue_length") == 0, 30)

        # An outsider on another address of this machine finds nothing listening.
        addr = other_address()
        if addr is not None:
            port = int(probes["allocator"].rsplit(":", 1)[1])
            with pytest.raises(OSError), socket.create_connection((addr, port), timeout=5):
                pass

        # The server stops answering: the services are alive, and not ready.
        server_pid = int(info["server_pid"])
        os.kill(server_pid, signal.SIGSTOP)
        try:
            body = wait_status(probes["allocator"] + "/readyz", 503, 15)
            assert "cannot read the log's tail" in body, body
            assert get(probes["allocator"] + "/healthz") == (200, "ok\n")
        finally:
            os.kill(server_pid, signal.SIGCONT)
        wait_status(probes["allocator"] + "/readyz", 200, 60)

        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
