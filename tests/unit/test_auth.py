"""The job token: one place reads it, servers compare it in constant time."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftdist._auth import TlsFiles, bearer, job_token, refusal, tls_files, token_matches
from ftdist.process_group._store import store_bind_host


def test_precedence_argument_then_environment_then_file(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text("from-file\n")
    env = {"FTDIST_JOB_TOKEN": "from-env", "FTDIST_JOB_TOKEN_FILE": str(f)}
    assert job_token("given", env) == "given"
    assert job_token(None, env) == "from-env"
    assert job_token(None, {"FTDIST_JOB_TOKEN_FILE": str(f)}) == "from-file"
    assert job_token(None, {}) is None


@pytest.mark.parametrize("bad", ["has space", "tab\t", "é", "x" * 5000])
def test_bad_tokens_are_refused_naming_their_source(bad: str) -> None:
    with pytest.raises(ValueError, match="FTDIST_JOB_TOKEN"):
        job_token(None, {"FTDIST_JOB_TOKEN": bad})
    with pytest.raises(ValueError, match="the token argument"):
        job_token(bad, {})


def test_empty_token_file_is_an_error(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        job_token(None, {"FTDIST_JOB_TOKEN_FILE": str(f)})


def test_matching() -> None:
    assert token_matches(bearer("s3cret"), "s3cret")
    assert token_matches(bearer("s3cret").encode(), "s3cret")
    assert not token_matches(bearer("s3cre"), "s3cret")
    assert not token_matches("s3cret", "s3cret")  # no Bearer scheme
    assert not token_matches(None, "s3cret")
    assert not token_matches(b"\xff\xfe", "s3cret")
    assert token_matches(None, None)  # no job token: open


def test_a_token_file_argument_comes_after_the_token_and_before_the_environment(
    tmp_path: Path,
) -> None:
    f = tmp_path / "token"
    f.write_text("  from-flag\n")
    env = {"FTDIST_JOB_TOKEN": "from-env"}
    assert job_token(None, env, token_file=str(f)) == "from-flag"
    assert job_token("given", env, token_file=str(f)) == "given"
    with pytest.raises(OSError):
        job_token(None, env, token_file=str(tmp_path / "missing"))


def test_refusal_says_what_is_missing_or_wrong() -> None:
    assert refusal(bearer("t"), "t", "this lighthouse") is None
    assert refusal(None, None, "this lighthouse") is None
    missing = refusal(None, "t", "this lighthouse")
    assert missing is not None
    assert missing.startswith("this lighthouse requires the job token: set FTDIST_JOB_TOKEN")
    wrong = refusal(bearer("x"), "t", "this lighthouse")
    assert wrong is not None and "is not the job's token" in wrong and "x" not in wrong.split()


def test_tls_files_come_from_arguments_then_environment() -> None:
    env = {"FTDIST_TLS_CERT": "c.pem", "FTDIST_TLS_KEY": "k.pem", "FTDIST_TLS_CA": "ca.pem"}
    assert tls_files(environ=env) == TlsFiles("c.pem", "k.pem", "ca.pem", None)
    assert tls_files(ca="mine.pem", environ=env).ca == "mine.pem"
    assert tls_files(environ={}) == TlsFiles()
    with pytest.raises(ValueError, match="certificate and its key together"):
        tls_files(environ={"FTDIST_TLS_CERT": "c.pem"})


@pytest.mark.parametrize(
    ("hostname", "env", "expected"),
    [
        ("127.0.0.1", {}, "127.0.0.1"),  # a local job stays on loopback
        ("10.1.2.3", {}, "10.1.2.3"),
        ("[::1]", {}, "::1"),
        ("0.0.0.0", {}, None),
        ("localhost", {}, None),  # resolves to loopback: no safe choice
        ("anything", {"FTDIST_STORE_BIND": "10.9.9.9"}, "10.9.9.9"),
        ("10.1.2.3", {"FTDIST_STORE_BIND": "0.0.0.0"}, None),
    ],
)
def test_where_a_replica_groups_own_store_listens(
    hostname: str, env: dict[str, str], expected: str | None
) -> None:
    assert store_bind_host(hostname, env) == expected
