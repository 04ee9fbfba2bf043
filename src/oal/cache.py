"""The user cache directory shared by model loading (converted GGUF weights) and data (token ids).

``$OAL_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/oal``, else ``~/.cache/oal``. Nothing in it is needed for
correctness: deleting it only makes the next run rebuild what it held.
"""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    """The cache root (not created here)."""
    env = os.environ.get("OAL_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "oal"
