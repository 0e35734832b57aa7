"""
The chaos report
================

:func:`build_report` turns a :class:`~ftdist.chaos.supervisor.ChaosRecord`
(and the leak check) into one JSON-ready document; :func:`render_text`
prints its figures as a table:

* steps committed by the job, and step attempts against commits per group;
* per injection kind: how many struck, the worst and median time to
  recover (from the fault's end, or for the control-plane kinds from the
  strike, until every group committed a step with every group again) and
  the longest stall (the longest time in which the job committed nothing,
  from the strike to the recovery);
* divergence: the final state hash of every trainer, which must be equal
  for each group rank across groups, at one step;
* hangs (a running trainer silent past the bound, or one that did not exit
  after its final report), unexpected exits, leaked processes;
* quorum ids (:func:`ftdist.chaos.quorums.check`): no step committed under
  two quorums of one id (nor, with a replicated lighthouse, one id naming
  two memberships).

The verdict passes only when there is no divergence, no hang, no leak, no
unexpected exit, no quorum-id conflict, no control-plane process that could
not be struck or brought back, and every injection recovered.
"""

from __future__ import annotations

import itertools
import statistics
from typing import TYPE_CHECKING, Any

from ftdist.chaos import schedule

if TYPE_CHECKING:
    from ftdist.chaos.supervisor import ChaosRecord


def longest_stall(commits: list[float], start: float, end: float) -> float:
    """The longest time in ``[start, end]`` with no commit (``commits`` sorted)."""
    if end <= start:
        return 0.0
    points = [start, *[t for t in commits if start < t < end], end]
    return max(b - a for a, b in itertools.pairwise(points))


def _mid_heal(entry: dict[str, Any], heals: list[dict[str, Any]]) -> dict[str, Any]:
    """How far into the heal the second kill came, and whether the transfer was cut."""
    started, struck = entry.get("heal_started"), entry.get("t2")
    if started is None or struck is None:
        return {}
    done = [
        h
        for h in heals
        if h["role"] == "receive"
        and h["group"] == entry["group"]
        and h["attempt"] == entry.get("healing_attempt")
        and h["t"] >= started
        and started + h["transfer_s"] < struck
    ]
    return {"into_heal_s": round(struck - started, 3), "transfer_cut": not done}


def _peer_cut(
    entry: dict[str, Any], commits: list[float], failed: list[tuple[float, int]], groups: int
) -> dict[str, Any]:
    """While a group was cut from its peers: did the others train on?

    ``committed_during``: steps the job committed while the cut lasted;
    ``others_failed_steps``: the most failed steps of any group that was
    not cut, in that time (the goal: at most one, the step the cut broke).
    """
    start, end = entry["t"], entry["end"]
    per_group = dict.fromkeys(range(groups), 0)
    for t, group in failed:
        if start <= t <= end and group != entry["group"]:
            per_group[group] += 1
    return {
        "committed_during": sum(start < t <= end for t in commits),
        "others_failed_steps": max(per_group.values(), default=0),
    }


def injection_rows(record: ChaosRecord) -> list[dict[str, Any]]:
    """One row per injection: what, when, and its recovery figures."""
    commits = sorted(record.commits.values())
    rows = []
    for e in record.injections:
        row = {k: e[k] for k in ("index", "kind", "group", "rank", "hold_s", "outcome", "detail")}
        row["clock_s"] = e["clock_s"]
        # The control-plane kinds' victim, and the new term (leader strikes).
        row.update({k: e[k] for k in ("replica", "member", "new_leader", "failover_s") if k in e})
        row["recover_s"] = (
            round(e["recovered"] - e["end"], 3)
            if e["recovered"] is not None and e["end"] is not None
            else None
        )
        row["stall_s"] = (
            round(longest_stall(commits, e["t"], e["recovered"]), 3)
            if e["recovered"] is not None
            else None
        )
        if e["kind"] in schedule.MID_HEAL:
            row.update(_mid_heal(e, record.heals))
        if e["kind"] in schedule.PEER_CUTS and e["outcome"] == "done" and e["end"] is not None:
            row.update(_peer_cut(e, commits, record.failed_steps, len(record.groups)))
        rows.append(row)
    return rows


def by_kind(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind: count, worst and median recovery and stall (done injections only)."""
    out: dict[str, dict[str, Any]] = {}
    for kind in schedule.ALL_KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        done = [r for r in mine if r["outcome"] == "done"]
        recover = [r["recover_s"] for r in done if r["recover_s"] is not None]
        stall = [r["stall_s"] for r in done if r["stall_s"] is not None]
        out[kind] = {
            "struck": len(done),
            "skipped": sum(r["outcome"] == "skipped" for r in mine),
            "abandoned": sum(r["outcome"] == "abandoned" for r in mine),
            "unrecovered": sum(r["recover_s"] is None for r in done),
            "recover_worst_s": max(recover, default=None),
            "recover_median_s": statistics.median(recover) if recover else None,
            "stall_worst_s": max(stall, default=None),
        }
    return out


def divergence(record: ChaosRecord) -> dict[str, Any]:
    """Whether every group rank holds the same state in every group, at one step."""
    finals = {f"group{gs.group}/rank{rs.rank}": rs.final for gs in record.groups for rs in gs.ranks}
    missing = sorted(k for k, f in finals.items() if f is None)
    hashes = {k: f.hash for k, f in finals.items() if f is not None}
    steps = {k: f.step for k, f in finals.items() if f is not None}
    out: dict[str, Any] = {"hashes": hashes, "steps": steps, "ok": False}
    ranks = {k.split("/")[1] for k in finals}
    differing = sorted(
        r for r in ranks if len({h for k, h in hashes.items() if k.endswith("/" + r)}) > 1
    )
    if missing:
        out["reason"] = f"no final state from {', '.join(missing)}"
    elif len(set(steps.values())) != 1:
        out["reason"] = f"trainers stopped at different steps: {sorted(set(steps.values()))}"
    elif differing:
        out["reason"] = f"the state of {', '.join(differing)} differs between groups"
    else:
        out["ok"] = True
        out["reason"] = (
            f"every group rank holds bit-identical state in all {len(record.groups)} groups "
            f"at step {next(iter(steps.values()))}"
        )
    return out


def build_report(
    record: ChaosRecord,
    leaks: list[str],
    meta: dict[str, Any],
    quorums: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole report document.

    Args:
        record: the run.
        leaks: what outlived the run (processes, namespaces, links).
        meta: configuration and versions to include.
        quorums: the quorum-id check (:func:`ftdist.chaos.quorums.check`),
            or None when not made.
    """
    rows = injection_rows(record)
    kinds = by_kind(rows)
    div = divergence(record)
    unrecovered = [r for r in rows if r["outcome"] == "done" and r["recover_s"] is None]
    problems = []
    if not div["ok"]:
        problems.append(f"divergence: {div['reason']}")
    if record.hangs:
        problems.append(f"{len(record.hangs)} hang(s)")
    if leaks:
        problems.append(f"leaked: {', '.join(leaks)}")
    if record.unexpected_exits:
        problems.append(f"{len(record.unexpected_exits)} trainer(s) died on their own")
    if unrecovered:
        problems.append(
            "never recovered from injection(s) " + ", ".join(str(r["index"]) for r in unrecovered)
        )
    if quorums is not None and not quorums["ok"]:
        problems.append(f"quorum ids: {quorums['reason']}")
    if record.control_errors:
        problems.append(f"control plane: {'; '.join(record.control_errors)}")
    if record.interrupted:
        problems.append("interrupted")
    receives = [h for h in record.heals if h["role"] == "receive" and h["step"] > 0]
    return {
        **meta,
        "duration_s": round(record.ended - record.started, 3),
        "clock_started_s": record.clock_started_s,
        "stop_step": record.stop_step,
        "steps": {
            "job_committed": len(record.commits),
            "group_attempted": sum(gs.steps_attempted for gs in record.groups),
            "group_committed": sum(gs.steps_committed for gs in record.groups),
            "per_group": [
                {
                    "group": gs.group,
                    "processes": gs.attempt + 1,
                    "attempted": gs.steps_attempted,
                    "committed": gs.steps_committed,
                    "heals": gs.heals,
                    "served": gs.served,
                }
                for gs in record.groups
            ],
        },
        "heal_transfer": {
            "count": len(receives),
            "median_s": statistics.median(h["transfer_s"] for h in receives) if receives else None,
            "median_mb": statistics.median(h["transfer_bytes"] for h in receives) / 1e6
            if receives
            else None,
        },
        "by_kind": kinds,
        "injections": rows,
        "divergence": div,
        "hangs": record.hangs,
        "unexpected_exits": record.unexpected_exits,
        "leaks": leaks,
        "quorums": quorums,
        "control_errors": record.control_errors,
        "notes": record.notes,
        "verdict": {"ok": not problems, "problems": problems},
    }


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def figures_table(report: dict[str, Any]) -> str:
    """The headline figures as a Markdown table (what docs/chaos.md shows)."""
    steps = report["steps"]
    div = report["divergence"]
    lines = [
        "| figure | value |",
        "|---|---|",
        f"| steps committed by the job | {steps['job_committed']} |",
        f"| group steps committed / attempted | {steps['group_committed']} / "
        f"{steps['group_attempted']} "
        f"({100 * steps['group_committed'] / max(1, steps['group_attempted']):.0f} %) |",
    ]
    for kind, k in report["by_kind"].items():
        if not (k["struck"] or k["skipped"] or k["abandoned"]):
            continue
        extra = "".join(f", {k[n]} {n}" for n in ("skipped", "abandoned", "unrecovered") if k[n])
        lines.append(
            f"| {kind}: {k['struck']} struck{extra} | recover worst {_s(k['recover_worst_s'])}, "
            f"median {_s(k['recover_median_s'])}; longest stall {_s(k['stall_worst_s'])} |"
        )
    worst = max(
        (k["recover_worst_s"] for k in report["by_kind"].values() if k["recover_worst_s"]),
        default=None,
    )
    lines += [
        f"| worst time to recover | {_s(worst)} |",
        f"| divergence | {'none: ' if div['ok'] else 'YES: '}{div['reason']} |",
        f"| hangs | {len(report['hangs']) or 'none'} |",
        f"| trainers that died on their own | {len(report['unexpected_exits']) or 'none'} |",
        f"| leaked processes, namespaces, links | {', '.join(report['leaks']) or 'none'} |",
    ]
    quorums = report.get("quorums")
    if quorums is not None:
        lines.append(
            f"| quorum ids | {'consistent: ' if quorums['ok'] else 'VIOLATED: '}"
            f"{quorums['reason']} |"
        )
    return "\n".join(lines)


def render_text(report: dict[str, Any]) -> str:
    """The report for the terminal: the figures, each injection, the hashes, the verdict."""
    out = ["", "=" * 78, "ftdist chaos report", "=" * 78]
    out.append(
        f"{report['groups']} replica groups of {report['group_size']} ranks, "
        f"{report['duration_s']:.0f} s in all (clock {report['clock_s']:g} s), seed {report['seed']}"
    )
    if report.get("partitions_skipped"):
        out.append(f"NOTE: partitions skipped: {report['partitions_skipped']}")
    out += ["", figures_table(report), ""]
    ht = report["heal_transfer"]
    if ht["count"]:
        out.append(
            f"heals after step 0: {ht['count']}, median transfer {ht['median_mb']:.1f} MB "
            f"in {ht['median_s']:.2f} s"
        )
    out.append("  #   clock  kind            victim      hold  recover   stall  detail")
    for r in report["injections"]:
        victim = (
            "-"
            if r["group"] is None
            else f"g{r['group']}"
            + (f" r{r['rank']}" if r["kind"] in (schedule.KILL, schedule.STOP) else "")
        )
        if r.get("replica") is not None:
            victim = f"lh{r['replica']}"
        elif r.get("member") is not None:
            victim = f"etcd m{r['member']}"
        detail = r["detail"] if r["outcome"] == "done" else f"{r['outcome'].upper()}: {r['detail']}"
        if "into_heal_s" in r:
            detail += f" ({r['into_heal_s']:.2f} s into the heal, transfer " + (
                "cut)" if r["transfer_cut"] else "already done)"
            )
        if r.get("failover_s") is not None:
            detail += f"; replica {r['new_leader']} leads anew {r['failover_s']:.1f} s later"
        if "committed_during" in r:
            detail += (
                f"{'; ' if detail else ''}the others committed {r['committed_during']} steps "
                f"during the cut, at most {r['others_failed_steps']} failed each"
            )
        out.append(
            f"  {r['index']:<3} {r['clock_s']:6.1f}  {r['kind']:<15} {victim:<8} "
            f"{r['hold_s']:5.1f}  {_s(r['recover_s']):>7} {_s(r['stall_s']):>7}  {detail}"
        )
    for h in report["hangs"]:
        out.append(
            f"HANG: group {h['group']} rank {h['rank']} (attempt {h['attempt']}): {h['what']}"
        )
    for e in report["unexpected_exits"]:
        last = (e.get("error") or "").strip().splitlines()[-1:] or [f"exit code {e['exitcode']}"]
        out.append(f"DIED: group {e['group']} rank {e['rank']} at {e['t_s']:.1f} s: {last[0]}")
    for error in report.get("control_errors") or []:
        out.append(f"CONTROL PLANE: {error}")
    for conflict in (report.get("quorums") or {}).get("conflicts", []):
        out.append(f"QUORUM CONFLICT: {conflict}")
    for note in report["notes"]:
        out.append(f"note: {note}")
    out.append("final state hashes (weights + optimizer + ballast):")
    div = report["divergence"]
    for name, h in div["hashes"].items():
        out.append(f"  {name}: {h[:32]}  (step {div['steps'].get(name)})")
    v = report["verdict"]
    out.append("")
    out.append("VERDICT: PASS" if v["ok"] else "VERDICT: FAIL - " + "; ".join(v["problems"]))
    return "\n".join(out)


__all__ = [
    "build_report",
    "by_kind",
    "divergence",
    "figures_table",
    "injection_rows",
    "longest_stall",
    "render_text",
]
