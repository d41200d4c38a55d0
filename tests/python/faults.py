"""Fault injection for the tests, through the test-only module tensortier._testing (built with
TENSORTIER_PYTHON_TEST_SEAMS=ON, as scripts/setup.sh builds the package; a plain `pip install .`
leaves it out). A test that injects faults skips where the module is absent."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator, TypeVar

import pytest

try:
    from tensortier import _testing
except ImportError:
    _testing = None

REASON = (
    "tensortier._testing is not built, so no faults can be injected (install with "
    "`pip install --no-build-isolation -C cmake.define.TENSORTIER_PYTHON_TEST_SEAMS=ON .`, as "
    "scripts/setup.sh does)"
)

T = TypeVar("T")


def with_faults(plan: dict[str, Any], make: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """make(*args, **kwargs), each engine and file system it makes injecting the faults of `plan`
    (the keys tensortier._testing.with_faults takes: kind, errno, nth, count, reads, writes,
    steps, short_bytes, delay_us). Skips the calling test without tensortier._testing."""
    if _testing is None:
        pytest.skip(REASON)
    return _testing.with_faults(plan, make, *args, **kwargs)


def require_faults() -> None:
    """Skips the calling test without tensortier._testing (for a test whose faults are injected
    in a child process)."""
    if _testing is None:
        pytest.skip(REASON)


def faults_injected(file_system: Any) -> int:
    """How many calls the fault plan of a _core.FileSystem failed or delayed so far."""
    if _testing is None:
        pytest.skip(REASON)
    return int(_testing.faults_injected(file_system))


@contextlib.contextmanager
def shrinking_after_size(path: Any) -> Iterator[None]:
    """Meanwhile, tensortier truncates the file at `path` to half its size just after taking its
    size, before reading it (a file that shrinks between the two). Skips without
    tensortier._testing."""
    if _testing is None:
        pytest.skip(REASON)
    _testing.shrink_after_size(os.fspath(path))
    try:
        yield
    finally:
        _testing.shrink_after_size("")
