"""File helpers shared by the scale tools: hashing and atomic (staged) outputs."""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from kvcap.errors import KvcapError

logger = logging.getLogger(__name__)

_CHUNK = 8 << 20
_STAGING_TAG = ".kvcap-staging-"


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes (follows symlinks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `path` through a temporary sibling and an atomic rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_png(path: Path, fig, dpi: int) -> None:
    """A matplotlib figure as PNG, rendered in memory and written with atomic_write_bytes: a
    failed or stopped write never leaves a truncated figure (savefig writes in place)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    atomic_write_bytes(Path(path), buf.getvalue())


def atomic_write_text(path: Path, text: str, errors: str = "strict") -> None:
    """atomic_write_bytes of `text` in UTF-8; errors="backslashreplace" writes a lone
    surrogate (an undecodable byte of a path or argv) as its `\\udcff` escape, which inside a
    JSON string reads back as the same value."""
    atomic_write_bytes(path, text.encode("utf-8", errors=errors))


def make_dirs(path: Path, error: type[KvcapError]) -> None:
    """`mkdir -p path`, refusing with one line (not an OSError traceback) when a component is
    an existing file or cannot be created."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise error(f"cannot create directory {path}: {e.strerror or e} (is a part of the "
                    "path an existing file?)") from None


def lies_within(path: Path, directory: Path) -> bool:
    """`path` is `directory` or lies below it (both as the caller resolved them: an output
    that does not exist yet is resolved up to its parent)."""
    return path == directory or directory in path.parents


def check_can_create(out: Path, error: type[KvcapError]) -> None:
    """Refuse, before any long work, an output path that could not be created: its nearest
    existing ancestor is a file, or a directory this process cannot write into."""
    parent = Path(out).absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise error(f"cannot create {out}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise error(f"cannot create {out}: no permission to write into {parent}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_staging(out: Path) -> None:
    """Remove staging dirs of `out` left by processes that died (crash, SIGKILL)."""
    prefix = f".{out.name}{_STAGING_TAG}"
    if not out.parent.is_dir():
        return
    for entry in out.parent.iterdir():
        if not entry.name.startswith(prefix):
            continue
        pid_text = entry.name[len(prefix):]
        if pid_text.isdigit() and int(pid_text) != os.getpid() and not _pid_alive(int(pid_text)):
            logger.warning("removing stale staging directory %s of a dead process", entry)
            shutil.rmtree(entry, ignore_errors=True)


@contextlib.contextmanager
def staged_dir(out: Path, error: type[KvcapError]) -> Iterator[Path]:
    """Build a directory in a hidden sibling and rename it to `out` only on success.

    `out` must not exist. On any exception (including KeyboardInterrupt) the staging
    directory is removed and `out` is never created.
    """
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise error(f"output {out} already exists; refusing to overwrite it")
    make_dirs(out.parent, error)
    remove_stale_staging(out)
    stage = out.parent / f".{out.name}{_STAGING_TAG}{os.getpid()}"
    if stage.exists():
        shutil.rmtree(stage)
    try:
        stage.mkdir()
    except OSError as e:  # (a read-only or unwritable parent was an OSError traceback)
        raise error(f"cannot create {out}: {e.strerror or e} in {out.parent}") from None
    try:
        yield stage
        if out.exists() or out.is_symlink():
            raise error(f"output {out} appeared while it was being built; not overwriting it")
        os.rename(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
