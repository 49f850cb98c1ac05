"""Gandiva_fair on heterogeneous GPUs: §5.5 trading, distance from fair share, fairness vs JCT.

Writes ``benchmarks/reports/fairness_heterogeneity.md`` and its figures and data in
``benchmarks/reports/fairness_heterogeneity/``. Every number in the report is
computed here from simulator runs (:mod:`shoal.sim`); the policies are called
through the :class:`~shoal.policies.base.Policy` interface like every other policy.

Three parts:

1. **Gandiva_fair §5.5.** The §5.4 workload (:func:`shoal.fairness.workloads.section55_workload`)
   on 64 K80 + 24 P100 + 12 V100, with and without trading. Per user: normalised
   K80-hours of progress in the first 4 hours (the paper's window before the first
   user leaves), their ratio, and when the user's last job finishes. The run is
   repeated with Table 1 speedups for every ResNet-50 user.
2. **Distance from fair share over time** (:mod:`shoal.fairness.timeline`). For
   each user: GPUs held against the ticket-weighted fair share, averaged over
   10-minute windows, and progress against the untraded entitlement.
3. **Fairness vs JCT** on a Philly slice with synthetic users
   (:func:`shoal.fairness.workloads.philly_users_workload`). Gandiva_fair (with
   and without trading), AFS-P, Max-Min and HeteroAFS run on the same cluster and
   jobs, over several seeds of the user and model draw.

Usage::

    python benchmarks/fairness_heterogeneity.py [--quick] [--seeds 0,1,2]
        [--jobs-per-user N] [--days D]

``--jobs-per-user`` and ``--days`` shrink the §5.5 and Philly workloads further than
``--quick`` (the test suite's smoke run uses them).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from shoal.events import Envelope, TradeExecuted, TradeUndone
from shoal.fairness.policy import SUSPEND_RESUME, GandivaFairPolicy
from shoal.fairness.timeline import Timeline, UserFairness, build_timeline, user_fairness, windows
from shoal.fairness.workloads import (
    SECTION55_GPUS,
    SECTION55_SIZES,
    SECTION55_USERS,
    philly_users_workload,
    section55_curves,
    section55_workload,
)
from shoal.policies.afs import AFSP
from shoal.policies.afs_hetero import HeteroAFS
from shoal.policies.base import Policy
from shoal.policies.maxmin import MaxMin
from shoal.sim import SimConfig, SimResult, Simulator
from shoal.sim.costs import ReconfigCosts
from shoal.workloads import TraceJob

CLUSTER = dict(SECTION55_GPUS)
GPUS_PER_NODE = 4
#: Gandiva_fair's own costs (shoal.fairness.policy.SUSPEND_RESUME, the policy's default):
#: §4, suspend/resume 100-250 ms and a move to other GPUs (in place, or to disjoint ones: a
#: checkpoint-restart) 0.25 s, its set-up hidden by preload; CoDDL §4.3: shrink and the
#: switch after expansion take milliseconds.
COSTS: ReconfigCosts = SUSPEND_RESUME
WINDOW_S = 4 * 3600.0
SHARE_WINDOW_S = 600.0
#: A user whose 0-4 h progress ratio can be at most this (work left) is "bounded by its work".
BOUND_CAP = 1.05
PHILLY_VC = "6214e9"
PHILLY_DAY = 100
PHILLY_USERS = 8
REPORT = Path("benchmarks/reports/fairness_heterogeneity.md")
FIGURES = Path("benchmarks/reports/fairness_heterogeneity")

POLICIES: dict[str, Callable[[], Policy]] = {
    "gandiva-fair": lambda: GandivaFairPolicy(costs=COSTS),
    "gandiva-fair (no trading)": lambda: GandivaFairPolicy(trading=False, costs=COSTS),
    "gandiva-fair (spill)": lambda: GandivaFairPolicy(spill=True, costs=COSTS),
    "afs-p": lambda: AFSP(),
    "max-min": lambda: MaxMin(),
    "afs-het": lambda: HeteroAFS(),
}


class Run:
    """One simulation and what is read back from its log."""

    def __init__(self, label: str, jobs: Sequence[TraceJob], policy: Policy) -> None:
        users = sorted({j.spec.user for j in jobs})
        cfg = SimConfig(
            cluster=CLUSTER, gpus_per_node=GPUS_PER_NODE, users=dict.fromkeys(users, 100), costs=COSTS
        )
        t0 = time.perf_counter()
        sim = Simulator(jobs, policy, cfg, trace=label)
        self.result: SimResult = sim.run()
        self.wall_s = time.perf_counter() - t0
        self.label = label
        self.users = users
        self.owner = {j.job_id: j.spec.user for j in jobs}
        end = self.result.summary["makespan_s"]
        self.timeline: Timeline = build_timeline(
            sim.log.envelopes, {j.job_id: j.throughput_by_type for j in jobs}, end=end
        )
        self.trades = self.result.event_counts.get("trade.executed", 0)
        self.undone = self.result.event_counts.get("trade.undone", 0)
        self.trade_log = trade_log(sim.log.envelopes)

    def finish_h(self) -> dict[str, float]:
        """Completion time of each user's last job, hours."""
        out: dict[str, float] = {}
        for o in self.result.jobs:
            u = self.owner[o.job_id]
            done = math.inf if o.completion_s is None else o.completion_s
            out[u] = max(out.get(u, 0.0), done / 3600.0)
        return out

    def fairness(self, start: float = 0.0, stop: float | None = None) -> list[UserFairness]:
        return user_fairness(self.timeline, start, stop, window_s=SHARE_WINDOW_S)


def trade_log(envelopes: Sequence[Envelope]) -> list[dict[str, Any]]:
    """Every executed trade of a run with when it was made and when (and why) undone."""
    out: dict[str, dict[str, Any]] = {}
    for env in envelopes:
        e = env.event
        if isinstance(e, TradeExecuted):
            out[e.trade_id] = {
                "trade_id": e.trade_id,
                "at_s": env.at,
                "buyer": e.buyer,
                "seller": e.seller,
                "fast_type": e.fast_type,
                "slow_type": e.slow_type,
                "fast_gpus": e.fast_gpus,
                "slow_gpus": e.slow_gpus,
                "price": e.price,
                "undone_at_s": None,
                "undone_reason": "",
            }
        elif isinstance(e, TradeUndone) and e.trade_id in out:
            out[e.trade_id]["undone_at_s"] = env.at
            out[e.trade_id]["undone_reason"] = e.reason
    return list(out.values())


def weighted(fs: Sequence[UserFairness], key: str) -> float:
    """A per-user metric averaged over users, weighted by their active time."""
    total = sum(f.active_s for f in fs)
    return sum(getattr(f, key) * f.active_s for f in fs) / total if total else 0.0


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index (1 = all equal)."""
    values = [v for v in values if v > 0]
    if not values:
        return 0.0
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def fmt(x: float, digits: int = 2) -> str:
    return "∞" if math.isinf(x) else f"{x:.{digits}f}"


# ---------------------------------------------------------------------------
# Part 1 and 2: §5.5
# ---------------------------------------------------------------------------


def section55(resnet_source: str, jobs_per_user: int) -> tuple[Run, Run]:
    jobs = section55_workload(jobs_per_user=jobs_per_user, resnet_source=resnet_source)
    plain = Run(f"s55-{resnet_source}-no-trading", jobs, GandivaFairPolicy(trading=False, costs=COSTS))
    traded = Run(f"s55-{resnet_source}-trading", jobs, GandivaFairPolicy(trading=True, costs=COSTS))
    return plain, traded


def section55_table(plain: Run, traded: Run, resnet_source: str) -> tuple[list[str], dict[str, Any]]:
    curves = section55_curves(resnet_source)
    before = {f.user: f for f in plain.fairness(0.0, WINDOW_S)}
    after = {f.user: f for f in traded.fairness(0.0, WINDOW_S)}
    fin_a, fin_b = plain.finish_h(), traded.finish_h()
    lines = [
        "| user | jobs | V100/K80 | P100/K80 | progress 0-4 h, no trading (K80-h) | with trading (K80-h) "
        "| ratio | all jobs done, no trading (h) | with trading (h) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    data: dict[str, Any] = {}
    for u in SECTION55_USERS:
        k = SECTION55_SIZES[u]
        c = curves[u]
        v_sp = c["v100"].throughput[k] / c["k80"].throughput[k]
        p_sp = c["p100"].throughput[k] / c["k80"].throughput[k]
        a, b = before[u].progress_k80_h, after[u].progress_k80_h
        ratio = b / a if a > 0 else math.inf
        model = "SuperResolution" if u == "U4" else "ResNet-50"
        lines.append(
            f"| {u} | {k}-GPU {model} | {v_sp:.2f} | {p_sp:.2f} | {a:.1f} | {b:.1f} | {ratio:.3f} | "
            f"{fmt(fin_a[u])} | {fmt(fin_b[u])} |"
        )
        data[u] = {
            "v100_speedup": v_sp,
            "p100_speedup": p_sp,
            "progress_no_trading_k80_h": a,
            "progress_trading_k80_h": b,
            "ratio": ratio,
            "finish_no_trading_h": fin_a[u],
            "finish_trading_h": fin_b[u],
        }
    ta = sum(before[u].progress_k80_h for u in SECTION55_USERS)
    tb = sum(after[u].progress_k80_h for u in SECTION55_USERS)
    lines.append(
        f"| all | | | | {ta:.1f} | {tb:.1f} | {tb / ta:.3f} | {fmt(max(fin_a.values()))} | "
        f"{fmt(max(fin_b.values()))} |"
    )
    data["all"] = {"progress_no_trading_k80_h": ta, "progress_trading_k80_h": tb, "ratio": tb / ta}
    data["trade_log"] = traded.trade_log
    data["trades_executed"] = traded.trades
    data["trades_undone"] = traded.undone
    return lines, data


def per_gpu_rates(resnet_source: str) -> dict[str, dict[str, float]]:
    """User -> generation -> normalised K80s per GPU at the user's job size (true curves)."""
    curves = section55_curves(resnet_source)
    out: dict[str, dict[str, float]] = {}
    for u in SECTION55_USERS:
        k = SECTION55_SIZES[u]
        base = curves[u]["k80"].throughput[k]
        out[u] = {g: curves[u][g].throughput[k] / base for g in CLUSTER}
    return out


def time_to_progress(tl: Timeline, user: str, amount: float) -> float:
    """When ``user``'s cumulative normalised progress (K80-seconds) first reaches ``amount``."""
    done = 0.0
    for i, (t0, d) in enumerate(zip(tl.t, tl.durations(), strict=True)):
        r = tl.rate[user][i]
        if r > 0 and done + r * d >= amount:
            return t0 + (amount - done) / r
        done += r * d
    return math.inf


def trading_explanation(plain: Run, traded: Run, resnet_source: str) -> tuple[list[str], dict[str, Any]]:
    """Why a user does or does not gain in the 0-4 h window, from the two runs' data.

    Two effects are separated: (a) the window can only show a gain for a user that
    still has work left at 4 h without trading (progress is bounded by the user's
    total work), and (b) what the terms of each trade are worth to each side at the
    true per-generation speedups (the second price decides how the surplus is split).
    """
    rates = per_gpu_rates(resnet_source)
    hours = int(WINDOW_S // 3600)
    a, b = plain.timeline, traded.timeline
    users: dict[str, Any] = {}
    for u in SECTION55_USERS:
        total = a.integral(a.rate[u])
        in_a, in_b = a.integral(a.rate[u], 0.0, WINDOW_S), b.integral(b.rate[u], 0.0, WINDOW_S)
        hourly = []
        for h in range(hours):
            pa = a.integral(a.rate[u], h * 3600.0, (h + 1) * 3600.0)
            pb = b.integral(b.rate[u], h * 3600.0, (h + 1) * 3600.0)
            hourly.append(pb / pa if pa > 0 else math.inf)
        users[u] = {
            "total_work_k80_h": total / 3600,
            "done_by_window_no_trading": in_a / total if total else 0.0,
            "done_by_window_trading": in_b / total if total else 0.0,
            "window_ratio_cap": total / in_a if in_a else math.inf,
            "hourly_ratio": hourly,
            "hourly_vs_entitlement_no_trading": [
                a.integral(a.rate[u], h * 3600.0, (h + 1) * 3600.0)
                / max(1e-9, a.integral(a.entitled_rate[u], h * 3600.0, (h + 1) * 3600.0))
                for h in range(hours)
            ],
            "hourly_vs_entitlement_trading": [
                b.integral(b.rate[u], h * 3600.0, (h + 1) * 3600.0)
                / max(1e-9, b.integral(b.entitled_rate[u], h * 3600.0, (h + 1) * 3600.0))
                for h in range(hours)
            ],
            "t90_no_trading_h": time_to_progress(a, u, 0.9 * total) / 3600,
            "t90_trading_h": time_to_progress(b, u, 0.9 * total) / 3600,
            "bought": [],
            "sold": [],
            "terms_gain_k80_h": 0.0,
        }
    trades = []
    for t in traded.trade_log:
        rb, rs = rates[t["buyer"]], rates[t["seller"]]
        gb = t["fast_gpus"] * rb[t["fast_type"]] - t["slow_gpus"] * rb[t["slow_type"]]
        gs = t["slow_gpus"] * rs[t["slow_type"]] - t["fast_gpus"] * rs[t["fast_type"]]
        until = t["undone_at_s"] if t["undone_at_s"] is not None else b.end
        in_force_h = max(0.0, min(until, WINDOW_S) - t["at_s"]) / 3600
        # The auction's next bidder below the buyer, by the true speedups.
        ranked = sorted(
            ((rates[u][t["fast_type"]] / rates[u][t["slow_type"]], u) for u in SECTION55_USERS),
            key=lambda x: (-x[0], x[1]),
        )
        below = [x for x in ranked if x[1] != t["buyer"] and x[0] <= rb[t["fast_type"]] / rb[t["slow_type"]]]
        row = {
            **t,
            "buyer_speedup": rb[t["fast_type"]] / rb[t["slow_type"]],
            "seller_speedup": rs[t["fast_type"]] / rs[t["slow_type"]],
            "next_bidder": below[0][1] if below else "",
            "next_bidder_speedup": below[0][0] if below else math.nan,
            "buyer_gain_per_h": gb,
            "seller_gain_per_h": gs,
            "in_force_in_window_h": in_force_h,
        }
        trades.append(row)
        if t["at_s"] < WINDOW_S:
            users[t["buyer"]]["bought"].append(t["trade_id"])
            users[t["seller"]]["sold"].append(t["trade_id"])
        users[t["buyer"]]["terms_gain_k80_h"] += gb * in_force_h
        users[t["seller"]]["terms_gain_k80_h"] += gs * in_force_h

    def pct(x: float) -> str:
        return f"{100 * x:.1f} %"

    lines = [
        f"Trades executed in the first {hours} h. Speedups and gains are at the true per-GPU speedups of "
        "the workload's curves (the trader itself ranks users by measured profiles); gains are in "
        "normalised K80s per hour while the trade is in force, and the buyer's share is its part of the "
        "trade's surplus (- when a side loses):",
        "",
        "| at (h) | trade | buyer gets | seller gets | buyer / seller | price | buyer's speedup "
        "| seller's speedup | buyer's gain | seller's gain | buyer's share | undone at (h) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in trades:
        if r["at_s"] >= WINDOW_S:
            continue
        undone = "" if r["undone_at_s"] is None else f"{r['undone_at_s'] / 3600:.2f} ({r['undone_reason']})"
        both = r["buyer_gain_per_h"] + r["seller_gain_per_h"]
        gains_ok = r["buyer_gain_per_h"] >= 0 and r["seller_gain_per_h"] >= 0 and both > 0
        share = f"{100 * r['buyer_gain_per_h'] / both:.0f} %" if gains_ok else "-"
        lines.append(
            f"| {r['at_s'] / 3600:.2f} | {r['trade_id']} | {r['fast_gpus']} {r['fast_type'].upper()} "
            f"| {r['slow_gpus']} {r['slow_type'].upper()} | {r['buyer']} / {r['seller']} | {r['price']:.2f} "
            f"| {r['buyer_speedup']:.2f} | {r['seller_speedup']:.2f} | {r['buyer_gain_per_h']:+.2f} "
            f"| {r['seller_gain_per_h']:+.2f} | {share} | {undone} |"
        )
    lines += [
        "",
        "Per user: total work, how much of it is done by 4 h, the largest 0-4 h ratio that work allows "
        "(total work ÷ progress by 4 h without trading), hour-by-hour progress ratios (trading ÷ no "
        "trading), when 90 % of the work is done, and what the terms of the user's trades were worth to it "
        "in the first 4 h (Σ gain × hours in force; an upper bound, it assumes the traded GPUs are kept busy):",
        "",
        "| user | total work (K80-h) | done by 4 h, no trading | with trading | most the 0-4 h ratio can be | "
        + " | ".join(f"ratio {h}-{h + 1} h" for h in range(hours))
        + " | 90 % done, no trading (h) | with trading (h) | bought in | sold in | trade terms (K80-h) |",
        "|---|---|---|---|---|" + "---|" * hours + "---|---|---|---|---|",
    ]
    for u, d in users.items():
        lines.append(
            f"| {u} | {d['total_work_k80_h']:.1f} | {pct(d['done_by_window_no_trading'])} | "
            f"{pct(d['done_by_window_trading'])} | {fmt(d['window_ratio_cap'], 3)} | "
            + " | ".join(fmt(x, 3) for x in d["hourly_ratio"])
            + f" | {fmt(d['t90_no_trading_h'])} | {fmt(d['t90_trading_h'])} | {len(d['bought'])} | "
            f"{len(d['sold'])} | {d['terms_gain_k80_h']:+.1f} |"
        )

    # The paragraph on U1 (the user the paper reports gaining ~30 % and shoal does not).
    u1 = users["U1"]
    bought = [r for r in trades if r["buyer"] == "U1" and r["at_s"] < WINDOW_S]
    sold = [r for r in trades if r["seller"] == "U1" and r["at_s"] < WINDOW_S]
    hourly_text = ", ".join(
        f"{h}-{h + 1} h {fmt(x, 2)}" for h, x in enumerate(u1["hourly_ratio"]) if not math.isinf(x)
    )
    capped = u1["window_ratio_cap"] <= BOUND_CAP
    para = [
        f"**Why U1 {'gains nothing' if capped else 'gains little or nothing'} in the 0-4 h window.** "
        f"U1's jobs total {u1['total_work_k80_h']:.1f} K80-h (the workload sets the job length so that U1 "
        "alone finishes in 4 h at its untraded share). "
        f"Without trading U1 has done {pct(u1['done_by_window_no_trading'])} of that by 4 h, "
        + (
            f"so no trade can raise its 0-4 h progress by more than ×{fmt(u1['window_ratio_cap'], 3)}: a "
            "faster U1 only finishes its work earlier inside the window. "
            if capped
            else f"so its work would allow a 0-4 h ratio of up to ×{fmt(u1['window_ratio_cap'], 3)} "
            f"(measured ×{g_ratio(plain, traded, 'U1'):.3f}). "
        )
        + f"Hour by hour, U1's progress with trading ÷ without is {hourly_text}; it has done 90 % of its work at "
        f"{fmt(u1['t90_trading_h'])} h with trading and {fmt(u1['t90_no_trading_h'])} h without. "
        "Its progress ÷ its untraded entitlement, hour by hour, is "
        + ", ".join(f"{x:.2f}" for x in u1["hourly_vs_entitlement_no_trading"])
        + " without trading and "
        + ", ".join(f"{x:.2f}" for x in u1["hourly_vs_entitlement_trading"])
        + " with trading"
        + (
            ": above 1 without trading, U1 is running on share other users' gangs leave idle; with "
            "trading those users buy GPUs they can use and that spare share shrinks. "
            if max(u1["hourly_vs_entitlement_no_trading"], default=0.0) > 1.05
            else ". "
        )
    ]
    if bought:
        surplus_b = sum(r["buyer_gain_per_h"] for r in bought)
        surplus_s = sum(r["seller_gain_per_h"] for r in bought)
        share = pct(surplus_b / (surplus_b + surplus_s)) if surplus_b + surplus_s > 0 else "-"
        para.append(
            f"In the first 4 h U1 bought in {len(bought)} trades ({', '.join(r['trade_id'] for r in bought)}) "
            f"and sold in {len(sold)}{' (' + ', '.join(r['trade_id'] for r in sold) + ')' if sold else ''}. "
            f"Of the surplus of its purchases ({surplus_b + surplus_s:.2f} normalised K80s per hour at the "
            f"true speedups) U1 keeps {surplus_b:.2f} ({share}) and its sellers "
            f"({', '.join(sorted({r['seller'] for r in bought}))}) get the rest. "
        )
        vk = [r for r in bought if r["fast_type"] == "v100" and r["slow_type"] == "k80"]
        if vk:
            r = vk[0]
            para.append(
                "The second price is the next bidder's speedup, and U1's nearest rival is another ResNet-50 "
                f"user: by the true curves the next V100/K80 speedup below U1's {r['buyer_speedup']:.2f} is "
                f"{r['next_bidder']}'s {r['next_bidder_speedup']:.2f}, and U1 paid {r['price']:.2f} K80 per "
                f"V100 to {r['seller']}, whose own speedup is {r['seller_speedup']:.2f}. "
                if r["next_bidder"] in ("U2", "U3")
                else f"U1 paid {r['price']:.2f} K80 per V100 to {r['seller']}, whose own V100/K80 speedup is "
                f"{r['seller_speedup']:.2f}. "
            )
        para.append(
            f"Over the first 4 h the terms of U1's trades were worth {u1['terms_gain_k80_h']:+.1f} K80-h to U1 "
            f"and {sum(r['seller_gain_per_h'] * r['in_force_in_window_h'] for r in bought):+.1f} K80-h to "
            "its sellers."
        )
    else:
        para.append("U1 bought nothing in the first 4 h.")
    u4 = users["U4"]
    all_terms = sum(max(0.0, d["terms_gain_k80_h"]) for d in users.values())
    u4_share = f" ({pct(u4['terms_gain_k80_h'] / all_terms)} of all users' gains)" if all_terms > 0 else ""
    text = [
        "",
        "".join(para),
        "",
        f"U4, in contrast, sold fast GPUs in {len(u4['sold'])} trades and bought in {len(u4['bought'])} in the "
        f"first 4 h; the terms were worth {u4['terms_gain_k80_h']:+.1f} K80-h to it{u4_share}. It has done "
        f"{pct(u4['done_by_window_no_trading'])} of its work by 4 h without trading, so the window can show "
        f"up to ×{fmt(u4['window_ratio_cap'], 3)} (measured ×{g_ratio(plain, traded, 'U4'):.3f}).",
        "",
        "The paper's Figure 8 plots each user's mini-batch *rate* over time, not progress in a window bounded "
        "by the user's remaining work. Its Figure 9 lists user1 buying V100s at 1.71 and 1.94 K80 per V100, "
        "far below a ResNet-50 job's V100/K80 speedup (5.14 in its Table 1), so there user1 kept most of "
        "each trade's surplus; a second price set by another ResNet-50 user leaves the buyer little of it.",
    ]
    lines += text
    return lines, {"users": users, "trades": trades}


def table1_note(d: dict[str, Any]) -> str:
    """One sentence on U1's window bound with Table 1 speedups (see :func:`trading_explanation`)."""
    u1 = d["explanation"]["users"]["U1"]
    return (
        f"{'Here too U1' if u1['window_ratio_cap'] <= BOUND_CAP else 'U1'} has done {100 * u1['done_by_window_no_trading']:.1f} % of its work by 4 h without "
        f"trading, so its 0-4 h ratio can be at most ×{fmt(u1['window_ratio_cap'], 3)} (measured "
        f"{d['U1']['ratio']:.3f}); it reaches 90 % of its work at {fmt(u1['t90_trading_h'])} h with trading "
        f"instead of {fmt(u1['t90_no_trading_h'])} h."
    )


def g_ratio(plain: Run, traded: Run, user: str) -> float:
    """A user's 0-4 h progress with trading ÷ without."""
    a, b = plain.timeline, traded.timeline
    pa = a.integral(a.rate[user], 0.0, WINDOW_S)
    return b.integral(b.rate[user], 0.0, WINDOW_S) / pa if pa > 0 else math.inf


def fairness_rows(run: Run, label: str, stop: float | None = None) -> list[str]:
    rows = []
    for f in run.fairness(0.0, stop):
        rows.append(
            f"| {label} | {f.user} | {f.active_s / 3600:.2f} | {100 * f.share_deviation:.2f} | "
            f"{100 * f.shortfall:.2f} | {f.mean_share:.3f} | {f.progress_ratio:.3f} |"
        )
    return rows


# ---------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------


def plot_section55(plain: Run, traded: Run, path: Path) -> list[str]:
    """Per-user normalised rate (Fig. 8) and held GPUs against the fair share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    end = max(plain.timeline.end, traded.timeline.end)
    # 10-minute means: a time-sliced user's rate swings every quantum.
    edges = [i * SHARE_WINDOW_S for i in range(int(end // SHARE_WINDOW_S) + 1)]
    mids = [(a + SHARE_WINDOW_S / 2) / 3600 for a in edges]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, run, title in ((axes[0], plain, "no trading"), (axes[1], traded, "trading")):
        tl = run.timeline
        for u in tl.users:
            rate = [tl.integral(tl.rate[u], a, a + SHARE_WINDOW_S) / SHARE_WINDOW_S for a in edges]
            ent = [tl.integral(tl.entitled_rate[u], a, a + SHARE_WINDOW_S) / SHARE_WINDOW_S for a in edges]
            ax.plot(mids, rate, label=f"{u} received")
            ax.plot(mids, ent, linestyle=":", color=ax.lines[-1].get_color())
        ax.set_title(f"§5.5 {title}: normalised rate, 10-min mean (dotted: entitlement)", fontsize=10)
        ax.set_xlabel("hours")
    axes[0].set_ylabel("normalised K80s")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out = path / "s55_rate.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    written.append(out.name)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, run, title in ((axes[0], plain, "no trading"), (axes[1], traded, "trading")):
        tl = run.timeline
        # 10-minute averages of held GPUs, as the deviation metric compares them.
        for u in tl.users:
            held = [tl.integral(tl.held[u], a, a + SHARE_WINDOW_S) / SHARE_WINDOW_S for a in edges]
            fair = [tl.integral(tl.fair[u], a, a + SHARE_WINDOW_S) / SHARE_WINDOW_S for a in edges]
            ax.plot(mids, held, label=f"{u} held")
            ax.plot(mids, fair, linestyle=":", color=ax.lines[-1].get_color())
        ax.set_title(f"§5.5 {title}: GPUs held, 10-min mean (dotted: fair share)", fontsize=10)
        ax.set_xlabel("hours")
    axes[0].set_ylabel("GPUs")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out = path / "s55_share.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    written.append(out.name)
    return written


def plot_tradeoff(points: dict[str, list[tuple[float, float, float]]], path: Path) -> str:
    """Average JCT against share deviation and against shortfall, one point per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for name, pts in points.items():
        axes[0].scatter([p[0] for p in pts], [p[2] for p in pts], label=name)
        axes[1].scatter([p[1] for p in pts], [p[2] for p in pts], label=name)
    axes[0].set_xlabel("share deviation from fair share, % of cluster (10-min windows)")
    axes[1].set_xlabel("shortfall below fair share, % of cluster (10-min windows)")
    axes[0].set_ylabel("average JCT (h)")
    axes[0].set_title("Philly slice, one point per seed", fontsize=10)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    out = path / "philly_fairness_vs_jct.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out.name


def user_matrix(jobs: Sequence[TraceJob], fair: dict[str, dict[str, UserFairness]]) -> list[str]:
    """Users × policies: shortfall and progress/entitlement."""
    counts: dict[str, int] = {}
    gpus: dict[str, int] = {}
    model: dict[str, str] = {}
    for j in jobs:
        counts[j.spec.user] = counts.get(j.spec.user, 0) + 1
        gpus[j.spec.user] = gpus.get(j.spec.user, 0) + j.spec.requested_gpus
        model[j.spec.user] = j.spec.model
    names = list(fair)
    lines = [
        "| user | jobs | requested GPUs | model | " + " | ".join(names) + " |",
        "|---|---|---|---|" + "---|" * len(names),
    ]
    for u in sorted(counts, key=lambda u: -counts[u]):
        cells = []
        for name in names:
            f = fair[name].get(u)
            cells.append("" if f is None else f"{100 * f.shortfall:.2f} / {f.progress_ratio:.2f}")
        lines.append(f"| {u} | {counts[u]} | {gpus[u]} | {model[u]} | " + " | ".join(cells) + " |")
    return lines


def plot_shortfall(timelines: dict[str, Timeline], path: Path) -> str:
    """Summed shortfall of all users (10-min windows) over time, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, tl in timelines.items():
        total: dict[int, float] = {}
        for u in tl.users:
            for w, (_, held, fair) in windows(tl, u, window_s=SHARE_WINDOW_S).items():
                total[w] = total.get(w, 0.0) + max(0.0, fair - held) / SHARE_WINDOW_S
        xs = sorted(total)
        ax.plot(
            [(w + 0.5) * SHARE_WINDOW_S / 3600 for w in xs],
            [100 * total[w] / tl.total_gpus for w in xs],
            label=name,
        )
    ax.set_xlabel("hours")
    ax.set_ylabel("Σ users' shortfall, % of cluster")
    ax.set_title("Philly slice: GPUs users are short of their fair share")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = path / "philly_shortfall.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out.name


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small workloads (smoke test)")
    parser.add_argument("--seeds", default="0,1,2", help="seeds of the Philly user/model draw")
    parser.add_argument(
        "--jobs-per-user", type=int, default=None, help="§5.5 jobs per user (default 150, 30 with --quick)"
    )
    parser.add_argument(
        "--days", type=float, default=None, help="days of the Philly slice (default 1, 0.25 with --quick)"
    )
    parser.add_argument("--out", type=Path, default=REPORT)
    parser.add_argument("--figures", type=Path, default=FIGURES)
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    jobs_per_user = args.jobs_per_user or (30 if args.quick else 150)
    days = args.days or (0.25 if args.quick else 1.0)
    args.figures.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    data: dict[str, Any] = {"section55": {}, "philly": {}}

    # 1-2. §5.5
    s55: dict[str, tuple[Run, Run]] = {}
    for source in ("gavel", "table1"):
        s55[source] = section55(source, jobs_per_user)
    tables = {}
    explained: dict[str, list[str]] = {}
    for source, (plain, traded) in s55.items():
        tables[source], data["section55"][source] = section55_table(plain, traded, source)
        explained[source], data["section55"][source]["explanation"] = trading_explanation(
            plain, traded, source
        )
    figures = plot_section55(*s55["gavel"], args.figures)

    # 3. Philly fairness vs JCT
    philly_rows: list[str] = []
    first_fair: dict[str, dict[str, UserFairness]] = {}
    first_timelines: dict[str, Timeline] = {}
    first_jobs: Sequence[TraceJob] = ()
    per_policy: dict[str, list[dict[str, float]]] = {name: [] for name in POLICIES}
    workloads_desc: list[str] = []
    for seed in seeds:
        jobs = philly_users_workload(PHILLY_VC, day=PHILLY_DAY, days=days, users=PHILLY_USERS, seed=seed)
        counts: dict[str, int] = {}
        models: dict[str, str] = {}
        for j in jobs:
            counts[j.spec.user] = counts.get(j.spec.user, 0) + 1
            models[j.spec.user] = j.spec.model
        workloads_desc.append(
            f"- seed {seed}: {len(jobs)} jobs; "
            + ", ".join(f"{u} {counts[u]} × {models[u]}" for u in sorted(counts, key=lambda u: -counts[u]))
        )
        for name, make in POLICIES.items():
            run = Run(f"philly-{seed}-{name}", jobs, make())
            fs = run.fairness()
            s = run.result.summary
            row = {
                "seed": seed,
                "avg_jct_h": s["avg_jct_s"] / 3600,
                "median_jct_h": s["median_jct_s"] / 3600,
                "p99_jct_h": s["p99_jct_s"] / 3600,
                "makespan_h": s["makespan_s"] / 3600,
                "utilisation": s["gpu_utilisation"],
                "share_deviation": weighted(fs, "share_deviation"),
                "shortfall": weighted(fs, "shortfall"),
                "worst_shortfall": max(f.shortfall for f in fs),
                "worst_progress_ratio": min(f.progress_ratio for f in fs),
                "jain_progress_ratio": jain([f.progress_ratio for f in fs]),
                "trades": float(run.trades),
                "wall_s": run.wall_s,
            }
            per_policy[name].append(row)
            philly_rows.append(
                f"| {seed} | {name} | {row['avg_jct_h']:.2f} | {row['median_jct_h']:.2f} | "
                f"{row['p99_jct_h']:.1f} | {row['makespan_h']:.1f} | {100 * row['utilisation']:.1f} | "
                f"{100 * row['share_deviation']:.2f} | {100 * row['shortfall']:.2f} | "
                f"{100 * row['worst_shortfall']:.2f} | "
                f"{row['worst_progress_ratio']:.3f} | {row['jain_progress_ratio']:.3f} | {run.trades} |"
            )
            if seed == seeds[0]:
                first_fair[name] = {f.user: f for f in fs}
                first_timelines[name] = run.timeline
                first_jobs = jobs
    data["philly"] = per_policy

    def mean(name: str, key: str) -> float:
        rows = per_policy[name]
        return sum(r[key] for r in rows) / len(rows)

    summary_rows = []
    for name in POLICIES:
        summary_rows.append(
            f"| {name} | {mean(name, 'avg_jct_h'):.2f} | {mean(name, 'p99_jct_h'):.1f} | "
            f"{mean(name, 'makespan_h'):.1f} | {100 * mean(name, 'utilisation'):.1f} | "
            f"{100 * mean(name, 'share_deviation'):.2f} | {100 * mean(name, 'shortfall'):.2f} | "
            f"{100 * mean(name, 'worst_shortfall'):.2f} | "
            f"{mean(name, 'worst_progress_ratio'):.3f} | {mean(name, 'jain_progress_ratio'):.3f} |"
        )

    def ratio_line(a: str, b: str, key: str, what: str) -> str:
        per_seed = [
            ra[key] / rb[key] if rb[key] else math.nan
            for ra, rb in zip(per_policy[a], per_policy[b], strict=True)
        ]
        return (
            f"- {what}: {a} / {b} = "
            + ", ".join(f"{r:.3f}" for r in per_seed)
            + f" (seeds {', '.join(map(str, seeds))}; mean {sum(per_seed) / len(per_seed):.3f})"
        )

    comparisons = [
        ratio_line("afs-het", "afs-p", "avg_jct_h", "average JCT"),
        ratio_line("afs-het", "afs-p", "makespan_h", "makespan"),
        ratio_line("afs-het", "afs-p", "share_deviation", "share deviation"),
        ratio_line("afs-het", "afs-p", "shortfall", "shortfall"),
        ratio_line("afs-het", "gandiva-fair", "avg_jct_h", "average JCT"),
        ratio_line("afs-het", "gandiva-fair", "share_deviation", "share deviation"),
        ratio_line("afs-het", "gandiva-fair", "shortfall", "shortfall"),
        ratio_line("gandiva-fair", "afs-p", "avg_jct_h", "average JCT"),
        ratio_line("gandiva-fair", "afs-p", "share_deviation", "share deviation"),
        ratio_line("gandiva-fair", "afs-p", "shortfall", "shortfall"),
        ratio_line("gandiva-fair", "gandiva-fair (no trading)", "avg_jct_h", "average JCT"),
        ratio_line("gandiva-fair (spill)", "gandiva-fair", "avg_jct_h", "average JCT"),
        ratio_line("gandiva-fair (spill)", "gandiva-fair", "shortfall", "shortfall"),
        ratio_line("gandiva-fair (spill)", "gandiva-fair", "utilisation", "GPU utilisation"),
        ratio_line("max-min", "afs-p", "avg_jct_h", "average JCT"),
    ]
    points = {
        name: [(100 * r["share_deviation"], 100 * r["shortfall"], r["avg_jct_h"]) for r in rows]
        for name, rows in per_policy.items()
    }
    figures.append(plot_tradeoff(points, args.figures))
    figures.append(plot_shortfall(first_timelines, args.figures))
    fair_rows = user_matrix(first_jobs, first_fair)

    g = data["section55"]["gavel"]
    gained = [u for u in SECTION55_USERS if g[u]["ratio"] >= 1.2]
    wall = time.perf_counter() - started
    command = "python benchmarks/fairness_heterogeneity.py" + (" --quick" if args.quick else "")
    if args.seeds != "0,1,2":
        command += f" --seeds {args.seeds}"
    if args.jobs_per_user:
        command += f" --jobs-per-user {args.jobs_per_user}"
    if args.days:
        command += f" --days {args.days:g}"
    fair_header = [
        "| run | user | active (h) | share deviation (% of cluster) | shortfall (% of cluster) | "
        "mean held / fair | progress / entitlement |",
        "|---|---|---|---|---|---|---|",
    ]
    plain, traded = s55["gavel"]
    report = [
        "# Gandiva_fair on heterogeneous GPUs: trading, fair-share distance, fairness vs JCT",
        "",
        f"Command: `{command}` (wall time {wall:.0f} s; machine {platform.machine()}, "
        f"Python {platform.python_version()}, shared with other jobs). Every number below is computed by "
        "that command from simulator runs; the raw numbers are in "
        f"`{args.figures.name}/results.json`.",
        "",
        "## Setup",
        "",
        f"- Cluster: {CLUSTER['k80']} K80 + {CLUSTER['p100']} P100 + {CLUSTER['v100']} V100, "
        f"servers of {GPUS_PER_NODE} GPUs of one generation (`SimConfig.cluster`), placement on. "
        "Every user holds 100 tickets (`SimConfig.users`).",
        f"- Reconfiguration costs (`{COSTS.name}`, Gandiva_fair's own): start/resume {COSTS.start_s} s, "
        f"migration {COSTS.migrate_s} s and a move to disjoint GPUs (checkpoint-restart) "
        f"{COSTS.restart_s} s (Gandiva_fair §4: suspend/resume 100-250 ms, migration hidden by preload), "
        f"scale-out/in {COSTS.scale_out_s} s (CoDDL §4.3). The same model for every policy.",
        "- Policies, all called by the simulator through the `Policy` interface: `GandivaFairPolicy` "
        "(`shoal.fairness.policy`, 60 s quantum, trading on or off; `spill` hands out capacity that "
        "newest-first entitlements leave idle, `shoal.fairness.shares.spill_leftover`, off by default), `AFSP` (`shoal.policies.afs`, 2 h "
        "leases; it names no GPU generation, so the placer puts its jobs anywhere and a gang spread over "
        "generations runs at the slowest one's rate), `MaxMin` (`shoal.policies.maxmin`, same) and "
        "`HeteroAFS` (`shoal.policies.afs_hetero`: AFS-P's eq. (3) per generation, trading across "
        "generations).",
        "- Normalised K80s (Gandiva_fair Table 3): a job on k GPUs of generation g progresses at "
        "k · thr_g(k) / thr_K80(k). Progress is the integral of that rate over the allocation "
        "(`shoal.fairness.timeline`), reconfiguration stops not subtracted.",
        "",
        f"## 1. Gandiva_fair §5.5: 4 users × {jobs_per_user} jobs, with and without trading",
        "",
        "Workload (`shoal.fairness.workloads.section55_workload`): U1 1-GPU, U2 2-GPU, U3 4-GPU ResNet-50 "
        "with Gavel's measured per-generation curves (`ResNet-50 (batch size 64)`), U4 1-GPU SuperResolution "
        "with the paper's Table 1 speedups; all jobs submitted at t = 0. Every job needs the same time on its "
        "gang of K80s, set so that U1 alone at its untraded fair share (3 V100 + 6 P100 + 16 K80) finishes "
        "in 4 h (§5.4 reports U1 finishing at about 4 h).",
        "",
        "Gavel curves (default):",
        "",
        *tables["gavel"],
        "",
        f"Trades executed: {g['trades_executed']}; undone: {g['trades_undone']}. "
        f"Simulated in {plain.wall_s:.1f} s (no trading) and {traded.wall_s:.1f} s (trading).",
        "",
        "The paper reports about 30 % more mini-batch progress for users 1 and 4 with trading. Measured "
        f"ratios here: U1 {g['U1']['ratio']:.3f}, U4 {g['U4']['ratio']:.3f}; users with at least 20 % more "
        f"progress in the first 4 h: {', '.join(gained) if gained else 'none'}; whole cluster "
        f"{g['all']['ratio']:.3f}.",
        "",
        *explained["gavel"],
        "",
        "Table 1 speedups for every ResNet-50 user (3.34× P100, 5.14× V100 at every size) instead:",
        "",
        *tables["table1"],
        "",
        f"Trades executed: {data['section55']['table1']['trades_executed']}; undone: "
        f"{data['section55']['table1']['trades_undone']}. " + table1_note(data["section55"]["table1"]),
        "",
        f"Figures: `{args.figures.name}/s55_rate.png` (per-user normalised rate against the entitlement, "
        f"as the paper's Figure 8) and `{args.figures.name}/s55_share.png` (GPUs held against the fair share).",
        "",
        "## 2. Distance from fair share over time",
        "",
        "Per user, over the time it has active jobs (`shoal.fairness.timeline.user_fairness`):",
        "",
        "- *Share deviation*: |GPUs held − fair share| / cluster GPUs, with both averaged over "
        f"{SHARE_WINDOW_S / 60:.0f}-minute windows. Time-slicing gives a gang all or nothing in each "
        "quantum, so comparing instant by instant would measure the quantum, not the fairness.",
        "- *Fair share*: ticket-weighted water-filling of all 100 GPUs over the active users, each capped by "
        "the GPUs its active jobs request (Gandiva_fair §2.1).",
        "- *Shortfall*: the part of that deviation below the fair share, max(0, fair − held) / cluster GPUs. "
        "Holding more than the fair share while nobody else wants the GPUs is not unfair; the shortfall "
        "is what a user loses to others.",
        "- *Mean held / fair*: the time average of that ratio.",
        "- *Progress / entitlement*: normalised progress divided by what the user's untraded "
        "per-generation entitlement (newest generation first) would have given its jobs.",
        "",
        "§5.5 (Gavel curves), whole run:",
        "",
        *fair_header,
        *fairness_rows(plain, "no trading"),
        *fairness_rows(traded, "trading"),
        "",
        f"Philly slice (part 3), seed {seeds[0]}: shortfall (% of cluster) / progress ÷ entitlement, per user "
        "and policy:",
        "",
        *fair_rows,
        "",
        f"Figure: `{args.figures.name}/philly_shortfall.png` (summed shortfall of all users over time, "
        f"seed {seeds[0]}).",
        "",
        "## 3. Fairness vs JCT on a heterogeneous Philly run",
        "",
        f"Jobs: Philly VC {PHILLY_VC}, submissions of day {PHILLY_DAY} to {PHILLY_DAY + days:g} of the VC "
        "(`shoal.fairness.workloads.philly_users_workload`), arrivals shifted to start at 0. The trace has no "
        f"users, so {PHILLY_USERS} users are synthesised. A sweep is a run of consecutive submissions with "
        "the same GPU request, each within 60 s of the previous one. Each sweep goes to a user drawn with "
        "Zipf(1) weights. Each user trains one Gavel model family measured up to 8 GPUs on all three "
        "generations. Requests are capped at 8 GPUs, and a job runs its trace duration at its request on "
        "P100s. Jobs are elastic from 1 to 8 GPUs for AFS-P, Max-Min and HeteroAFS; Gandiva_fair runs "
        "each at its request. Seeds draw the users and models:",
        "",
        *workloads_desc,
        "",
        "Mean over seeds:",
        "",
        "| policy | avg JCT (h) | p99 JCT (h) | makespan (h) | GPU utilisation (%) | share deviation (%) "
        "| shortfall (%) | worst user's shortfall (%) | worst user's progress/entitlement "
        "| Jain index of progress/entitlement |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *summary_rows,
        "",
        "Per seed:",
        "",
        "| seed | policy | avg JCT (h) | median JCT (h) | p99 JCT (h) | makespan (h) | GPU utilisation (%) "
        "| share deviation (%) | shortfall (%) | worst shortfall (%) | worst progress/entitlement | Jain "
        "| trades |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *philly_rows,
        "",
        "Ratios, each between runs on the same jobs:",
        "",
        *comparisons,
        "",
        f"Figure: `{args.figures.name}/philly_fairness_vs_jct.png`.",
        "",
    ]
    data["wall_s"] = wall
    (args.figures / "results.json").write_text(json.dumps(data, indent=1, sort_keys=True, default=str))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(report))
    sys.stdout.write("\n".join(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
