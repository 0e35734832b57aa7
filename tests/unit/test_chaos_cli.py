"""``ftdist chaos``'s options: bad values exit 2 naming the value, before anything starts."""

from __future__ import annotations

import pytest

from ftdist.chaos import schedule
from ftdist.chaos.run import ChaosConfig
from ftdist.cli import main

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--groups", "1"], "--groups 1"),
        (["--group-size", "9"], "--group-size 9"),
        (["--duration", "5"], "--duration 5"),
        (["--duration", "0"], "--duration 0"),
        (["--short", "--duration", "0"], "--duration 0"),
        (["--kinds", "kill,explode"], "--kinds kill,explode"),
        (["--gap", "4", "2"], "--gap"),
        (["--ballast", "-1"], "--ballast -1"),
        (["--link-mbit", "-5"], "--link-mbit -5"),
        (["--kinds", "kill,kill-leader-lighthouse"], "needs --replicated-lighthouse"),
        (["--replicated-lighthouse", "--kinds", "kill,lighthouse"], "no single lighthouse"),
    ],
)
def test_bad_options_exit_2_naming_the_value(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: object
) -> None:
    assert main(["chaos", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_defaults_are_the_full_suite() -> None:
    c = ChaosConfig()
    assert (c.duration_s, c.groups, c.group_size, c.gap_s) == (600.0, 3, 2, (5.0, 15.0))
    assert not c.ordered and c.network


def test_the_default_kinds_follow_the_lighthouse() -> None:
    assert ChaosConfig().kinds == schedule.KINDS
    replicated = ChaosConfig(replicated_lighthouse=True)
    assert replicated.kinds == schedule.REPLICATED_KINDS
    assert schedule.LIGHTHOUSE not in replicated.kinds
    chosen = (schedule.KILL, schedule.KILL_ETCD_MEMBER)
    assert ChaosConfig(kinds=chosen, replicated_lighthouse=True).kinds == chosen
