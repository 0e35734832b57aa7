"""The soak's bookkeeping (tests/_soak.py): selections, durations, JUnit outcomes, the summary."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tests import _soak


def test_presets_and_narrowing_become_pytest_arguments() -> None:
    args = _soak._parse(["--preset", "whole", "-k", "recovery", "--", "-x"])
    assert _soak.pytest_args(args) == ["tests", "-m", "integration or slow", "-k", "recovery", "-x"]
    assert args.runs == 5
    args = _soak._parse(["--preset", "whole", "-m", "slow", "--duration", "2h"])
    assert _soak.pytest_args(args) == ["tests", "-m", "slow"]
    assert (args.runs, args.duration) == (0, 7200.0)  # unlimited runs within the budget
    args = _soak._parse(["--select", "tests/integration/test_recovery.py::test_a[3-1]"])
    assert _soak.pytest_args(args) == ["tests/integration/test_recovery.py::test_a[3-1]"]
    for preset in _soak.PRESETS.values():
        for path in preset:
            if path.startswith("tests/"):
                assert (_soak.REPO / path.split("::")[0]).exists(), path


def test_a_selection_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _soak._parse([])
    assert "give --preset or --select" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90), ("90s", 90), ("15m", 900), ("1.5h", 5400)]
)
def test_durations(text: str, seconds: float) -> None:
    assert _soak._duration(text) == seconds


def test_a_bad_duration_is_refused() -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        _soak._duration("ten minutes")


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.integration.test_recovery" name="test_a[3-1]" time="1" />
<testcase classname="tests.integration.test_recovery" name="test_b" time="1">
  <failure message="AssertionError: rank 1 hung&#10;more">traceback text</failure>
  <system-err>captured stderr</system-err>
</testcase>
<testcase classname="tests.integration.test_x.TestY" name="test_c" time="1">
  <error message="teardown: leaked">leak</error>
</testcase>
<testcase classname="tests.integration.test_x" name="test_d" time="1">
  <skipped message="needs root" />
</testcase>
<testcase time="0.003" />
</testsuite></testsuites>
"""


def test_junit_outcomes_and_node_ids_match(tmp_path: Path) -> None:
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    results = _soak.read_junit(path)
    assert {k: v[0] for k, v in results.items()} == {
        "tests.integration.test_recovery::test_a[3-1]": "passed",
        "tests.integration.test_recovery::test_b": "failed",
        "tests.integration.test_x.TestY::test_c": "error",
        "tests.integration.test_x::test_d": "skipped",
    }
    _, message, text = results["tests.integration.test_recovery::test_b"]
    assert message == "AssertionError: rank 1 hung"
    assert "traceback text" in text and "captured stderr" in text
    # The diagnostics files name the pytest node id; both map to one key.
    assert (
        _soak._key_of_nodeid("tests/integration/test_x.py::TestY::test_c")
        == "tests.integration.test_x.TestY::test_c"
    )


def test_the_summary_counts_each_test_and_lists_each_failure() -> None:
    runs = [
        _soak.RunResult(1, 60, 0, {"m::a": "passed", "m::b": "passed"}),
        _soak.RunResult(2, 61, 1, {"m::a": "passed", "m::b": "failed"}),
    ]
    failures = [_soak.Failure(2, "m::b", "failed", "AssertionError: x", "/r/b.txt")]
    text = _soak.summary(runs, failures, 121, "0123456789abcdef")
    assert "soak of 0123456789ab: 2 run(s)" in text
    assert "2 test(s); 1 with failures:" in text
    assert "m::b  passed 1, failed 1, error 0" in text
    assert "run 2: m::b: failed: AssertionError: x" in text and "/r/b.txt" in text
