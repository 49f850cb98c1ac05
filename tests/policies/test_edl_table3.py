"""EDL Table 3's comparison (issue 23, point 10): ``benchmarks/edl_table3.py`` runs Tiresias
and Elastic-Tiresias (EDL §6.3's configuration) on the same jobs; here on a slice small
enough for the default run, where the shape of the table must hold."""

from __future__ import annotations

from benchmarks import edl_table3


def test_elastic_tiresias_lowers_every_statistic_of_table_3_on_a_loaded_slice() -> None:
    # The first 200 jobs of e13805 keep 64 GPUs loaded enough for compaction to act.
    row = edl_table3.run_vc("e13805:200")
    tiresias, elastic = row["Tiresias"], row["Elastic-Tiresias"]
    assert tiresias["completed"] == elastic["completed"] == 200
    for key in ("mean", "median", "p95"):
        assert elastic[key] < tiresias[key], (key, tiresias[key], elastic[key])
    report = edl_table3.render([row], wall_s=1.0)
    assert "## The paper's and 1 VCs' jobs pooled" in report
    assert "(6214e9, the largest, is left out for its cost)" in report
    assert "| e13805:200 | 200 | 200 / 200 |" in report


def test_the_default_run_leaves_out_only_the_largest_vc() -> None:
    assert "6214e9" not in edl_table3.VCS
    assert len(edl_table3.VCS) == 10
