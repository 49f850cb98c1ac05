"""The fault suite under load (issue 21): ``python benchmarks/faults.py`` starts ``shoal up``
with a standby allocator and a steady load of submissions, injects every fault of
:data:`shoal.faults.FULL` in turn, runs the checks after each and at the end; then, on a
second installation in real mode, the faults of :data:`shoal.faults.REAL`: kill -9 of a
sidecar leader and of a training worker of real jobs (``examples/cnn_digits.py`` on CPU
with gloo). It writes both, one row per fault, to ``benchmarks/reports/faults.md``. See
:mod:`shoal.faults`.

``--no-real`` leaves the real-mode faults out (they need torch: the ``train`` or ``dev``
extra), ``--real`` runs only them (report ``faults_real.md``), ``--reduced`` runs
:data:`shoal.faults.REDUCED` (what the default test run does), ``--pauses SECONDS`` runs
:func:`shoal.faults.pauses` instead (a SIGSTOP of that long of every kind of process, one
at a time; report ``faults_pause_<SECONDS>s.md``) and ``--out`` writes the report
elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from shoal.faults import FULL, REAL_KW, REAL_STEPS, REDUCED, pauses, run_real_suite, run_suite

REPORT = Path(__file__).resolve().parent / "reports" / "faults.md"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reduced", action="store_true", help="only the faults of the default test run")
    p.add_argument(
        "--pauses",
        type=float,
        metavar="SECONDS",
        help="only SIGSTOP of every kind of process for SECONDS each (e.g. 60)",
    )
    p.add_argument(
        "--real", action="store_true", help="only the real-mode faults (sidecar leader, training worker)"
    )
    p.add_argument("--no-real", action="store_true", help="without the real-mode faults")
    p.add_argument("--out", type=Path, help=f"report path (default {REPORT}, or faults_pause_<S>s.md)")
    args = p.parse_args()
    from shoal.faults import report

    if args.real:
        return real(args.out or REPORT.with_name("faults_real.md"))
    with_real = args.pauses is None and not args.reduced and not args.no_real
    if with_real:
        try:
            import torch  # noqa: F401
        except ImportError:
            p.error("the real-mode faults need torch (pip install -e '.[train]'), or pass --no-real")
    if args.pauses is not None:
        faults = pauses(args.pauses)
        out = args.out or REPORT.with_name(f"faults_pause_{args.pauses:g}s.md")
        command = f"python benchmarks/faults.py --pauses {args.pauses:g}"
    else:
        faults = REDUCED if args.reduced else FULL
        out = args.out or REPORT
        command = "python benchmarks/faults.py" + (
            " --reduced" if args.reduced else " --no-real" if args.no_real else ""
        )
    args.out = out
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="shoal-faults-") as tmp:
        # Long pauses: one submission every 5 s, which the 4 emulated GPUs keep up with
        # once the backlog of a 60 s pause is worked off (at 1/s they did not, on this
        # loaded 2-core machine, within the recovery timeout).
        every = 5.0 if args.pauses is not None else 1.0
        results = asyncio.run(
            run_suite(
                Path(tmp),
                faults,
                recovery_timeout_s=max(60.0, 2 * (args.pauses or 0)),
                submit_every_s=every,
            )
        )
        failed = _show_failures(results, Path(tmp))
    real_section = ""
    if with_real:
        real_text, real_failed = _run_real(command, section=True)
        real_section = "\n" + real_text
        failed = failed or real_failed
    elapsed = time.monotonic() - started
    text = report(
        results,
        command=command,
        elapsed_s=elapsed,
        submit_every_s=every,
        real_included=with_real,
    )
    text += real_section
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 1 if failed else 0


def _show_failures(results: list[Any], tmp: Path) -> bool:
    """Print the last lines of ``shoal up``'s log when a fault failed; whether one did."""
    if not any(r.failed for r in results):
        return False
    err = tmp / "up.err"
    print(f"--- last lines of {err}:", file=sys.stderr)
    print("\n".join(err.read_text().splitlines()[-60:]), file=sys.stderr)
    return True


def _machine() -> str:
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{os.cpu_count()} CPUs, load average (1/5/15 min) {load}"


def _run_real(command: str, *, section: bool = False) -> tuple[str, bool]:
    """The real-mode suite on an installation of its own: its report (``section``: as a
    section of faults.md), whether a fault failed."""
    from shoal.faults import report

    before = _machine()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="shoal-faults-real-") as tmp:
        results = asyncio.run(run_real_suite(Path(tmp)))
        elapsed = time.monotonic() - started
        machine = (
            f"Machine at the start: {before}; at the end: {_machine()} (the load counts the run's own"
            f" processes, and any other work the machine had). Recovery timeout"
            f" {REAL_KW['recovery_timeout_s']:g} s."
        )
        text = report(
            results,
            command=command,
            elapsed_s=elapsed,
            real_steps=REAL_STEPS,
            machine=machine,
            section=section,
        )
        failed = _show_failures(results, Path(tmp))
    return text, failed


def real(out: Path) -> int:
    text, failed = _run_real("python benchmarks/faults.py --real")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
