"""The fault suite under load (issue 21): ``python benchmarks/faults.py`` starts ``shoal up``
with a standby allocator and a steady load of submissions, injects every fault of
:data:`shoal.faults.FULL` in turn, runs the checks after each and at the end, and writes
``benchmarks/reports/faults.md`` (one row per fault). See :mod:`shoal.faults`.

``--reduced`` runs :data:`shoal.faults.REDUCED` (what the default test run does) and
``--out`` writes the report elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from shoal.faults import FULL, REDUCED, run_suite

REPORT = Path(__file__).resolve().parent / "reports" / "faults.md"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reduced", action="store_true", help="only the faults of the default test run")
    p.add_argument("--out", type=Path, default=REPORT, help=f"report path (default {REPORT})")
    args = p.parse_args()
    from shoal.faults import report

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="shoal-faults-") as tmp:
        results = asyncio.run(run_suite(Path(tmp), REDUCED if args.reduced else FULL))
        elapsed = time.monotonic() - started
        command = "python benchmarks/faults.py" + (" --reduced" if args.reduced else "")
        text = report(results, command=command, elapsed_s=elapsed)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(text)
        failed = [r for r in results if r.failed]
        if failed:
            err = Path(tmp) / "up.err"
            print(f"--- last lines of {err}:", file=sys.stderr)
            print("\n".join(err.read_text().splitlines()[-60:]), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
