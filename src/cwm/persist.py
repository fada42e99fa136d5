"""Reading a saved component's directory: every file present, and a config JSON of the right format."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import CwmError


def read_config(directory: Path, config_file: str, other_files: tuple[str, ...], fmt: str, what: str) -> dict:
    """The parsed config of a saved ``what`` (e.g. "ranker"); CwmError naming the missing or bad file."""
    directory = Path(directory)
    for name in (config_file, *other_files):
        if not (directory / name).is_file():
            raise CwmError(f"{what} file missing: {directory / name}")
    cfg_path = directory / config_file
    try:
        meta = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise CwmError(f"cannot read {cfg_path}: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        raise CwmError(f"{cfg_path} is not a cwm {what} config")
    return meta
