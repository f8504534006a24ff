"""Rollout workers on Ray: `RolloutFleet` (install with `pip install 'rollout[ray]'`). Nothing else in rollout imports
Ray."""

from __future__ import annotations

from rollout.cli.extras import require_extra

# Without Ray, `import rollout.ray` is one line naming the pip command (MissingExtra, an ImportError).
require_extra("ray", "rollout.ray")

from rollout.ray.fleet import RolloutFleet  # noqa: E402 - after the check, so its error says what to install

__all__ = ["RolloutFleet"]
