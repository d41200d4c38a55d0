"""Hugging Face transformers models read and written through tensortier (docs/hf.md): transformers
does all but the reading and writing of the safetensors files, its ``_load_pretrained_model``
handed the state dict :func:`tensortier.load` read, its ``save_pretrained`` writing each shard with
:func:`tensortier.save`."""

from __future__ import annotations

import concurrent.futures
import errno
import contextlib
import contextvars
import functools
import os
import secrets
import stat
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

from . import _core
from ._paths import fspath
from .checkpoint import load, save
from .checkpoint._format import _damaged_safetensors_error

SUPPORTED_TRANSFORMERS = (">=5.23.0", "<5.24")
"""The transformers versions this module works with (pinned in the tests)."""

__all__ = ["SUPPORTED_TRANSFORMERS", "disable", "enable", "from_pretrained", "save_pretrained"]

_enabled = False  # enable(): every load and save of the process
_routed: contextvars.ContextVar[bool] = contextvars.ContextVar("tensortier_hf", default=False)
_originals: dict[str, Any] = {}  # what the hooks replaced
_install_lock = threading.Lock()
_saving: contextvars.ContextVar[bool] = contextvars.ContextVar("tensortier_hf_save", default=False)


def _transformers() -> Any:
    try:
        import transformers
        from transformers import modeling_utils
    except ImportError as e:
        raise ImportError(
            f"tensortier.hf needs transformers {','.join(SUPPORTED_TRANSFORMERS)}: "
            "pip install 'transformers==5.23.0'"
        ) from e
    from packaging.version import Version

    v = Version(transformers.__version__)
    if not Version("5.23.0") <= v < Version("5.24"):
        raise ImportError(
            f"tensortier.hf supports transformers {','.join(SUPPORTED_TRANSFORMERS)}, not "
            f"{transformers.__version__} (its loading internals may differ): install "
            "transformers==5.23.0, or load with transformers alone"
        )
    _install(modeling_utils)
    return modeling_utils


def _install(mu: Any) -> None:
    """Puts the reading and writing hooks in place, once; they act only for :func:`enable` or
    within our own calls."""
    # Under a lock: a second thread's first call must not take our hooks for transformers' own.
    with _install_lock:
        if not _originals:
            _install_hooks(mu)


def _install_hooks(mu: Any) -> None:
    cls = mu.PreTrainedModel
    _originals["load"] = cls.__dict__["_load_pretrained_model"].__func__
    _originals["save_file"] = mu.safe_save_file
    _originals["save_pretrained"] = cls.save_pretrained

    def _load_pretrained_model(model: Any, state_dict: Any, checkpoint_files: Any,
                               load_config: Any, *args: Any, **kwargs: Any) -> Any:
        if state_dict is None and (_enabled or _routed.get()):
            try:
                state_dict = _read(mu, model, checkpoint_files, load_config)
            except ValueError as e:  # a damaged shard: raised as transformers' reading raises it
                raise _damaged_shard_error()(*e.args) from None
        return _originals["load"](model, state_dict, checkpoint_files, load_config, *args,
                                  **kwargs)

    def safe_save_file(tensors: Any, filename: str, metadata: Any = None) -> None:
        if not (_enabled or _routed.get()):
            return _originals["save_file"](tensors, filename, metadata=metadata)
        if not os.path.islink(filename):
            save(tensors, filename, metadata=metadata, checksum=True)
            os.chmod(filename, _shard_mode())
            return None
        # A shard that is a symbolic link (into a Hub cache's blobs, say) is replaced by the new
        # file, as transformers replaces it; the file it points to stays as it is. Written
        # beside it first: a save that fails leaves the link.
        beside = _core.temporary_path_prefix(filename) + secrets.token_hex(4)
        try:
            save(tensors, beside, format="safetensors", metadata=metadata, checksum=True)
            os.chmod(beside, _shard_mode())
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(beside)
            raise
        _core.replace_linked_shard(beside, filename)

    cls._load_pretrained_model = staticmethod(_load_pretrained_model)
    mu.safe_save_file = safe_save_file


@functools.lru_cache(maxsize=None)
def _shard_mode() -> int:
    """The mode safetensors' own ``save_file`` gives a shard: 0600 where it writes a temporary
    file and renames it (as the versions transformers 5 installs do), else the umask's. Asked
    of it once, by a save of one element."""
    import tempfile

    import safetensors.torch
    import torch

    with tempfile.TemporaryDirectory(prefix="tensortier-mode-") as directory:
        probe = os.path.join(directory, "probe.safetensors")
        safetensors.torch.save_file({"x": torch.zeros(1)}, probe)
        return stat.S_IMODE(os.stat(probe).st_mode)


def _read(mu: Any, model: Any, files: list[str] | None, cfg: Any) -> dict[str, Any] | None:
    """The checkpoint's state dict, read by :func:`tensortier.load`; None where transformers
    reads it itself (no safetensors files, quantized or distributed loads, disk offload)."""
    import torch

    # The early read's result is taken now: declined, it is freed when this returns.
    early = _early.get()
    future = early[1].pop() if early is not None and early[1] else None
    if (not files or cfg.hf_quantizer is not None or cfg.device_mesh is not None
            or mu.is_deepspeed_zero3_enabled()):
        return None
    places = set((cfg.device_map or {"": "cpu"}).values())
    place = _core.hf_read_device([f"cuda:{p}" if isinstance(p, int) else str(p) for p in places])
    if place is None:
        return None
    device = torch.device(place)
    if device.type == "cuda" and not (torch.cuda.is_available()
                                      and (device.index or 0) < torch.cuda.device_count()):
        return None  # transformers' reading raises torch's own error for a device not there
    target = _core.hf_load_target(files, cfg.sharded_metadata)
    if target is None:
        return None
    # Converted as read where transformers would give every floating tensor that dtype.
    dtype = cfg.dtype if isinstance(cfg.dtype, torch.dtype) and not cfg.dtype_plan else None
    if dtype is not None and any(
        t.is_floating_point() and t.dtype != dtype for t in model.state_dict().values()
    ):
        dtype = None
    if future is not None and device.type == "cpu" and early[0] == os.path.realpath(target):
        state_dict = None
        with contextlib.suppress(Exception):  # read again below, to report its error
            state_dict = future.result()
        if state_dict is not None:
            if dtype is not None:
                # A checkpoint of mixed dtypes (fp32 norms in a bf16 model): those tensors
                # converted one at a time, each read's memory freed as its copy is made, rather
                # than every byte read again.
                for name, t in state_dict.items():
                    if t.is_floating_point() and t.dtype != dtype:
                        with torch.inference_mode(False):
                            state_dict[name] = t.to(dtype)
            return state_dict
    # Files in the page cache are mapped, as transformers maps them (no copy to make). Made
    # outside inference mode whatever the caller's: transformers' parameters are ordinary
    # tensors, which training and in-place edits outside inference mode take.
    with torch.inference_mode(False):
        return _load(target, device, dtype, device.type == "cpu" and not cfg.disable_mmap
                     and _core.hf_files_cached(files))


def _damaged_shard_error() -> type[ValueError]:
    """A ValueError that is also safetensors' ``SafetensorError``, which transformers' reading
    raises for a truncated or malformed shard: code that catches either catches it."""
    return _damaged_safetensors_error()


@contextlib.contextmanager
def _read_early(cls: Any, path: str, kwargs: dict[str, Any]) -> Iterator[None]:
    """Within: the checkpoint in `path` is read to the CPU in its own dtypes on another thread
    while transformers builds the model, for :func:`_read` to take where it would read the same
    (where the call asks for nothing that changes which files are read or into what)."""
    from transformers import modeling_utils
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    found = None
    # Model classes only: AutoConfig, AutoTokenizer... read no weights.
    models = (modeling_utils.PreTrainedModel, _BaseAutoModelClass)
    if (isinstance(cls, type) and issubclass(cls, models) and set(kwargs) <= _EARLY_KWARGS and kwargs.get("dtype", "auto") in ("auto", None)
            and kwargs.get("torch_dtype", "auto") in ("auto", None)
            and getattr(kwargs.get("config"), "quantization_config", None) is None
            and not modeling_utils.is_deepspeed_zero3_enabled()):
        found = _core.find_hf_checkpoint(path)  # None for a model saved quantized
    if found is None:
        yield
        return
    target, cached = found
    pool = concurrent.futures.ThreadPoolExecutor(1, "tensortier-hf")
    box = [pool.submit(_load, target, "cpu", None, cached)]  # _read pops it
    token = _early.set((os.path.realpath(target), box))
    failed = True
    try:
        yield
        failed = False
    finally:
        _early.reset(token)
        box.clear()
        # A call that succeeded leaves no read behind; an error or Ctrl-C does not wait for a
        # read nothing will use (its thread ends with it and frees what it read).
        pool.shutdown(wait=not failed, cancel_futures=failed)


def _load(target: str, device: Any, dtype: Any, mmap: bool) -> dict[str, Any]:
    """`target` loaded by :func:`tensortier.load`; mapped files' pages put in the page tables
    now, on several threads, rather than faulted in one at a time by the model's first reads.
    Mapped privately, as transformers maps them, whatever torch.load's mmap setting."""
    state_dict = load(target, device, dtype, mmap=mmap, _shared_mapping=False)
    if mmap:
        _core.populate_for_reading([(t.data_ptr(), t.nbytes) for t in state_dict.values()],
                                   min(8, os.cpu_count() or 1))
    return state_dict


_EARLY_KWARGS = {"config", "dtype", "torch_dtype", "attn_implementation", "local_files_only",
                 "output_loading_info", "trust_remote_code", "low_cpu_mem_usage"}
_early: contextvars.ContextVar[tuple[str, list[Any]] | None] = contextvars.ContextVar(
    "tensortier_hf_early", default=None)


@contextlib.contextmanager
def _ours() -> Iterator[Any]:
    """Within: transformers reads and writes through us, in this thread."""
    mu = _transformers()
    token = _routed.set(True)
    try:
        yield mu
    finally:
        _routed.reset(token)


def from_pretrained(cls: Any, path: str | os.PathLike[str] | None, *args: Any,
                    **kwargs: Any) -> Any:
    """``cls.from_pretrained(path, *args, **kwargs)`` with the weights read by tensortier.

    Returns the model transformers returns (same parameters and buffers bit for bit, dtype,
    tied weights, ``device_map`` placement); safetensors shards are read by
    :func:`tensortier.load` (to the GPU straight, for a single-device CUDA ``device_map``),
    converting to `dtype` on the way where transformers would give every tensor that dtype.
    Shards wholly in the page cache are mapped (copy-on-write), as transformers maps them. With
    the dtype left to the checkpoint and no ``device_map``, ``subfolder`` or ``variant``, the
    shards are read on another thread while transformers builds the model.
    Directories of ``.bin`` files, quantized models and disk offload are read by transformers.

    Args:
        cls: an ``AutoModel*`` class or a concrete model class.
        path: a local model directory (``config.json`` and ``model.safetensors`` or
            ``model.safetensors.index.json`` with its shards); or None with ``config`` and
            ``state_dict`` given, as transformers takes them (nothing is read).
        *args: passed to ``cls.from_pretrained`` as they are, as is every keyword
            (``dtype``, ``device_map``, ``subfolder``, ``variant``...).

    Raises:
        FileNotFoundError: nothing is at `path` (a Hub model id: download it first with
            ``huggingface_hub.snapshot_download``).
        NotADirectoryError: `path` is a file (pass the directory holding it).
        ImportError: transformers is missing or of a version outside
            ``SUPPORTED_TRANSFORMERS``.
        ValueError: a truncated or malformed shard (also a ``safetensors.SafetensorError``,
            as transformers raises for a damaged shard), a ``dtype`` transformers refuses.
        OSError: a shard cannot be read or is missing.
    """
    if path is None:  # a model made from config= and state_dict=, as transformers makes it
        with _ours():
            return cls.from_pretrained(None, *args, **kwargs)
    path = fspath(path)
    _core.check_hf_model_directory(path)
    with _ours(), _read_early(cls, path, kwargs):
        return cls.from_pretrained(path, *args, **kwargs)


def save_pretrained(model: Any, path: str | os.PathLike[str], **kwargs: Any) -> None:
    """``model.save_pretrained(path, **kwargs)``: the same files (config, generation config,
    shards of the same names and sizes, index), each shard written by :func:`tensortier.save`
    with checksums (``tensortier verify`` checks them), readable by transformers and
    ``safetensors``. A model whose class has a ``save_pretrained`` of its own (a PEFT model, a
    subclass) is saved by it, into the same directory.

    Durable as a whole: the directory is written beside `path`, every file fsynced, then swapped
    with `path` in one rename (``renameat2(RENAME_EXCHANGE)``). Files already in `path` are kept
    as transformers keeps them: the same files (hard links, so that a log file open there goes
    on), except what a save may rewrite in place, staged as copies (``.json``, ``.md`` and
    ``.py`` files, and the top's ``.bin`` files) and replaced by the old files themselves at the
    swap where the save did not write them; symbolic links stay links (a shard's is replaced by
    the new shard, its target left as it was); what other processes do in `path` meanwhile
    (files written, rewritten, replaced, removed) is carried into the new directory, where the
    save did not write the same file.
    A crash leaves the old directory whole, and a leftover ``.<name>.tmp-*`` beside it, which the
    next save into `path` removes once the process that made it is gone.

    Where the directory cannot be swapped, the save writes into it as transformers does, each
    shard durable on its own (a crash may leave some files old and some new): `path` is a mount
    point or holds one (a volume mounted inside), a symbolic link, a file (transformers logs an
    error and returns), holds this process's working directory, lies in a directory this
    process may not write or on a file system without ``RENAME_EXCHANGE`` (NFS, SMB, most FUSE
    ones); and on a rank that does not save (``is_main_process=False``), which writes what transformers writes there
    (nothing), leaving the directory to the rank that saves.

    Raises:
        ValueError: ``push_to_hub`` or ``distributed_checkpoint`` (save, then push or use
            ``tensortier.dcp``).
        TypeError: `model` has no ``save_pretrained``.
        OSError: the directory cannot be written (the old one is left as it was).
    """
    for unsupported in ("push_to_hub", "distributed_checkpoint"):
        if kwargs.get(unsupported):
            raise ValueError(f"tensortier.hf.save_pretrained does not take {unsupported}=True")
    _transformers()  # the hooks, and _originals for _writer
    model = _unwrapped(model)
    _save(model, _save_directory(path), _writer(model), kwargs)


def _save_directory(path: Any) -> str:
    """The absolute path a save writes; an empty one (an unset output directory) is refused as
    transformers' ``os.makedirs("")`` refuses it, not taken for the working directory."""
    path = fspath(path)
    if not path:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    # Made absolute without normalising "..": the kernel resolves it after the symbolic links
    # before it, as it does for transformers' own writes ("ckpts/../final" with ckpts a link
    # is the folder beside the link's target), not as text would.
    path = os.path.join(os.getcwd(), path).rstrip("/") or "/"
    if os.path.basename(path) in ("", ".", ".."):
        return os.path.realpath(path)  # the folder itself has no name of its own to swap
    return path


def _unwrapped(model: Any) -> Any:
    """The model a ``torch.compile`` wrapper (``OptimizedModule``) holds: its ``save_pretrained``
    is the model's, as attribute lookups through the wrapper find it."""
    # Not imported, nothing was compiled: importing it would take a second.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        return model._orig_mod
    return model


def _save(model: Any, final: str, write: Any, kwargs: dict[str, Any]) -> None:
    """:func:`save_pretrained`'s work: `model` written by `write` (a directory, then `kwargs`)."""
    with _ours():
        token = _saving.set(True)
        try:
            if not _saves_here(model, kwargs) or not _core.hf_directory_swappable(final):
                write(final, **kwargs)
                return
            try:
                staging, kept = _core.stage_hf_save(final)  # and removes killed saves' ones
            except PermissionError:  # no staging directory beside `path`
                write(final, **kwargs)
                return
            try:
                # transformers' write takes the tensors out of a given state_dict (pop): the
                # write in place below, where the swap cannot be made, needs them again.
                write(staging, **_with_state_dict_copy(kwargs))
            except OSError as e:
                _core.remove_directory_tree(staging)
                renamed = _naming(e, os.fsdecode(staging), final)
                if renamed is e:
                    raise
                raise renamed from e
            except BaseException:
                _core.remove_directory_tree(staging)
                raise
            swapped, left, kept_dir = _core.commit_hf_save(staging, kept, final)
            if left:
                warnings.warn(
                    f"{final}: {len(left)} files written into it during the save could not be "
                    f"moved into the new directory (first: {os.fsdecode(left[0])}); they are "
                    f"kept in {kept_dir}", stacklevel=3)
            if not swapped:  # a bind mount, NFS, SMB, FUSE: written in place
                write(final, **kwargs)
        finally:
            _saving.reset(token)


def _naming(e: OSError, staging: str, final: str) -> OSError:
    """`e` with the files it names in the staging directory named in `final` instead (where
    they were to go): the staging directory is gone once the save failed."""
    def moved(name: Any) -> Any:
        if isinstance(name, (str, bytes, os.PathLike)):
            text = os.fsdecode(name)
            if text == staging or text.startswith(staging + os.sep):
                return final + text[len(staging):]
        return name

    if e.errno is None or (moved(e.filename) is e.filename
                           and moved(e.filename2) is e.filename2):
        return e
    # OSError(errno, ...) makes the errno's subclass (PermissionError for EACCES...).
    return OSError(e.errno, e.strerror, moved(e.filename), None, moved(e.filename2))


def _with_state_dict_copy(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with a new dict of its ``state_dict``'s items, if any (a copy.copy of a
    mapping that keeps its items in an attribute would share them)."""
    state_dict = kwargs.get("state_dict")
    if state_dict is None:
        return kwargs
    return {**kwargs, "state_dict": dict(state_dict)}


def _writer(model: Any) -> Any:
    """What writes `model` into a directory: transformers' ``save_pretrained``, or the one of
    its class where the class has its own (PEFT models, subclasses that write more)."""
    own = getattr(type(model), "save_pretrained", None)
    if own is None:
        raise TypeError(f"tensortier.hf.save_pretrained saves models that have save_pretrained, "
                        f"not {type(model).__name__}")
    if own in (_originals["save_pretrained"], _enabled_save_pretrained):
        return _transformers_writer(model)
    return model.save_pretrained


def _transformers_writer(model: Any) -> Any:
    return lambda directory, **kwargs: _originals["save_pretrained"](model, directory, **kwargs)


def _saves_here(model: Any, kwargs: dict[str, Any]) -> bool:
    """Whether transformers writes the model on this rank (``is_main_process``, tensor
    parallel ranks); elsewhere it writes nothing, and neither does a swap."""
    main = kwargs.get("is_main_process", True)
    should = getattr(model, "should_save_on_this_rank", None)
    return bool(should(main)) if callable(should) else bool(main)


def enable() -> None:
    """From now on, in every thread, transformers' own ``from_pretrained`` reads local
    safetensors checkpoints through tensortier and ``save_pretrained`` saves as
    :func:`save_pretrained` does. :func:`disable` undoes it.

    Raises:
        ImportError: transformers is missing or of an unsupported version.
    """
    global _enabled
    mu = _transformers()
    _enabled = True
    mu.PreTrainedModel.save_pretrained = _enabled_save_pretrained


def _enabled_save_pretrained(self: Any, save_directory: Any, *args: Any, **kwargs: Any) -> None:
    # transformers' part of a save (a class's own save_pretrained may have called it through
    # super(), and goes on once it returns); within a save of ours, into the directory it writes.
    # After disable(), transformers' own: a hook another library put over ours since enable()
    # stays in place and still calls this one.
    if (not _enabled or args or kwargs.get("push_to_hub") or kwargs.get("distributed_checkpoint")
            or _saving.get()):
        return _originals["save_pretrained"](self, save_directory, *args, **kwargs)
    _save(self, _save_directory(save_directory), _transformers_writer(self), kwargs)


def disable() -> None:
    """Undoes :func:`enable`: transformers reads and writes by itself again."""
    global _enabled
    _enabled = False
    if _originals:
        cls = _transformers().PreTrainedModel
        # Only our hook is taken away: one another library put there since stays.
        if cls.__dict__.get("save_pretrained") is _enabled_save_pretrained:
            cls.save_pretrained = _originals["save_pretrained"]
