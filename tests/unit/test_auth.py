"""The job token: one place reads it, servers compare it in constant time."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftdist._auth import bearer, job_token, token_matches


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
