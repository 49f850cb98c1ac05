"""Smoke test of benchmarks/afs_reproduction.py's stored cells and their provenance.

Runs the real script (tiny slices of two VCs) in a temporary figures directory: a cell
whose code fingerprint no longer matches is recomputed and records what it replaced,
and ``--stale`` reports such a cell as one of an earlier code version.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "afs_reproduction.py"
ARGS = [
    "--workers",
    "1",
    "--settings",
    "flat",
    "--vcs",
    "e13805,2869ce",
    "--policies",
    "srtf,afs-p",
    "--limit",
    "20",
]


def _run(figs: Path, out: Path, *extra: str) -> None:
    subprocess.run(
        [sys.executable, str(SCRIPT), *ARGS, "--figs", str(figs), "--out", str(out), *extra],
        check=True,
        capture_output=True,
        timeout=600,
    )


def test_recomputed_cells_record_what_they_replaced(tmp_path: Path) -> None:
    figs = tmp_path / "figs"
    _run(figs, tmp_path / "first.md")
    cells = sorted((figs / "cells-limit20").glob("flat__*__afs-p__s0.json"))
    assert len(cells) == 2
    first = {p.name: json.loads(p.read_text()) for p in cells}
    for p in cells:  # pretend they came from an earlier version of the code
        cell = json.loads(p.read_text())
        cell["fingerprint"] = "0" * 16
        p.write_text(json.dumps(cell))

    _run(figs, tmp_path / "dropped.md", "--no-run")
    _run(figs, tmp_path / "stale.md", "--no-run", "--stale")
    assert "earlier version of the code" not in (tmp_path / "dropped.md").read_text()
    stale = (tmp_path / "stale.md").read_text()
    assert "**2 of the 4 cells below come from an earlier version of the code**" in stale
    assert "flat 2869ce afs-p" in stale and "flat e13805 afs-p" in stale

    _run(figs, tmp_path / "again.md")
    for p in cells:
        cell = json.loads(p.read_text())
        assert cell["replaced"]["fingerprint"] == "0" * 16
        assert cell["replaced"]["avg_jct_s"] == first[p.name]["outcome"]["summary"]["avg_jct_s"]
        assert cell["outcome"]["summary"]["avg_jct_s"] == cell["replaced"]["avg_jct_s"]
    again = (tmp_path / "again.md").read_text()
    assert "2 cells; the average JCT is identical in 2 of them" in again
    assert "earlier version of the code**" not in again


def test_a_cell_stopped_at_its_limit_says_which_limit(tmp_path: Path) -> None:
    figs = tmp_path / "figs"
    _run(figs, tmp_path / "run.md", "--cpu-limit", "1e-06")  # every cell stops at once
    run = (tmp_path / "run.md").read_text()
    assert "- Limits: a cell is stopped after 1e-06 CPU seconds" in run
    assert "| limit 1e-06 s | limit 1e-06 s |" in run
    _run(figs, tmp_path / "stored.md", "--no-run")
    stored = (tmp_path / "stored.md").read_text()
    assert "each cell ran under the CPU limit of the run that produced it (1e-06 CPU seconds)" in stored

    # The same limit again: nothing to gain, the stopped cells are kept.
    _run(figs, tmp_path / "same.md", "--cpu-limit", "1e-06")
    assert "| limit 1e-06 s | limit 1e-06 s |" in (tmp_path / "same.md").read_text()
    # A larger limit reruns them, and they now finish.
    _run(figs, tmp_path / "more.md", "--cpu-limit", "600")
    for p in (figs / "cells-limit20").glob("flat__*.json"):
        cell = json.loads(p.read_text())
        assert cell["outcome"]["ok"], p.name
        assert cell["outcome"]["spec"]["cpu_limit_s"] == 600
        assert cell["replaced"] is None  # same code: a longer run, not a recomputation
    assert "limit 1e-06 s" not in (tmp_path / "more.md").read_text()


def test_a_cells_fingerprint_follows_the_policy_modules_it_imports() -> None:
    """Themis uses Tiresias' gang size and themis-unaware wraps Themis: editing either
    module must make their stored cells stale, so both are in the fingerprint."""
    script = load_script(SCRIPT, "afs_reproduction_under_test")
    themis = script._policy_modules("shoal.policies.themis")
    assert themis[0] == "libs/shoal/policies/themis.py"
    assert "libs/shoal/policies/tiresias.py" in themis
    unaware = script._policy_modules("shoal.policies.unaware")
    assert {"libs/shoal/policies/themis.py", "libs/shoal/policies/tiresias.py"} <= set(unaware)
    assert script._policy_modules("shoal.policies.maxmin") == [
        "libs/shoal/policies/maxmin.py",
        "libs/shoal/policies/base.py",
        "libs/shoal/policies/common.py",
    ]


def test_a_cells_fingerprint_takes_of_an_imported_module_only_the_code_it_uses(tmp_path: Path) -> None:
    """Themis and Optimus take ``gang_size`` from Tiresias-L's module: editing Tiresias-L's
    decision there makes only Tiresias-L's cells stale; editing ``gang_size``, or
    anything it uses, makes theirs stale too. Docstrings count for none of them."""
    script = load_script(SCRIPT, "afs_reproduction_partial")
    libs = script.ROOT / "libs"
    for path in libs.rglob("*.py"):
        target = tmp_path / "libs" / path.relative_to(libs)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    costs = "libs/shoal/data/reconfig_costs.json"
    (tmp_path / costs).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / costs).write_bytes((script.ROOT / costs).read_bytes())
    script.ROOT = tmp_path
    policies = ("tiresias-l", "themis", "themis-unaware", "optimus", "max-min")

    def prints() -> dict[str, str]:
        return {p: script.fingerprint(p, "topology") for p in policies}

    tiresias = tmp_path / "libs/shoal/policies/tiresias.py"
    source = tiresias.read_text()
    before = prints()

    def edited(old: str, new: str) -> dict[str, str]:
        assert old in source
        tiresias.write_text(source.replace(old, new, 1))
        return prints()

    def changed(after: dict[str, str]) -> set[str]:
        return {p for p in policies if after[p] != before[p]}

    # Tiresias-L's pass (not used by gang_size).
    assert changed(edited("if 0 < g <= free:", "if 0 < g and g <= free:")) == {"tiresias-l"}
    # A docstring of gang_size.
    assert changed(edited("The GPUs a non-elastic scheduler gives a job", "The GPUs it gives")) == set()
    # gang_size itself: every policy that takes it.
    assert changed(edited("below[-1] if below else counts[0]", "below[-1] if below else counts[-1]")) == {
        "tiresias-l",
        "themis",
        "themis-unaware",
        "optimus",
    }
    # What gang_size uses through an import: the name it binds, not the rest of the list.
    assert changed(edited("jobs_by_id\n", "jobs_by_id, view_key\n")) == {"tiresias-l"}
    tiresias.write_text(source)
    assert prints() == before


def test_placement_and_the_measured_costs_decide_only_the_topology_cells(tmp_path: Path) -> None:
    """Editing a function of a placement module or the measured reconfiguration costs
    makes every topology cell stale and leaves every flat cell fresh (a function of
    node-hinted placement, which no matrix policy uses, stales none); editing what a
    placement module runs at import, the engine or the allocation step makes both stale."""
    script = load_script(SCRIPT, "afs_reproduction_settings")
    shutil.copytree(script.ROOT / "libs" / "shoal", tmp_path / "libs" / "shoal")
    script.ROOT = tmp_path
    keys = [(p, s) for p in script.POLICIES for s in script.SETTINGS]

    def prints() -> dict[tuple[str, str], str]:
        return {(p, s): script.fingerprint(p, s) for p, s in keys}

    def stale_after(rel: str, added: str) -> set[tuple[str, str]]:
        """The (policy, setting) cells made stale by appending ``added`` to ``rel``."""
        path = tmp_path / rel
        source = path.read_text()
        before = prints()
        path.write_text(source + added)
        try:
            after = prints()
        finally:
            path.write_text(source)
        return {k for k in keys if after[k] != before[k]}

    code = "\n\ndef _unused() -> None:\n    return None\n"
    topology = {(p, s) for p, s in keys if s == "topology"}
    assert stale_after("libs/shoal/placement/min_migration.py", code) == topology
    assert stale_after("libs/shoal/placement/_cluster.py", code) == topology
    assert stale_after("libs/shoal/data/reconfig_costs.json", "\n") == topology
    # What a placement module runs at import (a constant the engine reads) counts for all.
    assert stale_after("libs/shoal/placement/hinted.py", "\nX = 1\n") == set(keys)
    # The functions of node-hinted placement run for no matrix policy: no cell takes them.
    assert stale_after("libs/shoal/placement/hinted.py", code) == set()
    assert stale_after("libs/shoal/sim/engine.py", code) == set(keys)
    assert stale_after("libs/shoal/allocation.py", code) == set(keys)


def test_the_recompute_cost_of_an_edit_counts_the_cells_it_stales() -> None:
    """``--recompute-cost``, on the stored cells: an edit to the engine stales every
    cell, to a placement module the topology ones only, to Gandiva_fair none."""
    script = load_script(SCRIPT, "afs_reproduction_cost", register=True)
    cache = script.ROOT / "benchmarks/reports/afs_reproduction/cells"
    stored = [json.loads(p.read_text()) for p in cache.glob("*.json")]
    assert stored

    def rows(path: str) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], int]]:
        """(cells stale whatever the edit, cells stale if it touches their part), by
        (setting, policy)."""
        groups: list[dict[tuple[str, str], int]] = []
        totals: list[int] = []
        for line in script.recompute_cost(cache, [path]):
            if line.startswith("Stored cells"):
                groups.append({})
                totals.append(int(line.split(": ")[1].split(",")[0]))
            elif line.startswith("| ") and not line.startswith("| setting"):
                cols = [c.strip() for c in line.split("|")[1:-1]]
                groups[-1][(cols[0], cols[1])] = int(cols[2])
        assert [sum(g.values()) for g in groups] == totals and len(groups) == 2
        return groups[0], groups[1]

    engine, engine_partly = rows("libs/shoal/sim/engine.py")
    assert sum(engine.values()) == len(stored) and not engine_partly
    placement, placement_partly = rows("libs/shoal/placement/min_migration.py")
    assert {setting for setting, _ in placement} == {"topology"}
    assert sum(placement.values()) == sum(1 for c in stored if c["setting"] == "topology")
    # What the module runs at import counts for the flat cells.
    assert {setting for setting, _ in placement_partly} == {"flat"}
    assert rows("libs/shoal/fairness/policy.py") == ({}, {})
    # Themis' module: all of it for Themis, what the length-unaware wrapper takes for it.
    themis, themis_partly = rows("libs/shoal/policies/themis.py")
    assert {policy for _, policy in themis} == {"themis"}
    assert {policy for _, policy in themis_partly} == {"themis-unaware"}
    # Tiresias-L's module: all of it for its own cells, gang_size for Themis and Optimus.
    tiresias, tiresias_partly = rows("libs/shoal/policies/tiresias.py")
    assert {policy for _, policy in tiresias} == {"tiresias-l"}
    assert "themis" in {policy for _, policy in tiresias_partly}


def _probed_run(script: Any, setting: str, policy: str, profile: Any) -> Any:
    """The first 150 jobs of 2869ce run as a cell of ``setting`` runs them, with
    ``profile`` as the profile hook (:func:`sys.setprofile`)."""
    from shoal.sim.matrix import run_one

    spec = script.spec_for(setting, "2869ce", policy, 0, None, 150)
    sys.setprofile(profile)
    try:
        return run_one(spec)
    finally:
        sys.setprofile(None)


def test_a_flat_cell_runs_no_placement_code_and_reads_no_measured_costs() -> None:
    """What :func:`setting_files` leaves out of a flat cell's fingerprint never runs in
    one: every policy of the matrix, on a flat pool, calls no function of
    ``shoal.placement`` and never loads the measured costs. A change that made a flat
    run place would have to edit a fingerprinted file (the engine, the allocation step),
    and this test then says the flat fingerprint must take placement back."""

    script = load_script(SCRIPT, "afs_reproduction_flat")
    placement = str(script.ROOT / "libs" / "shoal" / "placement")
    costs = str(script.ROOT / "libs" / "shoal" / "sim" / "costs.py")
    ran: set[str] = set()

    def profile(frame: Any, event: str, _arg: object) -> None:
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(placement) or (
                code.co_filename == costs and code.co_name in ("measured", "load_calibration")
            ):
                ran.add(f"{code.co_filename}:{code.co_name}")

    for policy in script.POLICIES:
        outcome = _probed_run(script, "flat", policy, profile)
        assert outcome.ok, (policy, outcome.error)
        assert outcome.completed > 0, policy
    assert ran == set(), sorted(ran)[:10]
    # The same probe does see placement in a topology run (it is not blind).
    _probed_run(script, "topology", "afs-p", profile)
    assert ran, "a topology run calls shoal.placement"


def test_an_extra_variants_stored_cells_get_a_comparison_row(tmp_path: Path) -> None:
    """``themis-unaware`` (Themis as AFS §5.1 classifies it) is not a column of Figure 5,
    but once its cells are stored every comparison table gets an ``afs-p vs themis-unaware``
    row with the paper's Themis range."""
    figs = tmp_path / "figs"
    _run(figs, tmp_path / "without.md")
    assert "afs-p vs themis-unaware" not in (tmp_path / "without.md").read_text()
    _run(figs, tmp_path / "extra.md", "--policies", "themis-unaware")  # the last --policies wins
    _run(figs, tmp_path / "with.md", "--no-run")
    rows = [
        r
        for r in (tmp_path / "with.md").read_text().splitlines()
        if r.startswith("| afs-p vs themis-unaware |")
    ]
    assert len(rows) == 1
    assert "2 VCs" in rows[0] and "1.2–2.2× (vs Themis)" in rows[0]


def test_a_trace_whose_extra_cell_is_stale_is_named_as_such() -> None:
    """A trace left out of the length-unaware Themis comparison because its stored cell is
    an earlier code version's is named as that, not as one with no result."""
    script = load_script(SCRIPT, "afs_reproduction_missing")
    text = script._missing_unaware(["a", "b", "c", "d"], {"a": 1.0}, {"b", "c"})
    assert text == (
        " (no result at this code version on b, c: the cells stored there are from an earlier one "
        "and are left out; the command above recomputes them; no result on d)"
    )
    assert script._missing_unaware(["a"], {"a": 1.0}, set()) == ""
    assert script._missing_unaware(["a", "d"], {"a": 1.0}, set()) == " (no result on d)"


def test_a_cell_recomputed_across_a_deliberate_model_change_is_reported_apart() -> None:
    """A recomputed cell must come out identical unless the one it replaced predates a
    deliberate change of its setting's model (:data:`MODEL_CHANGES`): then its
    difference is listed apart, with the change and its evidence, and the headline's
    "identical in N" counts only same-model recomputations."""
    from shoal.sim.matrix import RunOutcome, RunSpec

    script = load_script(SCRIPT, "afs_reproduction_changes", register=True)
    change = script.MODEL_CHANGES[0]

    def cell(setting: str, vc: str, replaced_at: str, old: float, new: float) -> object:
        return script.Cell(
            setting=setting,
            vc=vc,
            policy="themis-unaware",
            seed=0,
            fingerprint="1" * 16,
            finished_at="2026-12-01 22:15 UTC",
            outcome=RunOutcome(
                spec=RunSpec(trace=f"philly:{vc}", policy="themis-unaware"),
                ok=True,
                summary={"avg_jct_s": new},
            ),
            replaced=script.Replaced(fingerprint="0" * 16, finished_at=replaced_at, ok=True, avg_jct_s=old),
        )

    before = "2026-11-25 03:32 UTC"
    assert before < change.before
    across = cell(change.setting, "b436b2", before, 100.0, 101.5)
    same_model = cell(change.setting, "7f04ca", change.before, 200.0, 200.0)
    other_setting = cell("flat", "b436b2", before, 300.0, 300.0)
    assert script.model_change_between(across) is change
    assert script.model_change_between(same_model) is None
    assert script.model_change_between(other_setting) is None

    cells = {(c.setting, c.vc, c.policy): c for c in (across, same_model, other_setting)}
    text = "\n".join(script._provenance_section(cells, []))
    assert "2 cells; the average JCT is identical in 2 of them" in text
    assert (
        f"{change.setting} b436b2 themis-unaware: average JCT +1.50% against the cell finished {before}"
        in text
    )
    assert change.commits in text
    assert "b436b2 themis-unaware" in {f"{vc} {p}" for vc, p, _ in change.traced}
    assert "traced to the change by [cell_history.md](cell_history.md)" in text

    # A cell across the change whose move nobody traced says so.
    assert ("ee9e8c", "themis-unaware") not in {(vc, p) for vc, p, _ in change.traced}
    untraced = cell(change.setting, "ee9e8c", before, 100.0, 102.0)
    text = "\n".join(script._provenance_section({("t", "e", "u"): untraced}, []))
    assert "ee9e8c themis-unaware: average JCT +2.00%" in text
    assert "not traced to the change" in text

    # The same difference without a model change in between is not explained away.
    unexplained = cell(change.setting, "b436b2", change.before, 100.0, 101.5)
    text = "\n".join(script._provenance_section({("t", "b", "u"): unexplained}, []))
    assert "1 cells; the average JCT is identical in 0 of them" in text
    assert "deliberate change" not in text


def test_a_topology_cell_runs_no_node_hinted_placement() -> None:
    """What :func:`setting_files` leaves out of a topology cell's fingerprint never runs
    in one: every policy of the matrix (and its stored variants), with topology, calls
    no function of :data:`HINT_FILES` (they serve decisions that name nodes). The probe
    is not blind: a Gandiva_fair run with topology calls them."""

    script = load_script(SCRIPT, "afs_reproduction_hints")
    hinted = {str(script.ROOT / f) for f in script.HINT_FILES}
    ran: set[str] = set()

    def profile(frame: Any, event: str, _arg: object) -> None:
        if event == "call" and frame.f_code.co_filename in hinted and frame.f_code.co_name != "<module>":
            ran.add(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    def probe(policy: str) -> None:
        outcome = _probed_run(script, "topology", policy, profile)
        assert outcome.ok, (policy, outcome.error)
        assert outcome.completed > 0, policy

    for policy in (*script.POLICIES, *script.EXTRA_POLICIES):
        probe(policy)
    assert ran == set(), sorted(ran)[:10]
    probe("gandiva-fair")
    assert any(r.endswith(":place_hinted") for r in ran), "a Gandiva_fair run places by its hints"
