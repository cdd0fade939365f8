"""posttrain's cache folder and the one way things are built into it.

Built-in models (the tiny ones, the converted SmolLM2) and compiled kernels live under
``$POSTTRAIN_CACHE`` or ``~/.cache/posttrain``. Each entry is built into a temporary sibling folder
and renamed into place, so a reader never sees half an entry; an entry damaged later (a truncated
copy, a full disk) is found when it is next used and built again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    """The cache folder: $POSTTRAIN_CACHE, else ~/.cache/posttrain."""
    root = os.environ.get("POSTTRAIN_CACHE") or os.path.join(Path.home(), ".cache", "posttrain")
    return Path(root)


def damage(folder: Path) -> str | None:
    """What is wrong with a built cache folder, or None: a safetensors file shorter or longer than its header
    says (a truncated copy, a disk that filled), or a JSON file that does not parse."""
    import json
    import struct

    for path in sorted(folder.iterdir()):
        try:
            if path.suffix == ".safetensors":
                with open(path, "rb") as f:
                    (length,) = struct.unpack("<Q", f.read(8))
                    header = json.loads(f.read(length))
                end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
                if path.stat().st_size != 8 + length + end:
                    return f"{path.name} is {path.stat().st_size} bytes, its header says {8 + length + end}"
            elif path.suffix == ".json":
                json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, KeyError, TypeError, struct.error) as err:
            return f"{path.name} cannot be read ({type(err).__name__}: {err})"
    return None


def build_in(target: Path, builder) -> Path:
    """Build into a temporary sibling folder, then rename: concurrent builders never see half a folder. A
    built folder found damaged (`damage`) is moved aside and built again."""
    if (target / "config.json").exists() or (target / "tokenizer.json").exists():
        problem = damage(target)
        if problem is None:
            return target
        logger.warning(f"cache entry {target} is damaged ({problem}): building it again")
        aside = target.with_name(f"{target.name}.damaged-{os.getpid()}")
        with contextlib.suppress(OSError):  # another process may have moved it already
            os.replace(target, aside)
        shutil.rmtree(aside, ignore_errors=True)
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
