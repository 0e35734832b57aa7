"""The browser tests' setup: installing Chromium with a stand-in apt-get (no
package is touched), and reading a dumped DOM."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests import _browser
from tests._browser import ensure_chromium, install_chromium, parse_dom, png_size

pytestmark = pytest.mark.timeout(30)

# A stand-in apt-get: logs its arguments; "install" fails the way apt-get does
# on a machine without package lists until "update" ran, then "installs" a
# chromium script into $FAKE_BIN.
_FAKE_APT = """#!{python}
import os, sys, time
state = os.environ["FAKE_STATE"]
with open(os.path.join(state, "calls"), "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
mode = os.environ.get("FAKE_MODE", "")
if mode == "hang":
    time.sleep(60)
if "update" in sys.argv:
    if mode == "offline":
        print("E: Failed to fetch http://deb.debian.org/debian/dists/bookworm/InRelease")
        sys.exit(100)
    open(os.path.join(state, "lists"), "w").close()
    sys.exit(0)
if mode != "has-lists" and not os.path.exists(os.path.join(state, "lists")):
    print("E: Unable to locate package chromium")
    sys.exit(100)
chromium = os.path.join(os.environ["FAKE_BIN"], "chromium")
with open(chromium, "w") as f:
    f.write("#!/bin/sh\\n")
os.chmod(chromium, 0o755)
"""


@pytest.fixture
def fake_apt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH holding only the stand-in apt-get; returns the state directory."""
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    apt = bin_dir / "apt-get"
    apt.write_text(_FAKE_APT.format(python=sys.executable))
    apt.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("FAKE_BIN", str(bin_dir))
    monkeypatch.setenv("FAKE_STATE", str(state))
    monkeypatch.delenv(_browser.ENV_OVERRIDE, raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    return state


def _calls(state: Path) -> list[str]:
    return (state / "calls").read_text().splitlines()


def test_install_without_package_lists_updates_then_installs(fake_apt: Path) -> None:
    path, why_not = ensure_chromium(timeout=20)
    assert why_not == ""
    assert path is not None and Path(path).name == "chromium"
    install = "-o DPkg::Lock::Timeout=60 install -y -q --no-install-recommends chromium"
    assert _calls(fake_apt) == [install, "-o DPkg::Lock::Timeout=60 update -q", install]


def test_install_with_package_lists_skips_update(
    fake_apt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MODE", "has-lists")
    assert install_chromium(timeout=20) is None
    assert [call.split()[2] for call in _calls(fake_apt)] == ["install"]


def test_failed_install_is_a_skip_reason(fake_apt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_MODE", "offline")
    path, why_not = ensure_chromium(timeout=20)
    assert path is None
    assert why_not.startswith("chromium not installed and apt-get install failed: ")
    assert "Failed to fetch" in why_not


def test_install_is_bounded_and_leaves_no_process(
    fake_apt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MODE", "hang")
    # A hang would outlive the module's 30 s test timeout.
    problem = install_chromium(timeout=1.0)
    assert problem is not None and "timed out" in problem


def test_no_apt_get_and_no_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(_browser.ENV_OVERRIDE, raising=False)
    assert ensure_chromium() == (
        None,
        "chromium not installed and apt-get install failed: apt-get not found",
    )
    (tmp_path / "apt-get").write_text("#!/bin/sh\n")
    (tmp_path / "apt-get").chmod(0o755)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert install_chromium() == "not root and no sudo"


def test_override_naming_no_browser(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_browser.ENV_OVERRIDE, "/nonexistent/chrome")
    path, why_not = ensure_chromium()
    assert path is None and "/nonexistent/chrome" in why_not


def test_parse_dom_reads_text_classes_and_skips_hidden() -> None:
    page = parse_dom(
        '<html><head><style>p{}</style></head><body><div id="x" class="member recovering">'
        "<b>a</b> <br>b<input value=1><p hidden>secret</p></div><script>1</script></body></html>"
    )
    element = page.by_id("x")
    assert element.classes == {"member", "recovering"}
    assert element.text == "a b"
    assert page.by_class("recovering") == [element]
    with pytest.raises(LookupError):
        page.by_id("missing")


def test_png_size() -> None:
    header = (
        b"\x89PNG\r\n\x1a\n"
        + b"\x00\x00\x00\rIHDR"
        + (640).to_bytes(4, "big")
        + (480).to_bytes(4, "big")
    )
    assert png_size(header) == (640, 480)
    with pytest.raises(ValueError):
        png_size(b"GIF89a" + bytes(30))
