"""
The demo's picture
==================

:func:`write_png` draws the report: the loss over time and the number of
participating replica groups over time, with each injected failure marked,
each lighthouse failover as a band from the leader's kill to every group's
next commit, labelled with the old and new leader and the wait (and, with a
baseline, both loss curves against the step). It needs
matplotlib (the ``demo`` extra); without it the demo still writes its JSON
report and says how to get the picture.
"""

from __future__ import annotations

from typing import Any

MISSING = "matplotlib is not installed; `pip install 'ftdist[demo]'` adds the PNG"
FAILOVER_COLOR = "#73c"


def _smooth(values: list[float], window: int = 15) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _draw_failovers(failovers: list[dict[str, Any]], ax_loss: Any, ax_part: Any) -> None:
    """Each lighthouse failover: a line at the kill, a band while the groups waited."""
    struck = [f for f in failovers if f["t_s"] is not None]
    for i, f in enumerate(struck):
        label = "leader lighthouse SIGKILL" if i == 0 else None
        ax_loss.axvline(f["t_s"], color=FAILOVER_COLOR, lw=1.2, label=label)
        ax_part.axvline(f["t_s"], color=FAILOVER_COLOR, lw=1.2)
        waited = f["waited_s"]
        if waited is not None:
            for ax in (ax_loss, ax_part):
                ax.axvspan(f["t_s"], f["t_s"] + waited, color=FAILOVER_COLOR, alpha=0.15, lw=0)
        new = "?" if f["new_leader"] is None else f["new_leader"]
        wait = "never resumed" if waited is None else f"waited {waited:.1f} s"
        ax_part.annotate(
            f"leader {f['old_leader']}->{new}, {wait}",
            (f["t_s"], 0.2),
            rotation=90,
            fontsize=7,
            color=FAILOVER_COLOR,
            ha="left",
        )


def write_png(report: dict[str, Any], path: str) -> str | None:
    """Draw ``report`` into ``path``.

    Returns:
        None when written, else why not (matplotlib missing).

    Raises:
        OSError: the file cannot be written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return MISSING
    run = report["run"]
    base = report.get("baseline")
    curve = [p for p in run["curve"] if p["loss"] is not None]
    rows = 3 if base else 2
    fig, axes = plt.subplots(rows, 1, figsize=(10, 3.2 * rows), constrained_layout=True)
    ax_loss, ax_part = axes[0], axes[1]
    t = [p["t_s"] for p in curve]
    ax_loss.plot(t, [p["loss"] for p in curve], color="#9ab", lw=0.6, label="loss per step")
    ax_loss.plot(t, _smooth([p["loss"] for p in curve]), color="#135", lw=1.6, label="smoothed")
    ax_loss.set_ylabel("training loss")
    ax_loss.set_title(
        f"ftdist demo: {run['replicas'].__len__()} replica groups, "
        f"{run['failures_injected']['total']} failures injected - "
        f"{'PASS' if report['verdict']['ok'] else 'FAIL'}"
    )
    all_t = [p["t_s"] for p in run["curve"]]
    ax_part.step(all_t, [p["participants"] for p in run["curve"]], where="post", color="#2a6")
    ax_part.set_ylabel("participating groups")
    ax_part.set_xlabel("seconds since start")
    ax_part.set_ylim(0, len(run["replicas"]) + 0.5)
    ax_part.set_yticks(range(len(run["replicas"]) + 1))
    for ax in (ax_loss, ax_part):
        for i, inj in enumerate(run["injections"]):
            color = "#c22" if inj["kind"] == "kill" else "#e80"
            label = None
            if ax is ax_loss and inj["kind"] not in [j["kind"] for j in run["injections"][:i]]:
                label = "SIGKILL" if inj["kind"] == "kill" else "SIGSTOP"
            ax.axvline(inj["t_s"], color=color, ls="--", lw=1, label=label)
            if ax is ax_part:
                ax.annotate(
                    f"{inj['kind']} r{inj['replica']}",
                    (inj["t_s"], 0.2),
                    rotation=90,
                    fontsize=7,
                    color=color,
                    ha="right",
                )
        for heal in run["heals"]:
            if heal["role"] == "receive" and heal["step"] > 0 and ax is ax_part:
                ax.plot([heal["t_s"]], [len(run["replicas"])], marker="o", color="#26c", ms=4)
    _draw_failovers(run.get("failovers") or [], ax_loss, ax_part)
    ax_loss.legend(loc="upper right", fontsize=8)
    if base:
        ax_cmp = axes[2]
        theirs = [p for p in base["curve"] if p["loss"] is not None]
        ax_cmp.plot(
            [p["step"] for p in theirs],
            _smooth([p["loss"] for p in theirs]),
            color="#888",
            lw=1.4,
            label="without failures (baseline)",
        )
        ax_cmp.plot(
            [p["step"] for p in curve],
            _smooth([p["loss"] for p in curve]),
            color="#135",
            lw=1.4,
            label="with failures",
        )
        ax_cmp.set_xlabel("step")
        ax_cmp.set_ylabel("training loss (smoothed)")
        ax_cmp.legend(loc="upper right", fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
