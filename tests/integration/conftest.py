"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.lighthouse_helpers import Lighthouses


@pytest.fixture
def lh() -> Iterator[Lighthouses]:
    """Lighthouses started on demand; all are shut down after the test."""
    lighthouses = Lighthouses()
    try:
        yield lighthouses
    finally:
        lighthouses.close()
