"""posttrain's cache folder and the one way things are built into it.

Built-in models (the tiny ones, the converted SmolLM2) and compiled kernels live under
``$POSTTRAIN_CACHE`` or ``~/.cache/posttrain``. Each entry is built into a temporary sibling folder
and renamed into place, so a reader never sees half an entry.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """The cache folder: $POSTTRAIN_CACHE, else ~/.cache/posttrain."""
    root = os.environ.get("POSTTRAIN_CACHE") or os.path.join(Path.home(), ".cache", "posttrain")
    return Path(root)


def build_in(target: Path, builder) -> Path:
    """Build into a temporary sibling folder, then rename: concurrent builders never see half a folder."""
    if (target / "config.json").exists() or (target / "tokenizer.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        builder(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
