"""Headless Chromium for the browser tests.

The tests only look for a browser (:func:`find_chromium`) and skip without
one; ``make setup-browser`` (``python -m tests._browser``) installs Debian's
``chromium`` package with :func:`ensure_chromium` (as root, or through
password-less ``sudo``), or says why it could not. :class:`Chromium` runs it once per page with the plain command line
(``--dump-dom``, ``--screenshot``), so the tests need no browser-driver
package, and kills every process a run started before returning.
"""

from __future__ import annotations

import contextlib
import ctypes
import html.parser
import os
import shutil
import signal
import struct
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests._procs import children, processes_with

# Names the browser goes by in Debian, Ubuntu and Google's packages.
CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# Overrides the search, for a browser installed elsewhere.
ENV_OVERRIDE = "FTDIST_CHROMIUM"
# A clean Debian machine downloads ~110 MB of packages (10 s with a near
# mirror); the bound is for slow mirrors, as killing dpkg midway leaves
# the package half configured.
INSTALL_TIMEOUT = 300.0
# Every process of one run carries this in its environment, so the run can
# find and kill them all, even the ones Chromium re-parents away from it.
_RUN_MARKER = "FTDIST_BROWSER_RUN"

_FLAGS = (
    "--headless",
    # Root in a container has no user namespace for the sandbox.
    "--no-sandbox",
    "--disable-gpu",
    # A container's /dev/shm is often too small for the renderer.
    "--disable-dev-shm-usage",
    # Without these Chromium keeps dialing Google's services, which on a
    # closed network is a flood of refused connections and slow exits.
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-breakpad",
    "--hide-scrollbars",
    "--mute-audio",
)


def find_chromium() -> str | None:
    """The path of an installed Chromium or Chrome, or None."""
    override = os.environ.get(ENV_OVERRIDE)
    if override:
        return shutil.which(override)
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


class _TimedOut(Exception):
    pass


def _run_bounded(argv: Sequence[str], deadline: float, env: dict[str, str]) -> tuple[int, str]:
    """Run ``argv`` until it exits; (exit status, output).

    Raises:
        _TimedOut: if ``deadline`` passed first; the command is killed.
    """
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise _TimedOut(f"no time left for {' '.join(argv)}")
    # Its own process group, so a timeout also stops the dpkg it started.
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=remaining)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise _TimedOut(
            f"{' '.join(argv)} timed out after {remaining:.0f} s: {_tail(out)}"
        ) from None
    return proc.returncode, out


def install_chromium(apt_get: str = "apt-get", timeout: float = INSTALL_TIMEOUT) -> str | None:
    """Install Debian's ``chromium`` package without its recommends.

    ``apt-get update`` runs only when the install fails, which is what a
    machine with no (or stale) package lists needs, so a machine that has
    them pays for the download alone.

    Args:
        apt_get: the apt-get to run (a path, or a name on ``PATH``).
        timeout: seconds for the whole install, update included.

    Returns:
        None when it installed, else why not (for a skip reason).
    """
    apt = shutil.which(apt_get)
    if apt is None:
        return f"{apt_get} not found"
    if os.geteuid() == 0:
        prefix: list[str] = []
    elif shutil.which("sudo"):
        # -n: never prompt, a test cannot answer; env: sudo drops ours.
        prefix = ["sudo", "-n", "env", "DEBIAN_FRONTEND=noninteractive"]
    else:
        return "not root and no sudo"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    deadline = time.monotonic() + timeout
    # Wait for, rather than fail on, another apt that holds the lock.
    install = [
        *prefix,
        apt,
        "-o",
        "DPkg::Lock::Timeout=60",
        "install",
        "-y",
        "-q",
        "--no-install-recommends",
        "chromium",
    ]
    update = [*prefix, apt, "-o", "DPkg::Lock::Timeout=60", "update", "-q"]
    try:
        code, out = _run_bounded(install, deadline, env)
        if code == 0:
            return None
        code, update_out = _run_bounded(update, deadline, env)
        if code != 0:
            return f"{_tail(out, 1)}; then apt-get update failed: {_tail(update_out)}"
        code, out = _run_bounded(install, deadline, env)
    except _TimedOut as exc:
        return str(exc)
    return None if code == 0 else _tail(out)


def _tail(text: str, lines: int = 5) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def ensure_chromium(timeout: float = INSTALL_TIMEOUT) -> tuple[str | None, str]:
    """Find Chromium, installing it when missing.

    Returns:
        (path, "") when there is a browser, else (None, why there is none).
    """
    path = find_chromium()
    if path is not None:
        return path, ""
    if os.environ.get(ENV_OVERRIDE):
        return None, f"{ENV_OVERRIDE}={os.environ[ENV_OVERRIDE]} is not an executable"
    problem = install_chromium(timeout=timeout)
    path = find_chromium()
    if path is not None:
        return path, ""
    return None, f"chromium not installed and apt-get install failed: {problem or 'no binary'}"


_PR_SET_CHILD_SUBREAPER = 36


def _set_subreaper(on: bool) -> bool:
    """Make this process adopt its orphaned descendants (Linux), or stop."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    return bool(prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0)


def _reap_adopted(before: set[int]) -> None:
    """Reap the dead children this process adopted since ``before``."""
    for pid, state in children().items():
        if pid not in before and state == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _kill_all(marker: str, timeout: float = 10.0) -> None:
    """Kill every process carrying ``marker`` and wait until none is left."""
    deadline = time.monotonic() + timeout
    while pids := processes_with(marker):
        if time.monotonic() > deadline:
            raise RuntimeError(f"chromium processes {pids} survived SIGKILL")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


@dataclass
class Chromium:
    """Runs a headless Chromium once per call; nothing outlives a call.

    Args:
        executable: the browser to run.
        timeout: seconds one run may take.
    """

    executable: str
    timeout: float = 60.0

    def run(self, url: str, *args: str) -> str:
        """Load ``url`` with extra ``args`` in a fresh profile; return stdout.

        Raises:
            RuntimeError: if the browser failed or ran past the timeout.
        """
        # Chromium's crash handler and zygote outlive their parents; as
        # orphans they would go to PID 1, which in a container often never
        # reaps them. Adopting them lets this process reap them itself.
        before = set(children())
        adopting = _set_subreaper(True)
        try:
            return self._run(url, args, uuid.uuid4().hex)
        finally:
            if adopting:
                _set_subreaper(False)
                _reap_adopted(before)

    def _run(self, url: str, args: Sequence[str], token: str) -> str:
        with tempfile.TemporaryDirectory(prefix="ftdist-chromium-") as profile:
            # HOME too: Chromium and fontconfig also write outside the profile.
            env = dict(os.environ, HOME=profile)
            env[_RUN_MARKER] = token
            argv = [self.executable, *_FLAGS, f"--user-data-dir={profile}", *args, url]
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,
            )
            try:
                out, err = proc.communicate(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise RuntimeError(f"chromium ran past {self.timeout} s: {argv}") from None
            finally:
                # Renderer and zygote processes may still be exiting; the
                # profile cannot be removed under them, and no test may leave
                # a process behind.
                _kill_all(f"{_RUN_MARKER}={token}")
        if proc.returncode != 0:
            raise RuntimeError(f"chromium exited {proc.returncode}: {err.decode(errors='replace')}")
        return out.decode()

    def dump_dom(self, url: str, wait_ms: int = 5000) -> str:
        """The page's DOM after its scripts ran for ``wait_ms`` of virtual time.

        Virtual time runs as fast as the page lets it but waits for network
        fetches, so polls that ``setTimeout`` schedules happen without the
        test sleeping through them.
        """
        return self.run(url, f"--virtual-time-budget={wait_ms}", "--dump-dom")

    def screenshot(
        self, url: str, path: Path, size: tuple[int, int] = (1280, 900), wait_ms: int = 5000
    ) -> None:
        """Save what the window shows after ``wait_ms`` of virtual time as a PNG."""
        self.run(
            url,
            f"--virtual-time-budget={wait_ms}",
            f"--window-size={size[0]},{size[1]}",
            "--force-device-scale-factor=1",
            f"--screenshot={path}",
        )


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height of a PNG image.

    Raises:
        ValueError: if ``data`` is not a PNG.
    """
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError("not a PNG")
    width, height = struct.unpack(">II", data[16:24])
    return width, height


# -- reading the dumped DOM -------------------------------------------------------


@dataclass
class Element:
    """An element of a parsed page: tag, attributes, children and text."""

    tag: str
    attrs: dict[str, str]
    children: list[Element | str] = field(default_factory=list)

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    @property
    def text(self) -> str:
        """The text inside, whitespace collapsed and ``hidden`` elements left
        out: roughly what a person reads."""
        parts = [
            c if isinstance(c, str) else c.text
            for c in self.children
            if isinstance(c, str) or "hidden" not in c.attrs
        ]
        return " ".join(" ".join(parts).split())

    def iter(self) -> Iterator[Element]:
        yield self
        for child in self.children:
            if isinstance(child, Element):
                yield from child.iter()

    def by_id(self, element_id: str) -> Element:
        for element in self.iter():
            if element.attrs.get("id") == element_id:
                return element
        raise LookupError(f"no element #{element_id}")

    def by_class(self, name: str) -> list[Element]:
        return [e for e in self.iter() if name in e.classes]


# Elements that never have an end tag.
_VOID = {
    "area",
    "base",
    "br",
    "col",
    "embed",
    "hr",
    "img",
    "input",
    "link",
    "meta",
    "source",
    "track",
    "wbr",
}


class _TreeBuilder(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = Element(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(element)
        if tag not in _VOID:
            self.stack.append(element)

    def handle_endtag(self, tag: str) -> None:
        # Chromium's serialization is well formed; popping to the matching
        # tag only guards against a stray end tag.
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        if self.stack[-1].tag not in ("script", "style"):
            self.stack[-1].children.append(data)


def parse_dom(page: str) -> Element:
    """Parse a dumped DOM into :class:`Element` s."""
    builder = _TreeBuilder()
    builder.feed(page)
    builder.close()
    return builder.root


def main() -> int:
    """``python -m tests._browser``: install Chromium for the browser tests if missing."""
    path, why_not = ensure_chromium()
    if path is None:
        print(f"setup-browser: {why_not}")
        return 1
    print(f"setup-browser: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
