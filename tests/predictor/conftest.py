"""The Nomad stand-in for the ``rewarm predictor`` command test."""

import pathlib
import sys

_REPO = pathlib.Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from tests.standins import nomad_standin  # noqa: E402,F401
