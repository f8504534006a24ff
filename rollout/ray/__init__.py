"""Rollout workers on Ray: `RolloutFleet` (install with `pip install 'rollout[ray]'`). Nothing else in rollout imports
Ray."""

from __future__ import annotations

try:
    import ray  # noqa: F401 - checked here so that the error says what to install
except ImportError as error:  # pragma: no cover - the extra is missing
    raise ImportError("rollout.ray needs Ray: pip install 'rollout[ray]'") from error

from rollout.ray.fleet import RolloutFleet

__all__ = ["RolloutFleet"]
