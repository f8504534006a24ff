"""Modules that moved to a new home keep their old import paths, with a `DeprecationWarning` naming the new one.

`import rollout.service.protocol` (or `from rollout.service.presets import tiny_model`) still works: a finder on
`sys.meta_path` answers each old name with the module now at its new name (the same module object, so its state and
its classes are shared). `rollout/__init__.py` installs the finder, so every path under `rollout` and
`trainer_bridge` is covered once either package is imported (`trainer_bridge` imports `rollout`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

# Old module name -> where it lives now. Every entry is a path a release documented or a user could have imported.
MOVED_MODULES: dict[str, str] = {
    # the wire contract, shared by the worker and the trainer side
    "rollout.service.protocol": "rollout.protocol",
    "rollout.service.messages": "rollout.protocol.messages",
    "rollout.service.codec": "rollout.protocol.codec",
    "rollout.service.route_frames": "rollout.protocol.route_frames",
    "rollout.service.sockets": "rollout.protocol.sockets",
    "rollout.service.auth": "rollout.protocol.auth",
    "rollout.service.staging": "rollout.protocol.staging",
    "rollout.service.dist": "rollout.protocol.dist",
    "rollout.service.groups": "rollout.protocol.group_folding",
    # the built-in presets' public home
    "rollout.service.presets": "rollout.presets",
    "rollout.service.preset_catalog": "rollout.presets.catalog",
    "rollout.service.preset_names": "rollout.presets.names",
    "rollout.service.agent_preset": "rollout.presets.agent",
}


class MovedModuleLoader(importlib.abc.Loader):
    """Loads an old module name as the module at its new name."""

    def __init__(self, new_name: str):
        """
        Args:
            new_name: the module's name now.
        """
        self.new_name = new_name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.new_name}: import it from there (the old path will be removed)",
            DeprecationWarning,
            stacklevel=find_caller_level(),
        )
        return importlib.import_module(self.new_name)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module at its new name is already executed."""


def find_caller_level() -> int:
    """The `stacklevel` of the first frame outside the import machinery (the user's import statement)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen") or frame.f_globals is globals()):
        frame, level = frame.f_back, level + 1
    return level


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of `MOVED_MODULES`."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec:
        new_name = MOVED_MODULES.get(fullname)
        if new_name is None:
            return None  # type: ignore[return-value]
        return importlib.machinery.ModuleSpec(fullname, MovedModuleLoader(new_name))


def install() -> None:
    """Put the finder on `sys.meta_path` (once)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
