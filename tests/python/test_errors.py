"""Each C++ error type arrives in Python as one type with its fields (bindings/errors.cpp):
IoError as OSError with errno, filename, offset and length; FormatError and bad arguments as
ValueError; CudaError and CuFileError as their own classes, with the driver's code."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

import tensortier
from tensortier import IOHandle, _core

from faults import with_faults

NO_DRIVER = not _core.cuda_driver()["available"]


def test_io_error_is_oserror_with_errno_path_offset_and_length(disk_dir: Path) -> None:
    path = disk_dir / "faulty.bin"
    path.write_bytes(os.urandom(3 << 20))
    fault = {"kind": "error", "errno": errno.EIO, "nth": 2, "writes": False}
    with with_faults(fault, IOHandle, "threads", chunk_size=1 << 20, page_cache_check=False) as io:
        with pytest.raises(OSError) as caught:
            io.pread(bytearray(3 << 20), path)
    e = caught.value
    assert type(e) is OSError and e.errno == errno.EIO
    assert e.filename == str(path)
    # One 1 MiB chunk failed (which one depends on the order the workers take them).
    assert e.offset in (0, 1 << 20, 2 << 20) and e.length == 1 << 20, (e.offset, e.length)
    assert isinstance(e.op, str) and e.op
    assert f"offset {e.offset} length {e.length}" in str(e)


def test_missing_file_is_file_not_found_naming_it(disk_dir: Path) -> None:
    missing = disk_dir / "absent" / "x.bin"
    with pytest.raises(FileNotFoundError) as caught:
        _core.File.open(str(missing), "r", True)
    e = caught.value
    assert e.errno == errno.ENOENT and e.filename == str(missing)
    assert e.offset == 0 and e.length == 0 and e.op


def test_format_error_is_value_error() -> None:
    header = b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 99]}}'
    with pytest.raises(ValueError, match="w") as caught:
        _core.parse_safetensors_header(header, 16)
    # A file's damage: tensortier._core.FormatError, a ValueError of its own (load raises the
    # type torch or safetensors raises for the file from it).
    assert type(caught.value) is _core.FormatError and issubclass(_core.FormatError, ValueError)


def test_bad_argument_is_value_error() -> None:
    with pytest.raises(ValueError, match="gds must be 'off', 'auto' or 'on', not 'x'"):
        _core.gds_mode("x")


@pytest.mark.skipif(not NO_DRIVER, reason="a CUDA driver is installed here")
def test_cuda_error_is_its_own_class_with_the_code() -> None:
    with pytest.raises(tensortier.CudaError) as caught:
        _core.PinnedMemory(4096)
    e = caught.value
    assert isinstance(e, RuntimeError) and not isinstance(e, OSError)
    assert isinstance(e.code, int) and e.code != 0
    assert "libcuda.so.1" in str(e)


def test_cufile_error_is_its_own_class_with_the_code(disk_dir: Path) -> None:
    if _core.cufile()["available"]:
        pytest.skip("cuFile is installed here")
    f = _core.File.open(str(disk_dir / "g.bin"), "w", True)
    with pytest.raises(tensortier.CuFileError, match="cuFile unavailable") as caught:
        _core.DeviceFile(f, "on")
    e = caught.value
    assert isinstance(e, RuntimeError) and not isinstance(e, tensortier.CudaError)
    assert e.code == -1


def test_a_failed_write_keeps_its_errno_subclass_and_range(disk_dir: Path) -> None:
    path = disk_dir / "full.bin"
    path.write_bytes(os.urandom(1 << 20))
    fault = {"kind": "error", "errno": errno.ENOSPC, "nth": 1, "reads": False}
    with with_faults(fault, IOHandle, "threads") as io:
        with pytest.raises(OSError) as caught:
            io.pwrite(bytearray(1 << 20), path)
    e = caught.value
    assert e.errno == errno.ENOSPC and e.filename == str(path)
    assert e.offset == 0 and e.length == 1 << 20
