"""Local-folder side of ``trainer.storage``: atomic writes with the modes ``open()`` would give."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainer import storage


@pytest.fixture
def umask_027() -> Iterator[None]:
    old = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_written_files_follow_the_umask_not_mkstemps_0600(tmp_path: Path, umask_027) -> None:
    source = tmp_path / "source.bin"
    source.write_bytes(b"payload")  # open(): 0o666 & ~umask
    expected = _mode(source)
    assert expected == 0o640

    storage.write_bytes(str(tmp_path / "a" / "metrics.json"), b"{}")
    storage.upload_file(source, str(tmp_path / "b" / "model.onnx"))
    storage.download_file(str(source), tmp_path / "c" / "copy.bin")

    for path in (tmp_path / "a/metrics.json", tmp_path / "b/model.onnx", tmp_path / "c/copy.bin"):
        assert _mode(path) == expected, path
        assert path.read_bytes() in (b"{}", b"payload")
    leftovers = [p.name for p in tmp_path.rglob(".*.tmp")]
    assert leftovers == []  # the temporary files were renamed, none left behind


def test_failed_download_leaves_no_temporary_file(tmp_path: Path) -> None:
    dest = tmp_path / "out" / "x.bin"
    with pytest.raises(storage.StorageError, match="does not exist"):
        storage.download_file(str(tmp_path / "missing.bin"), dest)
    assert list((tmp_path / "out").iterdir()) == []
