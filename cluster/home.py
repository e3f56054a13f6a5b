"""This machine's nightshift directory (`$NIGHTSHIFT_HOME`, else the user's cache dir): the head's Ray token, the
engines' core claims and start slots, the embedded model's conversion, caches. The bottom of the import graph:
`cluster/` and `pipeline/` both find it here."""

from __future__ import annotations

import os
from pathlib import Path


def nightshift_home() -> Path:
    import platformdirs

    env = os.environ.get("NIGHTSHIFT_HOME")
    return Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("nightshift"))
