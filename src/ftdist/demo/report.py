"""
The demo's report
=================

:func:`build_report` turns the run records into one JSON-ready document: the
configuration, steps committed against attempted, every injected failure and
how long its victim took to come back, every lighthouse failover (the old
and the new leader, and how long the replica groups waited), every heal's
timeline, the loss curve (and the baseline's), and the verdict.
:func:`render_text` prints it for a person.

The verdict is what a user of fault-tolerant training cares about: at the
end every replica group holds bit-identical weights and optimizer state (one
SHA-256 over all their bytes), at the same step. It fails loudly otherwise,
when a replica group died on its own (not by injection), when the
lighthouse did not fail over (no new leader, or a group that never
committed again), and when a run with the exact sampler read a sample twice
or left one unread (its data ledger, :mod:`ftdist.demo.ledger`).
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from ftdist.demo.ledger import ledger_lines, ledger_problem

if TYPE_CHECKING:
    from ftdist.demo.supervisor import RunRecord

LOSS_WINDOW = 50


def loss_curve(record: RunRecord) -> list[dict[str, Any]]:
    """Per committed step: wall time, mean loss of the participants, participants."""
    curve = []
    for step in sorted(record.steps):
        entry = record.steps[step]
        losses = list(entry["losses"].values())
        curve.append(
            {
                "step": step,
                "t_s": entry["t_s"],
                "participants": entry["participants"],
                "loss": statistics.fmean(losses) if losses else None,
            }
        )
    return curve


def _mean_loss(curve: list[dict[str, Any]], part: slice) -> float | None:
    losses = [p["loss"] for p in curve if p["loss"] is not None][part]
    return statistics.fmean(losses) if losses else None


def failover_problem(failovers: list[dict[str, Any]]) -> str | None:
    """What went wrong in a lighthouse failover of the run, or None.

    A strike that failed before its kill (no leader to find) failed nothing
    for the job; after the kill, a new leader must be elected and every
    replica group must commit again.
    """
    for f in failovers:
        if f["t_s"] is None:
            continue
        if f["new_leader"] is None:
            why = f" ({f['error']})" if f.get("error") else ""
            return (
                f"no lighthouse replica took over after the leader was killed at "
                f"{f['t_s']:.1f} s{why}"
            )
        stuck = [f"replica{g}" for g, s in enumerate(f["resumed_s"]) if s is None]
        if stuck:
            return (
                f"{', '.join(stuck)} never committed again after the lighthouse failover "
                f"at {f['t_s']:.1f} s"
            )
    return None


def verdict(record: RunRecord) -> dict[str, Any]:
    """Whether every replica ended with bit-identical state at the same step.

    Returns:
        ``{"ok": bool, "reason": str, "step": int | None, "hashes": {replica: hash}}``.
    """
    finals = {f"replica{rs.replica}": rs.final for rs in record.replicas}
    hashes = {name: f.hash for name, f in finals.items() if f is not None}
    steps = {name: f.step for name, f in finals.items() if f is not None}
    missing = sorted(name for name, f in finals.items() if f is None)
    out: dict[str, Any] = {"ok": False, "hashes": hashes, "steps": steps, "step": record.stop_step}
    # First: a job stuck behind its lighthouse also misses finals, and this is why.
    failover = failover_problem(record.failovers)
    if failover is not None:
        out["reason"] = failover
    elif missing:
        out["reason"] = f"no final state from {', '.join(missing)}"
    elif record.unexpected_exits:
        exits = ", ".join(
            f"replica{e['replica']} (exit code {e['exitcode']})" for e in record.unexpected_exits
        )
        out["reason"] = f"replica groups died without an injected failure: {exits}"
    elif len(set(steps.values())) != 1:
        out["reason"] = f"replicas stopped at different steps: {steps}"
    elif len(set(hashes.values())) != 1:
        out["reason"] = (
            f"replica weights differ at step {next(iter(steps.values()))}: "
            + ", ".join(f"{k} {v[:12]}" for k, v in hashes.items())
        )
    elif (data := ledger_problem(record.ledger)) is not None:
        out["reason"] = data
    else:
        first = next(iter(finals.values()), None)
        what = (first.what if first is not None else None) or "weights and optimizer state"
        out["ok"] = True
        out["reason"] = (
            f"all {len(hashes)} replica groups hold bit-identical {what} at step "
            f"{next(iter(steps.values()))}"
        )
    return out


def run_summary(record: RunRecord) -> dict[str, Any]:
    """One run's part of the report."""
    curve = loss_curve(record)
    finals = [rs.final for rs in record.replicas if rs.final is not None]
    kinds = [i["kind"] for i in record.injections]
    leader_kills = sum(1 for f in record.failovers if f["t_s"] is not None)
    return {
        "name": record.name,
        "duration_s": round(record.ended - record.started, 3),
        "interrupted": record.interrupted,
        "training_started_s": record.training_started_s,
        "stop_step": record.stop_step,
        "steps_committed": len(record.steps),
        "replica_steps_attempted": sum(rs.steps_attempted for rs in record.replicas),
        "replica_steps_committed": sum(rs.steps_committed for rs in record.replicas),
        "failures_injected": {
            "total": len(kinds) + leader_kills,
            "kill": kinds.count("kill"),
            "stop": kinds.count("stop"),
            "leader": leader_kills,
        },
        "replicas": [
            {
                "replica": rs.replica,
                "processes": rs.attempt + 1,
                "failures": rs.failures,
                "heals": rs.heals,
                "served": rs.served,
                "steps_attempted": rs.steps_attempted,
                "steps_committed": rs.steps_committed,
                "final": rs.final.as_dict() if rs.final is not None else None,
            }
            for rs in record.replicas
        ],
        "injections": record.injections,
        "failovers": record.failovers,
        "heals": record.heals,
        "failed_steps": record.failed_steps,
        "unexpected_exits": record.unexpected_exits,
        "notes": record.notes,
        "loss": {
            "first": _mean_loss(curve, slice(10)),
            "last": _mean_loss(curve, slice(-LOSS_WINDOW, None)),
            "eval_loss": finals[0].eval_loss if finals else None,
            "eval_accuracy": finals[0].accuracy if finals else None,
        },
        "curve": curve,
        "ledger": record.ledger,
        "verdict": verdict(record),
    }


def build_report(
    failures: RunRecord, baseline: RunRecord | None, meta: dict[str, Any]
) -> dict[str, Any]:
    """The whole report document.

    Args:
        failures: the main run (with failures unless ``--no-failures``).
        baseline: the same run without failures, or None.
        meta: configuration, addresses and versions to include.
    """
    main = run_summary(failures)
    report: dict[str, Any] = {**meta, "run": main, "baseline": None, "verdict": main["verdict"]}
    if baseline is not None:
        base = run_summary(baseline)
        report["baseline"] = base
        ours = {p["step"]: p["loss"] for p in main["curve"] if p["loss"] is not None}
        theirs = {p["step"]: p["loss"] for p in base["curve"] if p["loss"] is not None}
        common = sorted(ours.keys() & theirs.keys())
        tail = common[-LOSS_WINDOW:]
        report["comparison"] = {
            "steps_compared": len(common),
            "last_loss": main["loss"]["last"],
            "baseline_last_loss": base["loss"]["last"],
            "mean_abs_diff_last_steps": statistics.fmean(abs(ours[s] - theirs[s]) for s in tail)
            if tail
            else None,
            "mean_abs_diff_all_steps": statistics.fmean(abs(ours[s] - theirs[s]) for s in common)
            if common
            else None,
            "eval_accuracy": main["loss"]["eval_accuracy"],
            "baseline_eval_accuracy": base["loss"]["eval_accuracy"],
        }
    return report


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _seconds(value: float | None, missing: str) -> str:
    return missing if value is None else f"{value:.2f} s"


def failover_lines(failovers: list[dict[str, Any]]) -> list[str]:
    """The report's table of lighthouse failovers (none: no lines).

    The groups' wait runs from the kill to the commit of each group's first
    step begun after it; the row shows the worst group's.
    """
    if not failovers:
        return []
    lines = [
        "lighthouse failovers (SIGKILL of the leader replica; groups waited = kill to the "
        "commit of each group's first step begun after it):",
        "  #   at (s)   step  leader  new leader after  groups waited (worst)  "
        "old leader back after",
    ]
    for f in failovers:
        if f["t_s"] is None:
            lines.append(f"  {f['index']:<3} not carried out: {f.get('error')}")
            continue
        new = "?" if f["new_leader"] is None else f["new_leader"]
        waited = _seconds(f["waited_s"], "NOT RESUMED")
        if f["waited_s"] is not None:
            waited += f" (replica{f['slowest']})"
        lines.append(
            f"  {f['index']:<3} {f['t_s']:6.1f}  {f['step']:>5}  {f['old_leader']} -> {new:<2}  "
            f"{_seconds(f['elected_s'], 'none'):>16}  {waited:>21}  "
            f"{_seconds(f['restarted_s'], 'not back'):>21}"
        )
        if f.get("error"):
            lines.append(f"      error: {f['error']}")
    return lines


def render_text(report: dict[str, Any]) -> str:
    """The report as text for the terminal."""
    run = report["run"]
    lines = ["", "=" * 78, "ftdist demo report", "=" * 78]
    inj = run["failures_injected"]
    lines.append(
        f"{run['name']} run: {run['duration_s']:.1f} s, {run['steps_committed']} steps committed "
        f"by the job; replica step attempts {run['replica_steps_attempted']}, committed "
        f"{run['replica_steps_committed']} "
        f"({run['replica_steps_attempted'] - run['replica_steps_committed']} not committed)"
    )
    leader = f", {inj['leader']} leader lighthouse SIGKILL" if inj.get("leader") else ""
    lines.append(
        f"failures injected: {inj['total']} ({inj['kill']} SIGKILL, {inj['stop']} "
        f"SIGSTOP{leader}); processes started: "
        + ", ".join(f"replica{r['replica']} {r['processes']}" for r in run["replicas"])
    )
    if run["injections"]:
        lines.append(
            "  #   at (s)  kind  replica   step  survivors stepped on after  "
            "victim back in quorum after"
        )
        for i in run["injections"]:
            back = f"{i['back_s']:.2f} s" if i["back_s"] is not None else "not back"
            on = f"{i['survivors_s']:.2f} s" if i.get("survivors_s") is not None else "-"
            lines.append(
                f"  {i['index']:<3} {i['t_s']:6.1f}  {i['kind']:<5} replica{i['replica']:<2} "
                f"{i['step']:>5}  {on:>26}  {back:>27}"
            )
    lines += failover_lines(run.get("failovers") or [])
    heals = [h for h in run["heals"] if h["role"] == "receive"]
    if heals:
        lines.append("heals (per receiving replica; step 0 is the initial sync):")
        for h in heals:
            lines.append(
                f"  replica{h['replica']} step {h['step']:>5}: quorum {h['quorum_s'] * 1e3:5.0f} ms, "
                f"reconfigure {h['reconfigure_s'] * 1e3:4.0f} ms, transfer "
                f"{h['transfer_bytes'] / 1e6:5.2f} MB in {h['transfer_s'] * 1e3:4.0f} ms, load "
                f"{h['load_s'] * 1e3:3.0f} ms = {h['total_s']:.2f} s"
            )
    lines += ledger_lines(run.get("ledger"))
    loss = run["loss"]
    lines.append(
        f"loss: {_fmt(loss['first'])} at the start -> {_fmt(loss['last'])} (mean of the "
        f"last {LOSS_WINDOW} steps); held-out loss {_fmt(loss['eval_loss'])}, accuracy "
        f"{_fmt(loss['eval_accuracy'] and loss['eval_accuracy'] * 100, '.1f')}%"
    )
    comparison = report.get("comparison")
    if comparison:
        base = report["baseline"]
        lines.append(
            f"baseline without failures ({base['duration_s']:.1f} s, {base['steps_committed']} "
            f"steps): loss {_fmt(comparison['baseline_last_loss'])}, held-out accuracy "
            f"{_fmt(comparison['baseline_eval_accuracy'] and comparison['baseline_eval_accuracy'] * 100, '.1f')}%; "
            f"mean |loss difference| over the last {LOSS_WINDOW} steps "
            f"{_fmt(comparison['mean_abs_diff_last_steps'], '.2g')}, over all "
            f"{comparison['steps_compared']} "
            f"{_fmt(comparison.get('mean_abs_diff_all_steps'), '.2g')}"
        )
        bv = base["verdict"]
        lines.append(f"baseline replicas identical: {'yes' if bv['ok'] else 'NO: ' + bv['reason']}")
    else:
        lines.append("no baseline run (--baseline runs the same job without failures to compare)")
    for note in run["notes"]:
        lines.append(f"note: {note}")
    v = report["verdict"]
    what = "weights + optimizer state"
    if report.get("options", {}).get("algorithm") == "diloco":
        what = "DiLoCo's global weights + outer optimizer state"
    lines.append(f"final state hashes (SHA-256 of {what}):")
    for name, h in v["hashes"].items():
        lines.append(f"  {name}: {h}  (step {v['steps'].get(name)})")
    lines.append("")
    if v["ok"]:
        lines.append(f"VERDICT: PASS - {v['reason']}")
    elif report.get("interrupted"):
        lines.append(
            f"VERDICT: INTERRUPTED - Ctrl-C ended the run before it could finish: {v['reason']}"
        )
    else:
        lines += ["!" * 78, f"VERDICT: FAIL - {v['reason']}", "!" * 78]
    return "\n".join(lines)
