"""The elastic trainer on real GPUs over NCCL; writes benchmarks/reports/gpu_nccl.md.

    python benchmarks/bench_gpu.py                 # on a machine with CUDA GPUs
    python benchmarks/bench_gpu.py --device cpu    # the same steps on CPU/gloo (a self-check)

``bench_reconfig.py`` measures CPU/gloo workers. This one runs the trainer sidecar's
controller with ``device="cuda"``: each worker gets one GPU through
``CUDA_VISIBLE_DEVICES`` and the process groups are NCCL. In one run:

* **start**: the digits CNN on one GPU, from the order to the first step (CUDA context,
  NCCL group, state restore);
* **stop and resume** (preemption): an order to no GPUs checkpoints and stops the job,
  the next order starts it again from that checkpoint; the step it resumes at is
  compared with the step it stopped at;
* **in-place resizes and checkpoint-restart** 1 → 2 → 1 when the machine has at least
  two GPUs (NCCL needs a GPU per rank, so one GPU cannot hold two ranks); otherwise the
  report says they were not run;
* **overhead without any resize**: steps/s of the transformer LM with plain
  DistributedDataParallel (torchrun), ``shoal.train`` under torchrun, and ``shoal.train``
  under the sidecar's controller, on ``min(2, GPUs)`` workers, interleaved repetitions.

Every number in the report comes from the one run that wrote it.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_reconfig import _gpus, _noop, _rate  # GPUs n0/0.., no-op emit, steps/s of an output
from edl_reproduction import _steps  # until the job made n more steps
from shoal import events as ev
from shoal.events import GpuRef
from shoal.train.config import TrainConfig
from shoal.train.controller import Controller, OrderError, ReconfigurationRecord

REPO = Path(__file__).resolve().parents[1]
CNN = REPO / "examples" / "cnn_digits.py"
LM = REPO / "examples" / "transformer_lm.py"
REPORT = REPO / "benchmarks" / "reports" / "gpu_nccl.md"


def _controller(workdir: Path, argv: list[str], device: str, slots: int, **kw: object) -> Controller:
    def index(g: GpuRef) -> int:
        if g.node_id != "n0" or not 0 <= g.index < slots:
            raise OrderError(f"unknown GPU {g}")
        return g.index

    return Controller(
        job_id="benchgpu",
        argv=argv,
        workdir=workdir,
        gpu_index=index,
        max_gpus=slots,
        emit=_noop,
        train=TrainConfig(
            device=device, collective_timeout_s=60, rendezvous_timeout_s=180, checkpoint_every=0
        ),
        report_every_s=0.2,
        **kw,  # type: ignore[arg-type]
    )


async def stop_and_resume(workdir: Path, device: str, slots: int) -> dict[str, float]:
    """Start on one GPU, train, stop (order to no GPUs), start again from the checkpoint."""
    ctl = _controller(workdir, [sys.executable, str(CNN), "--max-steps", "100000000"], device, slots)
    await ctl.start()
    try:
        await ctl.apply(ev.Reconfigure(job_id="benchgpu", epoch=1, gpus=_gpus(1)))
        await ctl.wait_idle(300)
        await _steps(ctl, 200)
        before = ctl.progress.step if ctl.progress else 0
        await ctl.apply(ev.Reconfigure(job_id="benchgpu", epoch=2, gpus=()))
        await ctl.wait_idle(300)
        ctl.progress = None
        await ctl.apply(ev.Reconfigure(job_id="benchgpu", epoch=3, gpus=_gpus(1)))
        await ctl.wait_idle(300)
        await _steps(ctl, 1)
        resumed = ctl.progress.step if ctl.progress else 0
        await _steps(ctl, 100)
        start, stop, restart = ctl.history
        rate_t0, rate_s0 = time.monotonic(), ctl.progress.step if ctl.progress else 0
        await _steps(ctl, 300)
        rate = ((ctl.progress.step if ctl.progress else 0) - rate_s0) / (time.monotonic() - rate_t0)
        for r in (start, stop, restart):
            if r.outcome != "completed":
                raise RuntimeError(f"{r.kind} ended {r.outcome}")
        return {
            "start_s": start.stop_time_s,
            "stop_s": stop.finished - stop.started,
            "resume_s": restart.stop_time_s,
            "step_before_stop": float(before),
            "step_resumed": float(resumed),
            "steps_per_s": rate,
        }
    finally:
        await ctl.close(checkpoint=False)


async def resize_sequence(
    workdir: Path, sizes: list[int], device: str, slots: int, *, restart_only: bool
) -> list[ReconfigurationRecord]:
    ctl = _controller(
        workdir,
        [sys.executable, str(CNN), "--max-steps", "100000000"],
        device,
        slots,
        restart_only=restart_only,
    )
    await ctl.start()
    try:
        for epoch, n in enumerate(sizes, start=1):
            await ctl.apply(ev.Reconfigure(job_id="benchgpu", epoch=epoch, gpus=_gpus(n)))
            await ctl.wait_idle(300)
            await _steps(ctl, 30)
            if ctl.progress is None or ctl.progress.world != n:
                raise RuntimeError(f"after the order for {n} workers the job runs on {ctl.progress}")
        return list(ctl.history)
    finally:
        await ctl.close(checkpoint=False)


def _torchrun(args: list[str], device: str, nproc: int) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_TRAIN_")}
    env["OMP_NUM_THREADS"] = "1"
    env["SHOAL_TRAIN_DEVICE"] = device
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(LM),
        *args,
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stderr[-3000:]}")
    return _rate(out.stdout)


async def _sidecar_rate(workdir: Path, args: list[str], device: str, nproc: int) -> float:
    ctl = _controller(workdir, [sys.executable, str(LM), *args], device, nproc)
    await ctl.start()
    try:
        await ctl.apply(ev.Reconfigure(job_id="benchgpu", epoch=1, gpus=_gpus(nproc)))
        await asyncio.wait_for(ctl.done.wait(), 600)
        await asyncio.sleep(0.5)
        logs = [f.read_text() for f in (workdir / "logs").glob("worker-*.log")]
        return max(_rate(t) for t in logs if "steps_per_s" in t)
    finally:
        await ctl.close(checkpoint=False)


async def overhead(workdir: Path, device: str, nproc: int, reps: int, steps: int) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {
        "plain DDP (torchrun)": [],
        "shoal.train (torchrun)": [],
        "shoal.train (sidecar)": [],
    }
    common = ["--max-steps", str(steps), "--time-after", str(steps // 10)]
    for r in range(reps):
        rates["plain DDP (torchrun)"].append(_torchrun([*common, "--plain-ddp"], device, nproc))
        rates["shoal.train (torchrun)"].append(_torchrun(common, device, nproc))
        rates["shoal.train (sidecar)"].append(await _sidecar_rate(workdir / f"lm{r}", common, device, nproc))
    return rates


def _environment(device: str) -> list[str]:
    lines = [f"* torch {torch.__version__}"]
    if device == "cuda":
        n = torch.cuda.device_count()
        names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        lines += [f"* CUDA {torch.version.cuda}, NCCL {nccl}", f"* {n} GPU(s): {', '.join(names)}"]
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        )
        if smi.returncode == 0:
            lines.append(f"* driver {smi.stdout.strip().splitlines()[0]}")
    lines.append(f"* {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    return lines


def _ms(s: float) -> str:
    return f"{s * 1000:.0f}"


def render(
    device: str,
    slots: int,
    resume: dict[str, float],
    inplace: list[ReconfigurationRecord],
    restart: list[ReconfigurationRecord],
    rates: dict[str, list[float]],
    nproc: int,
    elapsed_s: float,
    command: str,
) -> str:
    backend = "NCCL" if device == "cuda" else "gloo"
    unit = "GPU" if device == "cuda" else "CPU slot"
    lines = [
        f"# The elastic trainer on {'GPUs' if device == 'cuda' else 'CPU (self-check)'} ({backend})",
        "",
        f"Generated by `{command}` on {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC; the run took "
        f"{elapsed_s:.0f} s. Every number below comes from this one run.",
        "",
        *_environment(device),
        "",
        "## Start, stop and resume on one " + unit,
        "",
        "The digits CNN (`examples/cnn_digits.py`, global batch 64) under the sidecar's controller. "
        "`start` runs from the order to the first step (worker start, CUDA context, process group, "
        "state). An order to no GPUs checkpoints and stops the job (`stop`); the next order starts "
        "it again from that checkpoint (`resume`, order to first step).",
        "",
        "| start (ms) | stop with checkpoint (ms) | resume (ms) | last step seen before the stop | "
        "first step seen after resuming | steps/s after resuming |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {_ms(resume['start_s'])} | {_ms(resume['stop_s'])} | {_ms(resume['resume_s'])} | "
        f"{resume['step_before_stop']:.0f} | {resume['step_resumed']:.0f} | {resume['steps_per_s']:.0f} |",
        "",
        "The sidecar hears of a step every 0.2 s, so the last step seen before the stop is at most "
        "that much behind the checkpointed one. "
        + (
            "Resumed at or after it: no step lost."
            if resume["step_resumed"] >= resume["step_before_stop"]
            else "**Resumed before the last step seen: steps were lost.**"
        ),
        "",
        "## In-place resizes and checkpoint-restart",
        "",
    ]
    if not inplace:
        lines.append(
            f"Not run: this machine has {slots} {unit}(s). NCCL needs one GPU per rank, so a resize "
            "from 1 to 2 workers needs at least two GPUs."
        )
    else:
        lines += [
            "| resize | in-place kind | stop time (ms) | GPU-time lost (s) | prepare (s) | "
            "checkpoint-restart stop time (ms) | GPU-time lost (s) |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for a, b in zip(inplace[1:], restart[1:], strict=False):
            lines.append(
                f"| {a.from_world} → {a.to_world} | {a.kind} | {_ms(a.stop_time_s)} | {a.gpu_time_lost_s:.2f} | "
                f"{a.phases.get('prepare', 0.0):.2f} | {_ms(b.stop_time_s)} | {b.gpu_time_lost_s:.2f} |"
            )
    base = statistics.median(rates["plain DDP (torchrun)"])
    lines += [
        "",
        "## Overhead without any resize",
        "",
        f"`examples/transformer_lm.py` (2-layer transformer LM, global batch 32) on {nproc} {unit}(s), "
        "steps/s after the first tenth of the steps; median of interleaved repetitions.",
        "",
        "| configuration | steps/s (each run) | median | vs plain DDP |",
        "|---|---|---:|---:|",
    ]
    for name, vals in rates.items():
        med = statistics.median(vals)
        lines.append(
            f"| {name} | {', '.join(f'{v:.0f}' for v in vals)} | {med:.0f} | {(med / base - 1) * 100:+.1f}% |"
        )
    worst = min(statistics.median(v) for k, v in rates.items() if k != "plain DDP (torchrun)")
    lines += [
        "",
        f"Slowest shoal configuration vs plain DDP: {(worst / base - 1) * 100:+.1f}% "
        f"(target: at most 3% slower: {'met' if worst >= 0.97 * base else 'NOT met'}).",
    ]
    return "\n".join(lines) + "\n"


async def main_async(args: argparse.Namespace) -> None:
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "no CUDA device: torch.cuda.is_available() is false (use --device cpu for the self-check)"
        )
    slots = torch.cuda.device_count() if device == "cuda" else 2
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="shoal-bench-gpu-") as tmp:
        root = Path(tmp)
        try:
            print("start, stop and resume ...", flush=True)
            resume = await stop_and_resume(root / "resume", device, slots)
            print(resume, flush=True)
            inplace: list[ReconfigurationRecord] = []
            restart: list[ReconfigurationRecord] = []
            if slots >= 2:
                print("in-place resizes ...", flush=True)
                inplace = await resize_sequence(
                    root / "inplace", [1, 2, 1], device, slots, restart_only=False
                )
                print("checkpoint-restart resizes ...", flush=True)
                restart = await resize_sequence(root / "restart", [1, 2, 1], device, slots, restart_only=True)
            print("overhead ...", flush=True)
            nproc = min(2, slots)
            rates = await overhead(root / "overhead", device, nproc, args.reps, args.steps)
        except BaseException:
            for log in sorted(root.glob("*/logs/*.log")):  # the workers' own account of what failed
                print(f"== {log.relative_to(root)}", *log.read_text().splitlines()[-15:], sep="\n")
            raise
    command = "python benchmarks/bench_gpu.py" + (" --device cpu" if device == "cpu" else "")
    if args.reps != 3 or args.steps != 2000:
        command += f" --reps {args.reps} --steps {args.steps}"
    text = render(device, slots, resume, inplace, restart, rates, nproc, time.monotonic() - t0, command)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=2000, help="steps of each overhead run")
    p.add_argument("--out", default=str(REPORT))
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
