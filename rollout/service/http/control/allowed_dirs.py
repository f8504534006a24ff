"""`AllowedDirs`: the directories an operator lets control routes read from (`--control-allowed-dirs`): a weight
update's checkpoint (/update_weights) and a LoRA adapter (/v1/load_lora_adapter) are read only from inside them, so
that a caller cannot make the worker read any other file it can (symbolic links are followed before the check)."""

from __future__ import annotations

import os
from pathlib import Path

from rollout.service.http.errors import APIError


class AllowedDirs:
    """Resolves a path a request names and refuses it unless it lies inside an allowed directory."""

    def __init__(self, roots: tuple[str, ...]):
        """
        Args:
            roots: the allowed directories (empty: control routes may read nothing).
        """
        self.roots = tuple(Path(os.path.realpath(os.path.expanduser(root))) for root in roots)

    def directory(self, path: object, field: str) -> Path:
        """The real path of the directory `path` names, checked.

        Args:
            path: what the request gave.
            field: the request field it came from (errors name it).
        Raises:
            APIError: 400 not a non-empty string; 403 outside every allowed directory (or none is allowed); 404 no
                such directory.
        """
        if not isinstance(path, str) or not path:
            raise APIError(400, f"{field}: must be a directory path (a non-empty string)", field)
        if not self.roots:
            message = (
                f"{field}: this worker reads no directory for control routes: start it with --control-allowed-dirs"
            )
            raise APIError(403, message, field, "permission_error")
        try:
            real = Path(os.path.realpath(os.path.expanduser(path)))
        except (ValueError, OSError) as error:  # a NUL byte
            raise APIError(400, f"{field}: not a usable path ({error})", field) from None
        if not any(real == root or root in real.parents for root in self.roots):
            allowed = ", ".join(str(root) for root in self.roots)
            reason = f"{path!r} is outside the allowed directories ({allowed})"
            raise APIError(403, f"{field}: {reason}", field, "permission_error")
        try:
            if not real.is_dir():
                raise APIError(404, f"{field}: no such directory: {path!r}", field, "not_found_error")
            for entry in real.iterdir():  # a file linked from elsewhere would be read through the directory
                if entry.is_symlink() and Path(os.path.realpath(entry)).parent != real:
                    reason = f"{entry.name} in {path!r} is a link to a file outside it"
                    raise APIError(403, f"{field}: {reason}", field, "permission_error")
        except OSError as error:  # unreadable (permissions), a name too long
            raise APIError(400, f"{field}: cannot read {path!r} ({error.strerror or error})", field) from None
        return real
