"""The trainer side of rollout: `RolloutClient`, weight sync and the TRL integration.

Nothing is exported yet: the worker/client protocol lands next (see the project's issues). This package exists now
so the distribution layout matches DESIGN.md.
"""
