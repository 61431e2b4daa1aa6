"""Shared fixtures.  Component fixtures live beside their tests (tests/<component>/conftest.py)."""

import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def repo_root() -> pathlib.Path:
    return REPO
