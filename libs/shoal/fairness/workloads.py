"""Workloads for the Gandiva_fair experiments: the §5.4/§5.5 users and a Philly slice with users.

**§5.4-5.5 workload** (:func:`section55_workload`). The paper's users
(Gandiva_fair §5.4; NOTES-001-004 E5/E6): 100 tickets each, 150 jobs each, all
submitted at t = 0:

======  =========================  ==================================================
user    jobs                       per-generation curves (iterations/s)
======  =========================  ==================================================
U1      150 × 1-GPU ResNet-50      Gavel ``ResNet-50 (batch size 64)``, k80/p100/v100
U2      150 × 2-GPU ResNet-50      same curves, at 2 GPUs
U3      150 × 4-GPU ResNet-50      same curves, at 4 GPUs
U4      150 × 1-GPU SuperRes.      Gandiva_fair Table 1: 207.5 ms per mini-batch on a
                                   K80, 173 % on a P100, 187 % on a V100
======  =========================  ==================================================

Choices, and why:

- The paper ran ResNet-50 on CIFAR10 and gives only its 1-GPU speedups (Table 1:
  3.34× P100, 5.14× V100). Gavel measured ResNet-50 (batch size 64) on 1, 2 and 4
  GPUs of each generation: 7.10×, 6.27× and 3.92× V100 over K80, and 4.23×,
  4.37× and 4.30× P100 over K80. So U1, U2 and U3 differ in speedup, as the
  paper's own trades imply: its Figure 9 has them trade with each other at
  1.00-1.94 K80 per V100. ``resnet_source="table1"`` instead gives every
  ResNet-50 user Table 1's speedups at every size (linear scaling), for
  comparison.
- SuperResolution is not in Gavel's table; Table 1 is the only measurement.
- Job length. The paper gives none; it reports that U1's jobs finish at about
  4 h (§5.4). Every job needs the same time on its gang of K80s, ``k80_hours``. By
  default that time makes U1 finish in ``u1_finish_s`` (4 h) at its untraded fair
  share (3 V100 + 6 P100 + 16 K80, used only by U1's 1-GPU jobs). It is computed
  from the curves, not typed in. ``length_jitter`` (default 0) draws each job's
  length uniformly within ± that fraction, seeded by ``seed``.
- Jobs are gangs (``elastic=False``): Gandiva_fair time-slices whole jobs.

**Philly slice with synthetic users** (:func:`philly_users_workload`). The
shipped Philly file has no user column (``data/README.md``: "user ids … are
**not available**"). Users are synthesised by this stated rule:

- A *sweep* is a maximal run of consecutive submissions with the same GPU
  request, each within ``sweep_gap_s`` (60 s) of the previous one. A user
  submits a hyper-parameter sweep as a burst of identical jobs (Gandiva_fair
  §3.4 "multi-jobs").
- Each sweep goes to one of ``users`` users with Zipf(1) weights
  (user k ∝ 1/k), seeded: a few heavy users and a tail of light ones.
- Each user trains one model family (Gandiva_fair §5.3: "product groups, each
  … working on one particular model"). It is drawn, seeded, from the Gavel job
  types measured on k80, p100 and v100 up to 8 GPUs (LM, ResNet-18, ResNet-50,
  Transformer at their batch sizes); 1-GPU-only types cannot run multi-GPU requests.
- Requests above 8 GPUs are capped at 8, Gavel's largest measurement.
- A job runs its trace duration at its request on the *reference* generation
  (``reference_type``, default P100, the middle one); on other generations it
  runs at that model's Gavel rate there.
- Jobs are elastic from 1 to 8 GPUs: AFS-P, Max-Min and HeteroAFS may resize them,
  while Gandiva_fair runs each at its request.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Mapping, Sequence

from shoal.fairness.shares import fair_shares_by_generation
from shoal.models import ThroughputCurve, gavel_catalog
from shoal.workloads import TraceJob, make_job, philly_vc_rows

#: §5.4-5.5 cluster: 64 K80 + 24 P100 + 12 V100 in servers of 4 GPUs of one model.
SECTION55_GPUS: dict[str, int] = {"k80": 64, "p100": 24, "v100": 12}
SECTION55_USERS: tuple[str, ...] = ("U1", "U2", "U3", "U4")
SECTION55_SIZES: dict[str, int] = {"U1": 1, "U2": 2, "U3": 4, "U4": 1}
#: Gandiva_fair Table 1 (K80 ms per mini-batch; speedup of P100 and V100 in %).
TABLE1: dict[str, tuple[float, float, float]] = {
    "ResNet-50": (134.0, 334.0, 514.0),
    "SuperResolution": (207.5, 173.0, 187.0),
}
GAVEL_RESNET50 = "ResNet-50 (batch size 64)"


def table1_curves(model: str, max_gpus: int = 1) -> dict[str, ThroughputCurve]:
    """Per-generation curves from Gandiva_fair Table 1, scaled linearly in GPUs."""
    k80_ms, p100_pct, v100_pct = TABLE1[model]
    base = 1000.0 / k80_ms
    out = {}
    for gen, factor in (("k80", 1.0), ("p100", p100_pct / 100), ("v100", v100_pct / 100)):
        rate = base * factor
        out[gen] = ThroughputCurve(
            model=model,
            gpu_type=gen,
            throughput=(0.0, *(rate * k for k in range(1, max_gpus + 1))),
            display_name=model,
        )
    return out


def section55_curves(resnet_source: str = "gavel") -> dict[str, dict[str, ThroughputCurve]]:
    """User -> generation -> curve for the §5.5 users (see the module docstring)."""
    if resnet_source == "gavel":
        resnet = dict(gavel_catalog().curves[GAVEL_RESNET50])
    elif resnet_source == "table1":
        resnet = table1_curves("ResNet-50", max(SECTION55_SIZES.values()))
    else:
        raise ValueError(f"resnet_source must be 'gavel' or 'table1', got {resnet_source!r}")
    superres = table1_curves("SuperResolution")
    return {"U1": resnet, "U2": resnet, "U3": resnet, "U4": superres}


def u1_fair_share_k80_hours(u1_finish_s: float, jobs_per_user: int, resnet_source: str = "gavel") -> float:
    """K80-hours per job so that U1 finishes in ``u1_finish_s`` at its untraded fair share."""
    curves = section55_curves(resnet_source)["U1"]
    demand = {
        u: dict.fromkeys(SECTION55_GPUS, float(jobs_per_user * SECTION55_SIZES[u])) for u in SECTION55_USERS
    }
    share = fair_shares_by_generation(dict.fromkeys(SECTION55_USERS, 100.0), demand, SECTION55_GPUS)["U1"]
    rate = sum(n * curves[g].throughput[1] for g, n in share.items())  # iterations/s
    per_job = rate * u1_finish_s / jobs_per_user
    return per_job / curves["k80"].throughput[1] / 3600.0


def section55_workload(
    *,
    jobs_per_user: int = 150,
    resnet_source: str = "gavel",
    k80_hours: float | None = None,
    u1_finish_s: float = 4 * 3600.0,
    length_jitter: float = 0.0,
    seed: int = 0,
) -> tuple[TraceJob, ...]:
    """The §5.4-5.5 workload: four users × ``jobs_per_user`` jobs, all at t = 0.

    Args:
        jobs_per_user: Jobs per user (150 in the paper).
        resnet_source: ``"gavel"`` (measured per size) or ``"table1"`` (paper, linear).
        k80_hours: Time each job needs on its gang of K80s; default from ``u1_finish_s``.
        u1_finish_s: U1's finish time at its untraded fair share (sets ``k80_hours``).
        length_jitter: Each job's length is scaled by U(1 − j, 1 + j).
        seed: Seed of the jitter.

    Returns:
        The jobs, users ``U1``-``U4``, ids ``U<k>-<nnn>``.
    """
    if k80_hours is None:
        k80_hours = u1_fair_share_k80_hours(u1_finish_s, jobs_per_user, resnet_source)
    if k80_hours <= 0:
        raise ValueError(f"k80_hours must be positive, got {k80_hours}")
    rng = random.Random(seed)
    curves = section55_curves(resnet_source)
    jobs = []
    for user in SECTION55_USERS:
        size = SECTION55_SIZES[user]
        by_type = curves[user]
        for k in range(jobs_per_user):
            factor = 1.0 + length_jitter * (2.0 * rng.random() - 1.0) if length_jitter else 1.0
            jobs.append(
                make_job(
                    f"{user}-{k:03d}",
                    0.0,
                    k80_hours * 3600.0 * factor,
                    size,
                    by_type["k80"],
                    user=user,
                    cap_at_request=True,
                    elastic=False,
                    by_type=by_type,
                )
            )
    return tuple(jobs)


def normalised_k80(curves: Mapping[str, Sequence[float]], gen: str, gpus: int) -> float:
    """A job's speed on ``gpus`` GPUs of ``gen`` in normalised K80s: ``gpus · thr_gen(k) / thr_k80(k)``.

    Gandiva_fair Table 3's unit: a user's aggregate performance is the sum over
    its GPUs of their speedup over a K80. ``gen`` without a curve point gives 0.
    """
    k80 = curves.get("k80", ())
    here = curves.get(gen, ())
    if gpus <= 0 or gpus >= len(here) or gpus >= len(k80) or k80[gpus] <= 0:
        return 0.0
    return gpus * here[gpus] / k80[gpus]


# ---------------------------------------------------------------------------
# Philly with synthetic users
# ---------------------------------------------------------------------------

MAX_GAVEL_GPUS = 8


def gavel_multi_gpu_models() -> tuple[str, ...]:
    """Gavel job types measured on k80, p100 and v100 up to 8 GPUs, sorted."""
    cat = gavel_catalog()
    return tuple(
        sorted(
            m
            for m, by_type in cat.curves.items()
            if all(g in by_type and by_type[g].max_gpus >= MAX_GAVEL_GPUS for g in SECTION55_GPUS)
        )
    )


def synthesise_users(
    submit_times: Sequence[float], requests: Sequence[int], users: int, seed: int, sweep_gap_s: float = 60.0
) -> list[int]:
    """User index (0-based) of each job by the sweep + Zipf(1) rule (module docstring)."""
    if users <= 0:
        raise ValueError(f"users must be positive, got {users}")
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) for k in range(users)]
    out: list[int] = []
    current = -1
    for i, (t, req) in enumerate(zip(submit_times, requests, strict=True)):
        new_sweep = i == 0 or req != requests[i - 1] or t - submit_times[i - 1] > sweep_gap_s
        if new_sweep:
            current = rng.choices(range(users), weights=weights, k=1)[0]
        out.append(current)
    return out


def philly_users_workload(
    vc: str = "6214e9",
    *,
    day: int = 100,
    days: float = 1.0,
    users: int = 8,
    seed: int = 0,
    reference_type: str = "p100",
    sweep_gap_s: float = 60.0,
) -> tuple[TraceJob, ...]:
    """A Philly VC's submissions in a window, with synthetic users and Gavel curves.

    Args:
        vc: Philly VC hash.
        day: First day of the window (days since the VC's first submission).
        days: Length of the window in days.
        users: Number of synthetic users.
        seed: Seed of the user and model draws.
        reference_type: Generation on which a job runs its trace duration.
        sweep_gap_s: Largest gap between submissions of one sweep.

    Returns:
        The jobs (arrivals shifted so the window starts at 0), users ``user<k>``.
    """
    rows = philly_vc_rows(vc)
    times = [r.submit_time_s for r in rows]
    lo = bisect.bisect_left(times, day * 86400)
    hi = bisect.bisect_left(times, (day + days) * 86400)
    window = rows[lo:hi]
    if not window:
        raise ValueError(f"no {vc} submissions in days [{day}, {day + days})")
    start = window[0].submit_time_s
    requests = [min(r.num_gpus, MAX_GAVEL_GPUS) for r in window]
    owner = synthesise_users([r.submit_time_s for r in window], requests, users, seed, sweep_gap_s)
    models = gavel_multi_gpu_models()
    rng = random.Random(f"{seed}:models")
    model_of = [rng.choice(models) for _ in range(users)]
    cat = gavel_catalog()
    jobs = []
    for r, req, u in zip(window, requests, owner, strict=True):
        by_type = cat.curves[model_of[u]]
        jobs.append(
            make_job(
                r.job_id,
                float(r.submit_time_s - start),
                float(r.duration_s),
                req,
                by_type[reference_type],
                user=f"user{u}",
                by_type=by_type,
            )
        )
    return tuple(jobs)
