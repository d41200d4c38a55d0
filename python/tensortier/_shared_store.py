"""How the processes of a shared-tensor group meet: the C++ store interface over a
``torch.distributed.Store``, and the store itself (given, the default process group's, or a
``TCPStore`` at torchrun's ``MASTER_ADDR:MASTER_PORT``) with this process's rank and the world
size. Internal to tensortier.shared."""

from __future__ import annotations

import datetime
import errno
import os
import time
from typing import Any

from . import _core


class _TorchStore(_core.SharedStore):
    """The C++ store interface over a ``torch.distributed.Store``. C++ calls it only from the
    thread that made the collective call.

    Failures are told apart by torch's exception types, never by their text: a store that
    vanished (``DistNetworkError``: the process hosting a ``TCPStore`` died or exited) raises
    ``ConnectionResetError``; a key that does not appear in time makes ``get`` return None (the
    C++ side raises ``TimeoutError``). FileStore's wait raises a plain ``RuntimeError`` on a
    timeout: that counts as one only once the time is up and the key is still absent."""

    def __init__(self, store: Any, where: str) -> None:
        super().__init__()
        self._store = store
        self._where = where  # who serves the store, for errors ("rank 0 (which hosts ...)")

    def _gone(self, e: BaseException) -> ConnectionResetError:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return ConnectionResetError(
            errno.ECONNRESET,
            f"the store the processes meet through is gone: {self._where} died or exited "
            f"({type(e).__name__}: {first})",
        )

    def set(self, key: str, value: bytes) -> None:
        import torch.distributed as dist

        try:
            self._store.set(key, value)
        except dist.DistNetworkError as e:
            raise self._gone(e) from None

    def get(self, key: str, timeout_ms: int) -> bytes | None:
        import torch.distributed as dist

        deadline = time.monotonic() + timeout_ms / 1000
        try:
            try:
                self._store.wait([key], datetime.timedelta(milliseconds=max(timeout_ms, 1)))
            except dist.DistNetworkError:
                raise
            except dist.DistStoreError:  # TCPStore, HashStore: the wait timed out
                if not self._store.check([key]):
                    return None
            except RuntimeError:  # FileStore's timeout has no type of its own
                if time.monotonic() < deadline or self._store.check([key]):
                    raise
                return None
            return bytes(self._store.get(key))
        except dist.DistNetworkError as e:
            raise self._gone(e) from None

    def add(self, key: str, delta: int) -> int:
        import torch.distributed as dist

        try:
            return int(self._store.add(key, delta))
        except dist.DistNetworkError as e:
            raise self._gone(e) from None


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _describe_store(store: Any) -> str:
    """The store's name for error messages."""
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    if host is not None and port is not None:
        return f"the process hosting the {type(store).__name__} at {host}:{port}"
    return f"the process hosting the {type(store).__name__}"


def _env_store(is_master: bool, world_size: int | None, timeout: float) -> tuple[Any, str]:
    """A ``TCPStore`` at torchrun's MASTER_ADDR:MASTER_PORT (served here when `is_master`),
    under the prefix of this restart attempt, and its name for error messages."""
    import torch.distributed as dist

    host, port = os.environ.get("MASTER_ADDR"), _env_int("MASTER_PORT")
    if host is None or port is None:
        raise ValueError(
            "no store to meet the other processes: pass store=, initialise torch.distributed, "
            "or set MASTER_ADDR and MASTER_PORT (torchrun does)"
        )
    try:
        tcp = dist.TCPStore(
            host,
            port,
            world_size,
            is_master=is_master,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
        )
    except dist.DistNetworkError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        what = f"the TCPStore at {host}:{port} (MASTER_ADDR:MASTER_PORT)"
        doing = f"serve {what}" if is_master else f"reach {what} within {timeout:g} s"
        raise ConnectionError(f"cannot {doing}: {first}") from None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    who = "torchrun's agent" if agent else "rank 0"
    where = f"{who} (which hosts the TCPStore at {host}:{port})"
    return dist.PrefixStore(f"tensortier/attempt_{attempt}", tcp), where


def _rendezvous(
    rank: int | None, world_size: int | None, store: Any, timeout: float
) -> tuple[Any, int, int, str, bool]:
    """The store, rank, world size, the store's name for errors and whether this process
    serves it: given, else the default process group's, else torchrun's environment (a
    ``TCPStore`` at MASTER_ADDR:MASTER_PORT, served by rank 0 unless torchrun's agent does)."""
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if initialized else _env_int("RANK")
    if world_size is None:
        world_size = dist.get_world_size() if initialized else _env_int("WORLD_SIZE")
    if rank is None or world_size is None:
        raise ValueError(
            "cannot tell this process's rank and the world size: pass rank= and world_size=, "
            "initialise torch.distributed, or start the processes with torchrun (which sets "
            "RANK and WORLD_SIZE)"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of {world_size} processes")
    if store is not None:
        if not isinstance(store, dist.Store):
            raise TypeError(f"store must be a torch.distributed.Store, not {type(store).__name__}")
        return store, rank, world_size, _describe_store(store), False
    if initialized:
        return (dist.distributed_c10d._get_default_store(), rank, world_size,
                "the default process group's store", False)
    # Under torchrun the agent serves the store; otherwise rank 0 does, as init_process_group.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    hosts = rank == 0 and not agent
    tcp, where = _env_store(hosts, world_size, timeout)
    return tcp, rank, world_size, where, hosts
