"""Reading a saved component's directory: every file present, and a config JSON of the right format."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

from .errors import CwmError

# The saved components (encoder E, transition F, ranker R) share one config format:
# {"format": "cwm.<component>", "version": CONFIG_VERSION, "config": {...}, ...} beside their weights.
CONFIG_VERSION = 1
# Format names written before the components shared one; read as version 1 of the current name.
_LEGACY_FORMATS = {"cwm-state-encoder": "cwm.encoder", "cwm.transition/1": "cwm.transition",
                   "cwm-lambda-ranker": "cwm.ranker"}


def write_config(path: Path, fmt: str, config: dict, **fields) -> None:
    """Write a saved component's config file (see ``CONFIG_VERSION``) atomically."""
    meta = {"format": fmt, "version": CONFIG_VERSION, "config": config, **fields}
    atomic_write_text(Path(path), json.dumps(meta, indent=2, sort_keys=True) + "\n")


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
    if not isinstance(meta, dict):
        raise CwmError(f"{cfg_path} is not a cwm {what} config")
    legacy = meta.get("format") in _LEGACY_FORMATS
    if _LEGACY_FORMATS.get(meta.get("format"), meta.get("format")) != fmt:
        raise CwmError(f"{cfg_path} is not a cwm {what} config")
    version = meta.get("version", CONFIG_VERSION if legacy else None)
    if version != CONFIG_VERSION:
        raise CwmError(f"{cfg_path} has format version {version}, this cwm reads version {CONFIG_VERSION}")
    return meta


def save_figure(fig, path: str | Path, dpi: int = 90) -> None:
    """Save a matplotlib figure atomically (temporary file, then rename); close it either way."""
    import matplotlib.pyplot as plt

    path = Path(path)
    fmt = path.suffix[1:].lower() or "png"
    try:
        with atomic_file(path) as tmp:
            fig.savefig(tmp, dpi=dpi, format=fmt)
    except OSError as err:
        raise CwmError(f"cannot write {path}: {err.strerror or err}") from None
    except ValueError as err:  # an unknown format
        raise CwmError(f"cannot write {path}: {str(err).splitlines()[0]}") from None
    finally:
        plt.close(fig)


TEMP_MARK = ".tmp"  # temporary files and directories are named ``.<name>.tmp<pid>``


def _temp_path(path: Path, kind: str = TEMP_MARK) -> Path:
    return path.with_name(f".{path.name}{kind}{os.getpid()}")


@contextmanager
def atomic_file(path: str | os.PathLike):
    """Yield a temporary sibling of ``path`` to write; it replaces ``path`` when the block ends and
    is deleted if the block fails: readers see the old or the new file, never a part."""
    path = Path(path)
    if path.is_dir():
        raise CwmError(f"cannot write {path}: it is a directory")
    tmp = _temp_path(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``path`` through a temporary file and a rename: readers see the old or the new file."""
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """``atomic_write_text`` for bytes."""
    try:
        with atomic_file(path) as tmp, open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise CwmError(f"cannot write {path}: {err.strerror or err}") from None


def ensure_directory(path: str | os.PathLike, what: str = "directory") -> Path:
    """Create ``path`` (and parents) or fail with a clear error if it is a file or not writable."""
    path = Path(path)
    try:
        if path.exists() and not path.is_dir():
            raise CwmError(f"{what} {path} is a file, not a directory")
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # e.g. a parent that cannot be read or written
        raise CwmError(f"cannot create {what} {path}: {err.strerror or err}") from None
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale(entry: Path, kind: str) -> bool:
    """``entry`` is a temporary ``.<name><kind><pid>`` of a process that no longer runs."""
    name = entry.name
    if not name.startswith(".") or kind not in name:
        return False
    pid = name.rsplit(kind, 1)[1]
    return pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid))


def remove_stale_temp_files(directory: str | os.PathLike) -> int:
    """Delete temporary files left in ``directory`` by killed processes; returns how many."""
    import shutil

    removed = 0
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    for entry in directory.iterdir():
        if _stale(entry, TEMP_MARK):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed += 1
    return removed


@contextmanager
def atomic_directory(path: str | os.PathLike):
    """Build a directory in a temporary sibling, then swap it in: ``path`` is always absent, the
    complete old directory or the complete new one, even if the process is killed meanwhile.

    Yields the temporary directory to write into. A half-written temporary directory or a
    displaced old one left behind by a killed process is deleted the next time.
    """
    import shutil

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CwmError(f"{path} is a file, not a directory")
    ensure_directory(path.parent)
    for entry in path.parent.iterdir():
        if entry.name.startswith(f".{path.name}.") and (_stale(entry, TEMP_MARK) or _stale(entry, ".old")):
            shutil.rmtree(entry, ignore_errors=True)
    tmp = _temp_path(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = _temp_path(path, ".old")
    try:
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    except OSError as err:
        raise CwmError(f"cannot replace {path}: {err.strerror or err}") from None
    shutil.rmtree(old, ignore_errors=True)


def portable_path(path) -> str:
    """A shipped model as ``cwm/pretrained/NAME``, a path under the working directory relative to it:
    results committed from one checkout read the same in another."""
    import cwm

    path = Path(path).resolve()
    for base in (Path(cwm.__file__).parent.parent, Path.cwd().resolve()):
        if path.is_relative_to(base):
            return str(path.relative_to(base))
    return str(path)
