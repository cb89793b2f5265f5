"""Checkpoint files: load refuses what is not a small regular file unread; save is atomic; errors name the file."""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import re
import stat
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
from checkpoint_documents import (
    GOLDEN_FIELDS,
    GOLDEN_V1_PAYLOAD,
    GOLDEN_V3,
    SMALLEST_SCALE,
    assert_identical,
    document,
    golden,
    packb,
    v1_document,
    with_fields,
)

from cupy_amp.checkpoint import (
    FORMAT_VERSION,
    MAX_CHECKPOINT_BYTES,
    GradScalerCheckpoint,
)
from cupy_amp.errors import (
    CheckpointCorruptError,
    CheckpointFieldError,
    CheckpointVersionError,
    CupyAmpError,
)


def test_save_then_load_returns_the_same_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "scaler.ckpt"
    for checkpoint in (
        golden(),
        with_fields(scale=SMALLEST_SCALE, min_scale=None, found_overflow=False, found_overflow_local=False),
    ):
        checkpoint.save(target)
        assert_identical(GradScalerCheckpoint.load(target), checkpoint)
        assert GradScalerCheckpoint.load(str(target)) == checkpoint
    assert os.listdir(tmp_path) == ["scaler.ckpt"]


def test_version_1_field_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "old.ckpt"
    path.write_bytes(v1_document({**GOLDEN_V1_PAYLOAD, "remote_skipped_steps": 0}))
    with pytest.raises(
        CheckpointFieldError,
        match=rf"^checkpoint {re.escape(repr(str(path)))}: Invalid checkpoint: unknown field\(s\) 'remote_skipped",
    ):
        GradScalerCheckpoint.load(path)


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("empty", b""),
        ("pickle", pickle.dumps(GOLDEN_FIELDS)),
        ("pickle-of-checkpoint", pickle.dumps(golden())),
        ("json", json.dumps({**GOLDEN_FIELDS, "journal": GOLDEN_FIELDS["journal"].hex()}).encode()),
        ("plain-msgpack", packb(GOLDEN_FIELDS)),
        ("nul", b"\x00" * 64),
    ],
)
def test_foreign_files_are_corrupt_and_named(tmp_path: Path, name: str, content: bytes) -> None:
    path = tmp_path / f"{name}.ckpt"
    path.write_bytes(content)
    with pytest.raises(CheckpointCorruptError, match=re.escape(f"checkpoint {str(path)!r}")):
        GradScalerCheckpoint.load(path)


def test_zip_file_is_corrupt(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("scaler.ckpt", GOLDEN_V3.read_bytes())
    path = tmp_path / "scaler.zip"
    path.write_bytes(buffer.getvalue())
    with pytest.raises(CheckpointCorruptError, match="not a cupy-amp checkpoint"):
        GradScalerCheckpoint.load(path)


def test_missing_file_stays_a_file_not_found_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        GradScalerCheckpoint.load(tmp_path / "absent.ckpt")


def test_future_version_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "future.ckpt"
    path.write_bytes(document(version=packb(FORMAT_VERSION + 1)))
    with pytest.raises(CheckpointVersionError, match=re.escape(f"checkpoint {str(path)!r}")):
        GradScalerCheckpoint.load(path)


def test_huge_sparse_file_is_refused_without_being_read(tmp_path: Path) -> None:
    path = tmp_path / "huge.ckpt"
    with open(path, "wb") as file:
        file.write(GOLDEN_V3.read_bytes())
        file.truncate(2 * 1024**3)
    started = time.perf_counter()
    with pytest.raises(
        CheckpointCorruptError, match=re.escape(f"checkpoint {str(path)!r}: 2147483648 bytes, over the")
    ):
        GradScalerCheckpoint.load(path)
    assert time.perf_counter() - started < 1.0


def test_file_one_byte_over_the_limit_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "big.ckpt"
    path.write_bytes(b"\x00" * (MAX_CHECKPOINT_BYTES + 1))
    with pytest.raises(CheckpointCorruptError, match="limit"):
        GradScalerCheckpoint.load(path)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_device_is_refused_without_being_read() -> None:
    # /dev/zero reports size 0 and never ends.
    started = time.perf_counter()
    with pytest.raises(
        CheckpointCorruptError, match=r"^checkpoint '/dev/zero': a character device, not a regular file"
    ):
        GradScalerCheckpoint.load("/dev/zero")
    assert time.perf_counter() - started < 1.0


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_is_refused_at_once_instead_of_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "scaler.ckpt"
    os.mkfifo(fifo)
    started = time.perf_counter()
    with pytest.raises(CheckpointCorruptError, match="a FIFO, not a regular file"):
        GradScalerCheckpoint.load(fifo)
    assert time.perf_counter() - started < 1.0


def test_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointCorruptError, match="a directory, not a regular file"):
        GradScalerCheckpoint.load(tmp_path)


def test_save_replaces_an_existing_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "scaler.ckpt"
    target.write_bytes(b"old")
    golden().save(target)
    assert target.read_bytes() == GOLDEN_V3.read_bytes()
    assert os.listdir(tmp_path) == ["scaler.ckpt"]


def test_save_to_a_relative_path_in_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    golden().save("scaler.ckpt")
    assert GradScalerCheckpoint.load("scaler.ckpt") == golden()


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_saved_file_follows_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0o027)
    try:
        golden().save(tmp_path / "scaler.ckpt")
    finally:
        os.umask(previous)
    assert (tmp_path / "scaler.ckpt").stat().st_mode & 0o777 == 0o640


def test_stray_temporary_files_do_not_affect_load_or_save(tmp_path: Path) -> None:
    target = tmp_path / "scaler.ckpt"
    golden().save(target)
    stray = tmp_path / ".scaler.ckpt.tmp-0123456789abcdef"
    stray.write_bytes(GOLDEN_V3.read_bytes()[:100])
    assert GradScalerCheckpoint.load(target) == golden()
    other = with_fields(steps=5_000_000_001)
    other.save(target)
    assert GradScalerCheckpoint.load(target) == other
    assert sorted(os.listdir(tmp_path)) == [stray.name, "scaler.ckpt"]


def test_save_into_a_missing_directory_fails_cleanly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        golden().save(tmp_path / "absent" / "scaler.ckpt")
    assert os.listdir(tmp_path) == []


def test_save_over_a_directory_fails_and_leaves_no_temporary(tmp_path: Path) -> None:
    (tmp_path / "scaler.ckpt").mkdir()
    with pytest.raises(OSError):
        golden().save(tmp_path / "scaler.ckpt")
    assert os.listdir(tmp_path) == ["scaler.ckpt"]
    assert (tmp_path / "scaler.ckpt").is_dir()


def _fail(error: BaseException) -> Any:
    def fail(*args: object, **kwargs: object) -> Any:
        raise error

    return fail


@pytest.mark.parametrize(
    ("function", "error"),
    [
        ("fsync", OSError(errno.EIO, "Input/output error")),
        ("replace", OSError(errno.EXDEV, "Invalid cross-device link")),
        ("write", OSError(errno.ENOSPC, "No space left on device")),
        ("write", KeyboardInterrupt()),
    ],
)
def test_failed_save_keeps_the_old_file_and_removes_the_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, function: str, error: BaseException
) -> None:
    target = tmp_path / "scaler.ckpt"
    golden().save(target)
    before = target.read_bytes()
    monkeypatch.setattr(os, function, _fail(error))
    with pytest.raises(type(error)):
        with_fields(steps=7_000_000_000).save(target)
    monkeypatch.undo()
    assert target.read_bytes() == before
    assert os.listdir(tmp_path) == ["scaler.ckpt"]


def test_failure_after_a_partial_write_removes_the_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "scaler.ckpt"
    golden().save(target)
    real_write = os.write
    calls = []

    def write_then_fail(fd: int, data: bytes) -> int:
        calls.append(len(data))
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, bytes(data)[:10])

    monkeypatch.setattr(os, "write", write_then_fail)
    with pytest.raises(OSError, match="No space"):
        with_fields(steps=7_000_000_000).save(target)
    monkeypatch.undo()
    assert target.read_bytes() == GOLDEN_V3.read_bytes()
    assert os.listdir(tmp_path) == ["scaler.ckpt"]


def test_short_writes_are_continued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data)[:1]))
    golden().save(tmp_path / "scaler.ckpt")
    monkeypatch.undo()
    assert (tmp_path / "scaler.ckpt").read_bytes() == GOLDEN_V3.read_bytes()


def test_file_is_synced_before_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("dir-fsync" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync")
        real_fsync(fd)

    def replace(source: str, target: str) -> None:
        events.append("replace")
        real_replace(source, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    golden().save(tmp_path / "scaler.ckpt")
    assert events[:2] == ["fsync", "replace"]
    if os.name == "posix":
        assert events == ["fsync", "replace", "dir-fsync"]


def _fail_on_directories(monkeypatch: pytest.MonkeyPatch, error: OSError, *, on: str) -> list[int]:
    """Make os.open (on="open") or os.fsync (on="fsync") fail for directories only."""
    real_open, real_fsync = os.open, os.fsync
    directory_fds: list[int] = []

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if os.path.isdir(path):
            if on == "open":
                raise error
            fd = real_open(path, flags, *args, **kwargs)
            directory_fds.append(fd)
            return fd
        return real_open(path, flags, *args, **kwargs)

    def fsync(fd: int) -> None:
        if fd in directory_fds:
            raise error
        real_fsync(fd)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "fsync", fsync)
    return directory_fds


def test_directory_that_cannot_be_opened_is_not_synced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_on_directories(monkeypatch, PermissionError(errno.EACCES, "Permission denied"), on="open")
    golden().save(tmp_path / "scaler.ckpt")
    monkeypatch.undo()
    assert GradScalerCheckpoint.load(tmp_path / "scaler.ckpt") == golden()


def test_directory_sync_unsupported_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fds = _fail_on_directories(monkeypatch, OSError(errno.EINVAL, "Invalid argument"), on="fsync")
    golden().save(tmp_path / "scaler.ckpt")
    monkeypatch.undo()
    assert len(fds) == 1
    assert GradScalerCheckpoint.load(tmp_path / "scaler.ckpt") == golden()


def test_directory_sync_failure_is_reported_with_the_new_file_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "scaler.ckpt"
    _fail_on_directories(monkeypatch, OSError(errno.EIO, "Input/output error"), on="fsync")
    with pytest.raises(OSError, match="Input/output"):
        golden().save(target)
    monkeypatch.undo()
    assert GradScalerCheckpoint.load(target) == golden()
    assert os.listdir(tmp_path) == ["scaler.ckpt"]


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
@pytest.mark.parametrize("mode", [0o600, 0o640, 0o444])
def test_save_keeps_an_existing_files_permission_bits(tmp_path: Path, mode: int) -> None:
    target = tmp_path / "scaler.ckpt"
    golden().save(target)
    target.chmod(mode)
    previous = os.umask(0o022)
    try:
        with_fields(steps=7_000_000_000).save(target)
    finally:
        os.umask(previous)
    assert target.stat().st_mode & 0o777 == mode
    assert GradScalerCheckpoint.load(target).steps == 7_000_000_000


@pytest.mark.parametrize(
    ("function", "error"),
    [("write", OSError(errno.ENOSPC, "No space left on device")), ("fsync", OSError(errno.EIO, "Input/output error"))],
)
def test_a_failed_save_names_the_users_path_not_the_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, function: str, error: OSError
) -> None:
    target = tmp_path / "scaler.ckpt"
    monkeypatch.setattr(os, function, _fail(error))
    with pytest.raises(OSError) as info:
        golden().save(target)
    monkeypatch.undo()
    message = str(info.value)
    assert repr(str(target)) in message
    assert ".tmp-" not in message
    assert info.value.errno == error.errno
    assert os.listdir(tmp_path) == []


def test_a_save_into_a_missing_directory_names_the_path(tmp_path: Path) -> None:
    target = tmp_path / "absent" / "scaler.ckpt"
    with pytest.raises(FileNotFoundError) as info:
        golden().save(target)
    assert repr(str(target)) in str(info.value)
    assert ".tmp-" not in str(info.value)


@pytest.mark.parametrize("path", [None, 0, 1.5, "a\0b"], ids=["None", "int", "float", "NUL"])
def test_a_value_that_is_no_path_is_a_type_error_not_a_crash(path: Any) -> None:
    with pytest.raises(TypeError, match="path") as info:
        GradScalerCheckpoint.load(path)
    assert isinstance(info.value, CupyAmpError)
    with pytest.raises(TypeError, match="path"):
        golden().save(path)


def test_bytes_paths_and_the_longest_names_work(tmp_path: Path) -> None:
    long_name = tmp_path / ("c" * 250 + ".ckpt")  # 255 bytes: the most most file systems allow
    golden().save(long_name)
    assert GradScalerCheckpoint.load(long_name) == golden()
    as_bytes = os.fsencode(tmp_path / "scaler.ckpt")
    golden().save(as_bytes)  # type: ignore[arg-type]
    assert GradScalerCheckpoint.load(as_bytes) == golden()  # type: ignore[arg-type]
    assert sorted(os.listdir(tmp_path)) == sorted([long_name.name, "scaler.ckpt"])


def test_a_released_memoryview_is_a_type_error() -> None:
    view = memoryview(GOLDEN_V3.read_bytes())
    view.release()
    with pytest.raises(TypeError, match="released"):
        GradScalerCheckpoint.from_bytes(view)  # type: ignore[arg-type]
