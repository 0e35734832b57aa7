"""Every torch.distributed function over ftdist groups, in real processes over Gloo.

Also produces the compatibility table in ``docs/compatibility.md``, so the
table cannot drift: run with ``FTDIST_UPDATE_DOCS=1`` to rewrite it after a
deliberate change.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from ftdist.launch.ranks import RankContext, run_ranks
from tests.integration.collective_checks import CHECKS, first_line

if TYPE_CHECKING:
    from ftdist.process_group import ProcessGroup

# One worker runs these in turn (make pytest: pytest-xdist, loadgroup):
# the module fixture runs every collective once for all tests.
pytestmark = pytest.mark.xdist_group("collectives")

TABLE_DOC = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"
START, END = "<!-- compat-table:start -->", "<!-- compat-table:end -->"
KINDS = ("gloo", "baby-gloo")


def _make(kind: str) -> ProcessGroup:
    from ftdist.process_group import ProcessGroupBabyGloo, ProcessGroupGloo

    return ProcessGroupGloo(timeout=8) if kind == "gloo" else ProcessGroupBabyGloo(timeout=8)


def _run_checks(ctx: RankContext, kind: str) -> dict[str, str | None]:
    pg = _make(kind)
    results: dict[str, str | None] = {}
    try:
        for i, name in enumerate(CHECKS):
            # A fresh configure per check: a check that fails on one rank
            # cannot leave the next one out of step.
            pg.configure(ctx.addr(f"{kind}/{i}"), ctx.rank, ctx.world_size)
            # Gloo's connect can return on one rank while a slower peer still
            # finishes its side; a check that fails at once everywhere must not
            # let the fast ranks tear this group down under that peer.
            ctx.barrier(f"{kind}/{i}/configured")
            if "functional" in name:
                pg.register(f"check{i}")
            try:
                CHECKS[name](pg, ctx.rank, ctx.world_size)
                results[name] = None
            except Exception as exc:
                results[name] = first_line(exc)
            finally:
                if "functional" in name:
                    pg.unregister()
    finally:
        pg.shutdown()
    return results


@pytest.fixture(scope="module")
def outcomes() -> dict[str, list[dict[str, str | None]]]:
    return {kind: run_ranks(_run_checks, 2, kind, timeout=240) for kind in KINDS}


# Rows that may say "no", and why; every other row must give the right answer.
# torch.distributed.monitored_barrier checks that the group's backend is named
# "gloo" in torch's own registry; pg.monitored_barrier() works directly.
UNSUPPORTED = {"monitored_barrier"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
def test_every_collective_gives_the_right_answer(
    outcomes: dict[str, list[dict[str, str | None]]], kind: str
) -> None:
    failures = {
        name: err
        for per_rank in outcomes[kind]
        for name, err in per_rank.items()
        if err is not None and name not in UNSUPPORTED
    }
    assert not failures, f"{kind}: {failures}"


def _three_ranks(ctx: RankContext) -> dict[str, str | None]:
    return _run_checks(ctx, "gloo")


@pytest.mark.timeout(300)
def test_every_collective_with_three_ranks() -> None:
    for per_rank in run_ranks(_three_ranks, 3, timeout=240):
        failures = {n: e for n, e in per_rank.items() if e is not None and n not in UNSUPPORTED}
        assert not failures, failures


def _table(outcomes: dict[str, list[dict[str, str | None]]]) -> str:
    lines = [
        "| torch.distributed function | " + " | ".join(f"ftdist {k}" for k in KINDS) + " |",
        "|---|" + "---|" * len(KINDS),
    ]
    for name in CHECKS:
        cells = []
        for kind in KINDS:
            errs = [r[name] for r in outcomes[kind] if r[name] is not None]
            cells.append("yes" if not errs else f"no ({errs[0]})")
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@pytest.mark.timeout(300)
def test_readme_table_matches(outcomes: dict[str, list[dict[str, str | None]]]) -> None:
    table = _table(outcomes)
    text = TABLE_DOC.read_text()
    block = f"{START}\n{table}\n{END}"
    if os.environ.get("FTDIST_UPDATE_DOCS") == "1":
        text = re.sub(re.escape(START) + ".*?" + re.escape(END), block, text, flags=re.S)
        TABLE_DOC.write_text(text)
    assert block in text, f"docs/compatibility.md's table is stale; it should read:\n{table}"
