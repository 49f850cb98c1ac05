"""``shoal simulate`` and ``shoal compare``: outputs and errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from shoal.cli import main
from shoal.sim.engine import SimConfig, Simulator, make_policy
from shoal.workloads import load_workload

TINY = ["--trace", "philly:2869ce:25"]


def test_simulate_writes_results_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["simulate", *TINY, "--policy", "fifo", "--gpus", "16", "--seed", "3", "--output", str(tmp_path)]
    )
    assert code == 0
    out = capsys.readouterr()
    assert "average JCT" in out.out and "fifo on philly:2869ce:25" in out.out
    assert "25/25 jobs" in out.err  # the progress bar
    doc = json.loads((tmp_path / "results.json").read_text())
    summary = doc["summary"]
    for key in ("avg_jct_s", "median_jct_s", "p99_jct_s", "makespan_s", "reconfigurations"):
        assert isinstance(summary[key], float)
    assert summary["completed"] == 25
    jcts = [j["jct_s"] for j in doc["jobs"]]
    assert summary["avg_jct_s"] == pytest.approx(sum(jcts) / len(jcts))
    series = doc["series"]
    assert len(series["t"]) == len(series["ql"]) == len(series["ce"]) == len(series["bi"]) > 1
    assert series["t"] == sorted(series["t"])
    assert doc["seed"] == 3 and doc["config"]["total_gpus"] == 16
    assert doc["policy"] == "fifo" and doc["trace"] == "philly:2869ce:25"


def test_simulate_keeps_no_envelopes_and_decides_as_a_retained_log(tmp_path: Path) -> None:
    code = main(["simulate", *TINY, "--policy", "afs-p", "--quiet", "--output", str(tmp_path)])
    assert code == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["config"]["retain_log"] is False
    sim = Simulator(load_workload(TINY[1], seed=0), make_policy("afs-p"), SimConfig(retain_log=True))
    kept = sim.run()
    assert len(sim.log.envelopes) == kept.summary["events"] > 0
    assert doc["final_digest"] == kept.final_digest
    assert doc["event_counts"] == dict(kept.event_counts)
    assert doc["summary"]["avg_jct_s"] == kept.summary["avg_jct_s"]


def test_simulate_heterogeneous_with_tickets(tmp_path: Path) -> None:
    code = main(
        [
            "simulate",
            "--trace",
            "poisson:n=20,rate=30,users=2,catalog=gavel,mean_duration_s=600",
            "--policy",
            "gandiva-fair",
            "--cluster",
            "8xk80,8xv100",
            "--tickets",
            "user-0=100,user-1=300",
            "--quiet",
            "--output",
            str(tmp_path),
        ]
    )
    assert code == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["summary"]["completed"] == 20
    assert set(doc["user_shares"]["gpu_s"]) == {"user-0", "user-1"}
    assert doc["config"]["users"] == {"user-0": 100, "user-1": 300}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policy", "no-such-policy", *TINY], "unknown policy 'no-such-policy'"),
        (["--policy", "fifo", "--trace", "philly:abcdef"], "unknown Philly VC 'abcdef'"),
        (["--policy", "fifo", "--trace", "nope:1"], "unknown workload kind"),
        (["--policy", "fifo", *TINY, "--gpus", "10"], "do not split into servers of 4"),
        (["--policy", "fifo", *TINY, "--gpus", "8", "--nodes", "4"], "disagrees with --nodes"),
        (["--policy", "fifo", *TINY, "--cluster", "4xk80,0xv100"], "--cluster"),
        (["--policy", "fifo", *TINY, "--cluster", "4xk80", "--gpus", "4"], "do not combine"),
        (["--policy", "fifo", *TINY, "--costs", "cheap"], "--costs"),
        (["--policy", "fifo", *TINY, "--policy-param", "oops"], "K=V"),
        (["--policy", "fifo", *TINY, "--tickets", "alice=lots"], "--tickets"),
        (["--policy", "fifo", *TINY, "--policy-param", "bogus=1"], "--policy fifo"),
        (["--policy", "gandiva-fair", *TINY, "--costs", "measured"], "--policy-param costs=measured"),
        (["--policy", "gandiva-fair", *TINY, "--policy-param", "costs=cheap"], "--policy gandiva-fair"),
    ],
)
def test_simulate_bad_input(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *argv, "--quiet"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("gpus", ["0", "-8", "many"])
def test_simulate_rejects_bad_gpu_counts(gpus: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--policy", "fifo", *TINY, "--gpus", gpus])
    assert exc.value.code == 2
    assert "--gpus" in capsys.readouterr().err


def test_console_script_exit_status_and_message() -> None:
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("shoal")), "simulate", "--policy", "nope", *TINY, "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("shoal: unknown policy 'nope'")
    assert "Traceback" not in proc.stderr


def test_compare_writes_report_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cmp"
    poisson = "poisson:n=20,rate=20,mean_duration_s=900"
    code = main(
        [
            "compare",
            "--traces",
            f"philly:2869ce:20,{poisson}",
            "--policies",
            "fifo,max-min",
            "--baseline",
            "fifo",
            "--gpus",
            "16",
            "--workers",
            "2",
            "--output",
            str(out),
        ]
    )
    assert code == 0
    report = (out / "report.md").read_text()
    assert "| philly:2869ce:20 |" in report and "JCT reduction relative to fifo" in report
    cells = json.loads((out / "results.json").read_text())
    assert [(c["spec"]["trace"], c["spec"]["policy"]) for c in cells] == [
        ("philly:2869ce:20", "fifo"),
        ("philly:2869ce:20", "max-min"),
        (poisson, "fifo"),
        (poisson, "max-min"),
    ]
    assert all(c["ok"] and c["summary"]["completed"] == 20 for c in cells)
    # The reduction column is the ratio of the two averages in the same run.
    by = {(c["spec"]["trace"], c["spec"]["policy"]): c["summary"]["avg_jct_s"] for c in cells}
    ratio = by[("philly:2869ce:20", "fifo")] / by[("philly:2869ce:20", "max-min")]
    assert f"| philly:2869ce:20 | {ratio:.2f}× |" in report
    for name in (
        "jct_reduction.png",
        "jct_cdf_philly_2869ce_20.png",
        "metrics_poisson_n_20_rate_20_mean_duration_s_900.png",
    ):
        assert (out / name).stat().st_size > 1000


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policies", "fifo,nope"], "unknown policies nope"),
        (["--policies", "fifo", "--baseline", "afs-p"], "--baseline afs-p is not one of"),
        (["--policies", "fifo", "--seeds", "a,b"], "--seeds"),
        (["--policies", "fifo,gandiva-fair", "--costs", "coddl"], "--policy-param costs=coddl"),
    ],
)
def test_compare_bad_input(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["compare", "--traces", "philly:2869ce:5", *argv, "--output", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_trace_lists_keep_comma_separated_parameters() -> None:
    from shoal.commands.compare import split_traces

    assert split_traces(["philly:2869ce,poisson:n=5,rate=2", "pollux:workloads:1:duration_s=60"]) == [
        "philly:2869ce",
        "poisson:n=5,rate=2",
        "pollux:workloads:1:duration_s=60",
    ]


def test_simulate_start_up_loads_only_what_it_runs() -> None:
    """``shoal simulate --limit 1`` imports no other command, no logging stack and no
    numpy (AFS-P needs it only for long queues), and parses only the VC asked for."""
    code = (
        "import sys\n"
        "from shoal.cli import main\n"
        "import shoal.workloads as w\n"
        "assert main(['simulate', '--trace', 'philly:2869ce', '--policy', 'afs-p', '--limit', '1', '--quiet']) == 0\n"
        "loaded = sorted(m for m in ('structlog', 'rich', 'asyncio', 'nats', 'numpy', 'shoal.commands.up')"
        " if m in sys.modules)\n"
        "assert not loaded, loaded\n"
        "assert w.philly_rows.cache_info().currsize == 0, 'parsed every VC'\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")


def test_limit_builds_the_same_first_jobs() -> None:
    from shoal.workloads import load_workload

    whole = load_workload("philly:e13805", seed=2)
    assert load_workload("philly:e13805", seed=2, limit=7) == whole[:7]
    assert load_workload("philly:e13805:5", seed=2, limit=7) == whole[:5]
    assert (
        load_workload("poisson:n=10,rate=20", seed=1, limit=3)
        == load_workload("poisson:n=10,rate=20", seed=1)[:3]
    )
