"""Small files read with a bound and written atomically (checkpoints, the demo's state)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat

from cupy_amp.errors import ArgumentTypeError

__all__ = ["file_path", "read_file_start", "read_regular_file", "write_file_atomic"]

logger = logging.getLogger(__name__)

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def file_path(path: object) -> str:
    """Return ``path`` (a str, bytes or os.PathLike path) as a str.

    Raises:
        ArgumentTypeError: It is not a path (``None``, a number), or holds a NUL character.
    """
    try:
        text = os.fsdecode(os.fspath(path))  # type: ignore[call-overload]
    except TypeError:
        raise ArgumentTypeError(
            f"Expected a file path (str, bytes or os.PathLike), got {type(path).__name__}."
        ) from None
    if "\0" in text:
        raise ArgumentTypeError(f"Expected a file path, got {text!r}, which holds a NUL character.")
    return text


def read_regular_file(path: str | os.PathLike[str], limit: int, error: type[Exception]) -> bytes:
    """Return the bytes of the regular file at ``path``, refusing anything else or anything over ``limit``.

    The file is opened without blocking (a FIFO with no writer would wait
    forever) and checked with ``os.fstat`` before a byte is read; at most
    ``limit + 1`` bytes are read, so a file whose size is not what it reports
    costs no more.

    Raises:
        error: Not a regular file, or larger than ``limit`` (the message says which).
        OSError: The file cannot be opened or read; passed through unchanged.
    """
    data = _read_regular(path, limit, error, whole=True)
    if len(data) > limit:
        raise error(f"more than {limit} bytes, over the {limit}-byte limit; refusing to read it.")
    return data


def read_file_start(path: str | os.PathLike[str], count: int, error: type[Exception]) -> bytes:
    """Return the first ``count`` bytes (fewer if it is shorter) of the regular file at ``path``.

    Raises:
        error: Not a regular file.
        OSError: The file cannot be opened or read; passed through unchanged.
    """
    return _read_regular(path, count - 1, error, whole=False)


def _read_regular(path: str | os.PathLike[str], limit: int, error: type[Exception], *, whole: bool) -> bytes:
    """Read at most ``limit + 1`` bytes of a regular file (refusing, when ``whole``, one over ``limit``)."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(file_path(path), flags)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = _KINDS.get(stat.S_IFMT(info.st_mode), "not a regular file")
            raise error(f"{kind}, not a regular file; refusing to read it.")
        if whole and info.st_size > limit:
            raise error(f"{info.st_size} bytes, over the {limit}-byte limit; refusing to read it.")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)


def write_file_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data`` so that readers see the old file or the new one, never a mix.

    The bytes go to a temporary file ``.<name>.tmp-<random hex>`` in the same
    directory, which is flushed to disk (``os.fsync``) and renamed over
    ``path`` (``os.replace``); the directory is then synced so the rename
    survives a power loss. A symlink at ``path`` is replaced, not followed.
    An existing file's permission bits are kept; a new file's follow the
    umask. A writer killed half-way leaves its temporary file behind: it is
    never read, and the next save ignores it.

    Raises:
        OSError: Writing, syncing or renaming failed, naming ``path``. The
            temporary file is removed and ``path`` keeps its previous content
            (or still does not exist). If only the final directory sync fails,
            ``path`` already holds the new content but the rename may not
            survive a power loss.
    """
    target = file_path(path)
    directory, name = os.path.split(target)
    directory = directory or os.curdir
    # Short enough beside any legal name (255 bytes at most on most file systems).
    temporary = os.path.join(directory, f".{name[:200]}.tmp-{secrets.token_hex(8)}")
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        mode = None
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(temporary, flags, 0o666)
        try:
            try:
                if mode is not None and hasattr(os, "fchmod"):
                    os.fchmod(fd, mode)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temporary, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        _fsync_directory(directory)
    except OSError as exc:
        # Name the user's path, not the temporary file, keeping the error's class (FileNotFoundError...).
        raise type(exc)(exc.errno, f"cannot save {target!r}: {exc.strerror or exc}") from exc


def _fsync_directory(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        # Windows cannot open a directory this way; its rename needs no directory sync.
        logger.debug("Cannot open directory %r to sync it; skipping the directory sync.", directory)
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some file systems cannot sync a directory at all; any other failure is reported.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        logger.debug("File system cannot sync directory %r: %s", directory, exc)
    finally:
        os.close(fd)
