"""A replica measured on the real engine, as the simulator needs it: speed, sizes, start-up.

Read from the file bench/engine_profile.py writes (schema ``rewarm.engine_profile/1``, its
docstring): ``speed`` (agent/speed.py's :class:`SpeedProfile`), ``engine`` (``max_seqs``,
``max_seq_len``, ``kv_capacity_tokens``, ``prefill_chunk``) and ``startup`` (seconds per tier,
:class:`~agent.sim.fleet.StartupTimes`; optional).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent.errors import ConfigError
from agent.sim.fleet import StartupTimes
from agent.speed import SpeedProfile, read_profile_file

ENGINE_KEYS = ("max_seqs", "max_seq_len", "kv_capacity_tokens")


@dataclass(frozen=True)
class ReplicaProfile:
    """One replica of the profiled engine: its speed, ``max_seqs`` slots of ``max_seq_len``
    tokens (``kv_capacity_tokens`` in all) and start-up seconds per tier (None: not measured,
    the simulator keeps its own)."""

    speed: SpeedProfile
    max_seqs: int
    max_seq_len: int
    kv_capacity_tokens: int
    startup: StartupTimes | None = None
    source: str = ""

    @classmethod
    def from_file(cls, path: Path) -> ReplicaProfile:
        """Raises :class:`ConfigError` naming the file and the key (as
        :meth:`SpeedProfile.from_file`, plus an ``engine`` size that is not an int >= 1)."""
        data = read_profile_file(path)
        speed = SpeedProfile.from_file(path)
        engine = data.get("engine")
        if not isinstance(engine, dict):
            raise ConfigError(f"engine profile {path}: 'engine' is {type(engine).__name__}, "
                              "not an object", name="engine", value=engine, limit="object")
        sizes = {}
        for key in ENGINE_KEYS:
            v = engine.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"engine profile {path}: engine.{key}={v!r} must be an "
                                  "integer >= 1", name=key, value=v, limit=1)
            sizes[key] = v
        startup = None
        if data.get("startup") is not None:
            startup = StartupTimes.from_dict(data["startup"], path)
        return cls(speed, startup=startup, source=str(path), **sizes)
