#!/usr/bin/env python
"""Differential fuzzing of checkpoints: tensortier against torch and safetensors.

Random objects and files are checked against what the ecosystem's own code does with them:

- ``torch``: random picklable graphs (nested containers, views with any strides and offsets,
  shared storages, Parameters, conj/neg views, every dtype; with 25 % odds quantized, sparse,
  meta and nested tensors and bare storages). ``tensortier.save`` must write what
  ``torch.load(weights_only=True)`` reads back as the original; ``tensortier.load`` (plain,
  ``mmap=True``, ``verify=True``, ``dtype=``) and ``load_into`` must give what ``torch.load``
  gives for ``torch.save`` files of any protocol, alignment and CRC setting, and for the same
  archive rewritten by Python's ``zipfile`` (another record layout; big-endian too); the CLI's
  ``info``/``verify`` must read them.
- ``st``: random state dicts with safetensors metadata, both ways between ``tensortier`` and
  ``safetensors.torch``, and ``tensortier convert`` safetensors -> .pt -> safetensors.
- ``cli``: ``torch.save``/``tensortier.save`` files of nested containers of tensors (some
  slices of one storage) through ``tensortier convert`` to safetensors, ``info`` and ``verify``.
- ``craft``: hand-written safetensors files (tensors in any order, header padding, metadata
  absent or empty) read by safetensors and by tensortier.
- ``agree``: tensortier against itself. Crafted files (safetensors whose checksum metadata has
  duplicate names, ``0x`` prefixes, ``_``, spaces, other lengths, upper case hex, unknown or
  missing names; torch zips by tensortier and torch, with and without CRC-32s; shard indexes
  with odd shard paths; any suffix case, ``.PT`` and ``.SafeTensors`` included; sometimes
  truncated, a bit flipped or a recorded size lying) go through ``tensortier.load(verify=True)``
  and ``tensortier verify`` (same accept/refuse), ``tensortier.load`` and ``tensortier info``
  (same accept/refuse, same tensor count), and ``tensortier convert`` (accepts what
  load(verify=True) accepts and nothing load refuses, to an output its suffix names the format
  of by tensortier.save's rule; its output loads, verified, to load's values). What was crafted
  is named by [tags] in each finding.

Usage::

    checkpoint_fuzz.py MODE SEED N [--stop] [--findings FILE]   MODE: torch, st, cli, craft, agree,
                                                                      several comma-separated
                                                                      (st,craft), or all
    checkpoint_fuzz.py MODE SEED [N] --case I                   one case again, verbosely

Case I of (MODE, SEED) draws everything from ``random.Random(f"{MODE}:{SEED}:{I}")`` (and
torch's generator seeded from it), so a finding is reproduced by running its case alone. Each
finding is printed with that command. The exit status is 1 when a check found something not
in KNOWN_GAPS, 2 when the fuzzer cannot run, else 0.

A finding is either a tensortier bug or a wrong expectation here. Fix the latter in the check.
A bug not fixed at once goes into KNOWN_GAPS, matched narrowly (check name and message
substrings) with a one-line reason, so that CI stays green while the rest stays checked; its
entry goes when the bug does. ``scripts/test.sh`` runs ``all`` with a fixed seed and count.

The ``tensortier`` executable is taken from ``$TENSORTIER_CLI``, else from beside
``sys.executable`` (a virtual environment's ``bin``), else from ``PATH``. Scratch files live in
a temporary directory removed at exit.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import io
import json
import math
import os
import random
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

# The generated objects go through deprecated paths on purpose (TypedStorage, protocol 2
# pickles, weights_only's notes): their warnings would bury the findings.
warnings.filterwarnings("ignore")

import safetensors  # noqa: E402
import safetensors.torch as st  # noqa: E402
import tensortier  # noqa: E402
import torch  # noqa: E402
from torch import _weights_only_unpickler  # noqa: E402
from torch.utils.serialization import config as serialization_config  # noqa: E402

MODES = ("torch", "st", "cli", "craft", "agree")
CLI_TIMEOUT_S = 60

# ---------------------------------------------------------------------------- known gaps


@dataclass(frozen=True)
class KnownGap:
    """A limitation of tensortier that findings show: a finding of one of `checks` whose
    message contains every one of `needles` is counted, not reported. Entries match narrowly,
    so that other findings of the same check still fail; remove one once its gap is fixed."""

    name: str
    checks: tuple[str, ...]
    needles: tuple[str, ...]
    reason: str


# The checks that run the C++ pickle reader of `tensortier info|verify|convert` on .pt files.
_PICKLE_READER_CHECKS = ("a.verify_cli", "b.cli", "cli.info_verify", "cli.pt_st")

KNOWN_GAPS: tuple[KnownGap, ...] = (
    KnownGap("cli-packed-quantized", _PICKLE_READER_CHECKS, ("global 'torch.QUInt",),
             "the CLI's pickle reader refuses quint4x2 and quint2x4 tensors (packed values)"),
    KnownGap("cli-sparse", _PICKLE_READER_CHECKS,
             ("global 'torch._utils._rebuild_sparse_tensor'",),
             "the CLI's pickle reader refuses sparse (COO, CSR) tensors"),
    KnownGap("cli-nested", _PICKLE_READER_CHECKS,
             ("global 'torch._utils._rebuild_nested_tensor'",),
             "the CLI's pickle reader refuses nested tensors"),
    KnownGap("cli-bare-storage", _PICKLE_READER_CHECKS, (": a bare storage at ",),
             "the CLI's pickle reader reads storages only inside tensors"),
)


def known_gap(check: str, message: str) -> KnownGap | None:
    """The entry of KNOWN_GAPS that explains a finding, or None."""
    for gap in KNOWN_GAPS:
        if check in gap.checks and all(needle in message for needle in gap.needles):
            return gap
    return None


# ---------------------------------------------------------------------------- dtypes

ALL_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.complex32, torch.complex64, torch.complex128,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64, torch.bool,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu, torch.float4_e2m1fn_x2,
    torch.bits8, torch.bits16, torch.bits1x8, torch.bits2x4, torch.bits4x2,
)  # fmt: skip
# Those safetensors.torch saves; F4 (float4_e2m1fn_x2) is drawn apart, rarely.
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2", torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ", torch.float8_e8m0fnu: "F8_E8M0",
}  # fmt: skip
ST_DTYPES = tuple(SAFETENSORS_DTYPES)
# Conversions torch's own `.to()` may raise for (no copy kernel: float4, complex32, bits*).
CONVERSION_REFUSALS = (RuntimeError, ValueError, TypeError)


class Mismatch(Exception):
    """What tensortier did differs from what the reference did."""


# ---------------------------------------------------------------------------- generation


def random_bytes_tensor(rng: random.Random, nbytes: int) -> torch.Tensor:
    """A uint8 tensor of `nbytes` random bytes."""
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8)
    # A copy: memory from torch's allocator, as tensors users save have.
    return torch.frombuffer(bytearray(rng.randbytes(nbytes)), dtype=torch.uint8).clone()


def random_flat(rng: random.Random, dtype: torch.dtype, max_numel: int = 64) -> torch.Tensor:
    """A 1-d tensor of `dtype` with random bit patterns (NaNs, subnormals and all)."""
    numel = rng.choice([0, 1, 2, 3, rng.randint(0, max_numel), rng.randint(0, max_numel)])
    raw = random_bytes_tensor(rng, numel * dtype.itemsize)
    if dtype == torch.bool and rng.random() < 0.9:
        raw = raw % 2  # and sometimes bools stored as bytes other than 0 and 1
    return raw.view(dtype) if numel else torch.empty(0, dtype=dtype)


def random_shape(rng: random.Random, max_numel: int) -> list[int]:
    """A shape of 0 to 4 small dimensions (zeros included) of at most `max_numel` elements."""
    shape = [
        rng.choice([0, 1, 1, 2, 3, 4, 5]) if rng.random() < 0.95 else rng.randint(0, 9)
        for _ in range(rng.choice([0, 1, 1, 2, 2, 3, 4]))
    ]
    if math.prod(shape) > max_numel:
        return [max(max_numel, 0)]
    return shape


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    """Row-major strides of `shape`."""
    strides: list[int] = []
    step = 1
    for size in reversed(shape):
        strides.insert(0, step)
        step *= max(size, 1)
    return strides


def random_view(rng: random.Random, base: torch.Tensor) -> torch.Tensor:
    """A view of `base`'s storage with random shape, strides (zero, overlapping, permuted)
    and offset that stay inside it."""
    numel = base.numel()
    kind = rng.random()
    if kind < 0.15:
        return base
    if kind < 0.25 and base.dim() == 1 and numel >= 4:
        rows = rng.randint(1, numel // 2)
        view = base[: rows * (numel // rows)].view(rows, numel // rows)
        return view.t() if rng.random() < 0.7 else view
    for _ in range(20):
        shape = random_shape(rng, max(numel, 1))
        strides = [rng.choice([0, 1, 1, 2, 3, rng.randint(0, 7)]) for _ in shape]
        if rng.random() < 0.4:
            strides = contiguous_strides(shape)
            if rng.random() < 0.3 and len(shape) >= 2:  # a transposed layout
                order = list(range(len(shape)))
                rng.shuffle(order)
                shape = [shape[d] for d in order]
                strides = [strides[d] for d in order]
        reach = sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
        extent = 0 if 0 in shape else reach + 1
        if extent > numel:
            continue
        offset = rng.randint(0, numel - extent) if numel > extent else 0
        if extent == 0 and rng.random() < 0.5:
            offset = rng.randint(0, numel)  # an empty view may start anywhere up to the end
        return base.as_strided(shape, strides, offset)
    return base[:0]


# Non-tensor values a checkpoint may hold, awkward ones included: integers beyond 64 bits, NaN,
# -0.0, subnormals, NULs in strings, bytes, sets, and torch's Size, dtype, device, layout and
# qscheme objects.
SCALAR_MAKERS: tuple[Callable[[random.Random], Any], ...] = (
    lambda r: r.randint(-5, 5),
    lambda r: r.randint(-(2**63), 2**63 - 1),
    lambda r: 2 ** r.randint(64, 200),
    lambda r: -(2 ** r.randint(64, 130)),
    lambda r: r.random() * 1e3,
    lambda r: float("nan"),
    lambda r: float("-inf"),
    lambda r: -0.0,
    lambda r: 1e-310,
    lambda r: True,
    lambda r: False,
    lambda r: None,
    lambda r: "",
    lambda r: "h\u00e9llo\u2603\x00\n",
    lambda r: "x" * r.randint(0, 300),
    lambda r: r.randbytes(r.randint(0, 8)),
    lambda r: bytearray(r.randbytes(3)),
    lambda r: complex(r.random(), -1.5),
    lambda r: {1, "a", (2, 3)},
    lambda r: torch.Size(random_shape(r, 100)),
    lambda r: r.choice(ALL_DTYPES),
    lambda r: torch.device("cpu"),
    lambda r: torch.device("cuda", r.randint(0, 3)),
    lambda r: torch.device("meta"),
    lambda r: r.choice([torch.strided, torch.sparse_coo]),
    lambda r: torch.per_channel_affine,
    lambda r: collections.Counter(a=2, b=-1),
)


class ObjectGenerator:
    """Random picklable object graphs of tensors, containers and scalars. Tensors reuse earlier
    storages, objects and containers appear twice: sharing and identity must survive."""

    def __init__(self, rng: random.Random, exotic: bool) -> None:
        self.rng = rng
        self.exotic = exotic  # also quantized, sparse, meta, nested tensors and bare storages
        self.bases: list[torch.Tensor] = []
        self.tensors: list[torch.Tensor] = []
        self.containers: list[Any] = []

    def base(self) -> torch.Tensor:
        """A flat tensor whose storage views are cut from: often one made before."""
        rng = self.rng
        if self.bases and rng.random() < 0.6:
            return rng.choice(self.bases)
        if rng.random() < 0.02:  # over 1 MiB: load's aligned allocations and chunked reads
            dtype = rng.choice(ALL_DTYPES)
            numel = rng.randint((1 << 20) // dtype.itemsize, (3 << 19) // dtype.itemsize)
            base = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8).view(dtype)
        else:
            base = random_flat(rng, rng.choice(ALL_DTYPES))
        self.bases.append(base)
        return base

    def tensor(self) -> Any:
        """A tensor (sometimes a Parameter, a conj/neg view, one with attributes, or one
        returned before), or with `exotic` an unusual tensor or a bare storage."""
        rng = self.rng
        if self.tensors and rng.random() < 0.12:
            return rng.choice(self.tensors)
        if self.exotic and rng.random() < 0.15:
            return self.exotic_tensor()
        t = random_view(rng, self.base())
        kind = rng.random()
        floating = t.dtype.is_floating_point or t.dtype.is_complex
        if kind < 0.15:
            t = torch.nn.Parameter(t, requires_grad=floating and rng.random() < 0.5)
        elif kind < 0.25 and floating and t.dtype != torch.float4_e2m1fn_x2:
            t = t.detach().requires_grad_(True)
        elif kind < 0.32 and t.dtype.is_complex and t.dtype != torch.complex32:
            t = t.conj()
        elif kind < 0.36 and t.dtype in (torch.float32, torch.float64, torch.int64, torch.int32):
            t = t._neg_view()
        if rng.random() < 0.08:
            # An attribute: torch.save pickles it as the tensor's state; it must come back.
            t.fuzz_attr = rng.choice([1, "s", [1, 2], None])  # type: ignore[attr-defined]
        self.tensors.append(t)
        return t

    def exotic_tensor(self) -> Any:
        """A quantized, sparse, meta or nested tensor, or a bare storage."""
        rng = self.rng
        kind = rng.randint(0, 6)
        if kind == 0:
            qtype = rng.choice([torch.qint8, torch.quint8, torch.qint32])
            return torch.quantize_per_tensor(
                torch.randn(rng.randint(0, 5)), 0.25, rng.randint(0, 3), qtype
            )
        if kind == 1:
            return torch.quantize_per_channel(
                torch.randn(2, 3), torch.tensor([0.1, 0.2]), torch.tensor([1, 2]), 0, torch.quint8
            )
        if kind == 2:
            return (torch.randn(3, 4) * (torch.rand(3, 4) > 0.5)).to_sparse()
        if kind == 3:
            return (torch.randn(3, 4) * (torch.rand(3, 4) > 0.5)).to_sparse_csr()
        if kind == 4:
            dtype = rng.choice(ALL_DTYPES[:8])
            return torch.empty(random_shape(rng, 50), dtype=dtype, device="meta")
        if kind == 5:
            return self.base().untyped_storage()
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])

    def value(self, depth: int = 0) -> Any:
        """A container (dict, OrderedDict with `_metadata`, list, tuple), tensor or scalar."""
        rng = self.rng
        x = rng.random()
        if depth > 3:
            x = 0.5 + x / 2  # no deeper containers
        if self.containers and x < 0.03:
            return rng.choice(self.containers)
        if x < 0.30:
            kind = rng.randint(0, 4)
            length = rng.randint(0, 4)
            if kind in (0, 1):
                d: dict[Any, Any] = collections.OrderedDict() if kind == 1 else {}
                for i in range(length):
                    if rng.random() < 0.9:
                        key: Any = rng.choice([f"k{i}", f"layer.{i}.w", i, f"k{i}"])
                    else:
                        key = rng.choice([None, 1.5, (1, 2), True, "", "a.b"])
                    d[key] = self.value(depth + 1)
                if kind == 1 and rng.random() < 0.5:  # what nn.Module.state_dict() attaches
                    metadata = {"": {"version": rng.randint(0, 3)}, "sub": {"v": 1}}
                    d._metadata = metadata  # type: ignore[attr-defined]
                self.containers.append(d)
                return d
            if kind == 2:
                items = [self.value(depth + 1) for _ in range(length)]
                self.containers.append(items)
                return items
            if kind == 3:
                return tuple(self.value(depth + 1) for _ in range(length))
            return collections.OrderedDict((f"p{i}", self.tensor()) for i in range(length))
        if x < 0.65:
            return self.tensor()
        return rng.choice(SCALAR_MAKERS)(rng)

    def top(self) -> Any:
        """What is saved: half the time a state-dict-like mapping, else any value."""
        rng = self.rng
        if rng.random() >= 0.5:
            return self.value(0)
        d: dict[str, Any] = collections.OrderedDict() if rng.random() < 0.5 else {}
        for i in range(rng.randint(0, 6)):
            d[f"m.{i}"] = self.value(1) if rng.random() < 0.4 else self.tensor()
        if isinstance(d, collections.OrderedDict) and rng.random() < 0.5:
            metadata = collections.OrderedDict([("", {"version": 2})])
            d._metadata = metadata  # type: ignore[attr-defined]
        return d


def random_name(rng: random.Random, i: int) -> str:
    """A tensor name: usually dotted, sometimes unicode, quotes, control characters, empty or
    long (JSON escaping in safetensors headers, quoting in CLI output)."""
    kind = rng.random()
    if kind < 0.6:
        return f"layers.{i}.weight"
    if kind < 0.7:
        return f"n{i}-\u00e9\u4e2d\U0001f600"
    if kind < 0.8:
        return f'q"uote\\{i}\n\t'
    if kind < 0.85:
        return "" if i == 0 else f"e{i}"
    if kind < 0.9:
        return f"{i}" * rng.randint(1, 200)
    return f"x{i}" + "".join(chr(rng.randint(32, 0x7E)) for _ in range(rng.randint(0, 10)))


def random_metadata(rng: random.Random) -> dict[str, str] | None:
    """safetensors `__metadata__`: None, or keys and values with JSON-hostile characters."""
    if rng.random() < 0.3:
        return None
    metadata = {}
    for i in range(rng.randint(0, 5)):
        key = rng.choice(["format", f"k{i}", "", "\u00fcn\u00ef", 'q"\\', "x" * 100, f"c{i}\x01"])
        metadata[key] = rng.choice(
            ["pt", "", "v\u2603", '{"json": 1}', "\x00nul", "a" * rng.randint(0, 500), "\\n", "tf"]
        )
    return metadata


def random_packed_tensor(rng: random.Random, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """A contiguous tensor of `shape` with random bytes (bools 0 or 1)."""
    numel = math.prod(shape)
    if not numel:
        return torch.empty(shape, dtype=dtype)
    raw = random_bytes_tensor(rng, numel * dtype.itemsize)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).view(shape)


def random_state_dict(rng: random.Random) -> dict[str, torch.Tensor]:
    """Tensors safetensors can hold, some exactly 4 or 8 KiB, a few transposed (safetensors
    refuses those; tensortier saves them contiguous)."""
    state = {}
    for i in range(rng.randint(0, 8)):
        dtype = rng.choice(ST_DTYPES) if rng.random() > 0.03 else torch.float4_e2m1fn_x2
        if rng.random() > 0.15:
            shape = random_shape(rng, 200)
        else:
            shape = [rng.choice([4096, 8192]) // dtype.itemsize]
        t = random_packed_tensor(rng, dtype, shape)
        if rng.random() < 0.1 and t.dim() >= 2:
            t = t.transpose(0, 1)
        state[random_name(rng, i)] = t
    return state


# ---------------------------------------------------------------------------- comparison


def storage_bytes(storage: Any) -> bytes:
    """All bytes of a storage (typed or untyped); a placeholder for meta storages."""
    if isinstance(storage, torch.storage.TypedStorage):
        storage = storage._untyped_storage
    if storage.device.type == "meta":
        return b"<meta:%d>" % storage.nbytes()
    if not storage.nbytes():
        return b""
    return bytes_view(storage).numpy().tobytes()


def bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of `storage`."""
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))


def value_bytes(t: torch.Tensor) -> bytes:
    """The bytes of t's elements in row-major order, for any dtype and strides (compared as
    bytes: NaN payloads count, and dtypes without comparison kernels work)."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.numel() == 0:
        return b""
    itemsize = t.element_size()
    elements = bytes_view(t.untyped_storage()).as_strided(
        (*t.shape, itemsize),
        (*(s * itemsize for s in t.stride()), 1),
        t.storage_offset() * itemsize,
    )
    return elements.contiguous().numpy().tobytes()


def float_bits(x: float) -> bytes:
    """x's IEEE bytes: -0.0 differs from 0.0."""
    return struct.pack("<d", x)


class GraphComparer:
    """Compares an expected object graph with an actual one: types, values, tensor metadata
    and bytes, and the graph's shape (objects seen twice, storages shared by tensors)."""

    def __init__(self, *, exact_layout: bool = True) -> None:
        # With exact_layout, strides, offsets, storage bytes and storage sharing must match;
        # without (after a dtype conversion), only the tensors' values.
        self.exact_layout = exact_layout
        self.objects: dict[int, int] = {}
        self.objects_back: dict[int, int] = {}
        self.storages: dict[int, int] = {}
        self.storages_back: dict[int, int] = {}
        self.alive: list[Any] = []  # ids stay unique only while their objects live

    def same_object(self, want: Any, got: Any, path: str) -> None:
        """Checks that the object seen as `want` before is `got` again, and only it."""
        self.alive += [want, got]
        if id(want) in self.objects:
            if self.objects[id(want)] != id(got):
                raise Mismatch(f"{path}: object identity lost (expected an earlier object again)")
        elif id(got) in self.objects_back:
            raise Mismatch(f"{path}: two distinct objects loaded as one object")
        self.objects[id(want)] = id(got)
        self.objects_back[id(got)] = id(want)

    def same_storage(self, want: Any, got: Any, path: str) -> None:
        """Checks that storages shared by tensors are shared again, and only they."""
        if not self.exact_layout or want.nbytes() == 0:
            return  # torch.load does not share 0-byte storages either
        self.alive += [want, got]
        key_want, key_got = want._cdata, got._cdata
        if key_want in self.storages:
            if self.storages[key_want] != key_got:
                raise Mismatch(f"{path}: storage sharing lost (expected an earlier storage)")
        elif key_got in self.storages_back:
            raise Mismatch(f"{path}: storage sharing added (distinct storages became one)")
        self.storages[key_want] = key_got
        self.storages_back[key_got] = key_want

    def tensor(self, want: torch.Tensor, got: torch.Tensor, path: str) -> None:
        """Compares two tensors of any layout."""
        if type(want) is not type(got):
            raise Mismatch(f"{path}: type {type(got).__name__}, expected {type(want).__name__}")
        for attr in ("dtype", "layout", "requires_grad", "is_quantized"):
            if getattr(want, attr) != getattr(got, attr):
                raise Mismatch(
                    f"{path}: {attr} {getattr(got, attr)}, expected {getattr(want, attr)}"
                )
        if want.device.type != got.device.type:
            raise Mismatch(f"{path}: device {got.device}, expected {want.device}")
        if want.is_nested:  # no single shape: compare the components
            if want.size(0) != got.size(0):
                raise Mismatch(f"{path}: {got.size(0)} nested tensors, expected {want.size(0)}")
            for i, (w, g) in enumerate(zip(want.unbind(), got.unbind(), strict=True)):
                self.tensor(w, g, f"{path}[nested {i}]")
            return
        if tuple(want.shape) != tuple(got.shape):
            raise Mismatch(f"{path}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        if want.layout == torch.sparse_coo:
            self.tensor(want._indices(), got._indices(), f"{path}.indices")
            self.tensor(want._values(), got._values(), f"{path}.values")
            return
        if want.layout != torch.strided:  # CSR
            self.tensor(want.crow_indices(), got.crow_indices(), f"{path}.crow_indices")
            self.tensor(want.col_indices(), got.col_indices(), f"{path}.col_indices")
            self.tensor(want.values(), got.values(), f"{path}.values")
            return
        if want.is_quantized:
            self.quantized(want, got, path)
            return
        if (want.is_conj(), want.is_neg()) != (got.is_conj(), got.is_neg()):
            raise Mismatch(
                f"{path}: conj/neg bits ({got.is_conj()}, {got.is_neg()}), "
                f"expected ({want.is_conj()}, {want.is_neg()})"
            )
        if self.exact_layout:
            self.layout(want, got, path)
        elif want.numel() and want.device.type != "meta" and value_bytes(want) != value_bytes(got):
            raise Mismatch(f"{path}: values differ: {safe_repr(got)} expected {safe_repr(want)}")
        want_state, got_state = getattr(want, "__dict__", {}), getattr(got, "__dict__", {})
        if set(want_state) != set(got_state):
            raise Mismatch(
                f"{path}: tensor attributes {sorted(got_state)}, expected {sorted(want_state)}"
            )
        for name in want_state:
            self.compare(want_state[name], got_state[name], f"{path}.__dict__[{name!r}]")

    def quantized(self, want: torch.Tensor, got: torch.Tensor, path: str) -> None:
        """Compares two quantized tensors: scheme, parameters, integer values."""
        if want.qscheme() != got.qscheme():
            raise Mismatch(f"{path}: qscheme {got.qscheme()}, expected {want.qscheme()}")
        want_params: tuple[Any, ...]
        got_params: tuple[Any, ...]
        if want.qscheme() == torch.per_tensor_affine:
            want_params = (want.q_scale(), want.q_zero_point())
            got_params = (got.q_scale(), got.q_zero_point())
        else:
            want_params = (want.q_per_channel_scales().tolist(),
                           want.q_per_channel_zero_points().tolist(), want.q_per_channel_axis())
            got_params = (got.q_per_channel_scales().tolist(),
                          got.q_per_channel_zero_points().tolist(), got.q_per_channel_axis())
        if want_params != got_params:
            raise Mismatch(f"{path}: quantization {got_params}, expected {want_params}")
        self.tensor(want.int_repr(), got.int_repr(), f"{path}.int_repr")

    def layout(self, want: torch.Tensor, got: torch.Tensor, path: str) -> None:
        """Compares strides, offset, the whole storage's bytes and its sharing."""
        if want.stride() != got.stride():
            raise Mismatch(f"{path}: stride {got.stride()}, expected {want.stride()}")
        if want.storage_offset() != got.storage_offset():
            raise Mismatch(
                f"{path}: storage_offset {got.storage_offset()}, expected {want.storage_offset()}"
            )
        want_storage, got_storage = want.untyped_storage(), got.untyped_storage()
        if want.device.type != "meta":
            if want_storage.nbytes() != got_storage.nbytes():
                raise Mismatch(
                    f"{path}: storage of {got_storage.nbytes()} bytes, "
                    f"expected {want_storage.nbytes()}"
                )
            if storage_bytes(want_storage) != storage_bytes(got_storage):
                raise Mismatch(f"{path}: storage bytes differ")
        self.same_storage(want_storage, got_storage, path)

    def compare(self, want: Any, got: Any, path: str = "obj") -> None:
        """Compares any two values; raises Mismatch at the first difference."""
        if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
            if not (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor)):
                raise Mismatch(f"{path}: {type(got).__name__}, expected {type(want).__name__}")
            self.same_object(want, got, path)
            self.tensor(want, got, path)
            return
        if type(want) is not type(got):
            raise Mismatch(f"{path}: type {type(got).__name__}, expected {type(want).__name__}")
        if isinstance(want, (torch.storage.TypedStorage, torch.UntypedStorage)):
            self.bare_storage(want, got, path)
        elif isinstance(want, dict):
            self.same_object(want, got, path)
            if list(want) != list(got):
                raise Mismatch(f"{path}: keys {list(got)!r:.200}, expected {list(want)!r:.200}")
            for key in want:
                self.compare(want[key], got[key], f"{path}[{key!r}]")
            want_meta, got_meta = getattr(want, "_metadata", None), getattr(got, "_metadata", None)
            if want_meta != got_meta:
                raise Mismatch(f"{path}: _metadata {got_meta!r}, expected {want_meta!r}")
        elif isinstance(want, (list, tuple)):
            if isinstance(want, list):  # tuples are values: pickle does not keep their identity
                self.same_object(want, got, path)
            if len(want) != len(got):
                raise Mismatch(f"{path}: length {len(got)}, expected {len(want)}")
            for i, (w, g) in enumerate(zip(want, got, strict=True)):
                self.compare(w, g, f"{path}[{i}]")
        elif isinstance(want, float):
            if float_bits(want) != float_bits(got) and not (math.isnan(want) and math.isnan(got)):
                raise Mismatch(f"{path}: {got!r} expected {want!r}")
        elif isinstance(want, complex):
            if (float_bits(want.real), float_bits(want.imag)) != (
                float_bits(got.real), float_bits(got.imag)
            ):
                raise Mismatch(f"{path}: {got!r} expected {want!r}")
        elif want != got:
            raise Mismatch(f"{path}: {got!r:.200} expected {want!r:.200}")

    def bare_storage(self, want: Any, got: Any, path: str) -> None:
        """Compares two storages outside tensors: dtype, bytes and sharing."""
        if isinstance(want, torch.storage.TypedStorage):
            if want.dtype != got.dtype:
                raise Mismatch(f"{path}: storage dtype {got.dtype}, expected {want.dtype}")
            want, got = want._untyped_storage, got._untyped_storage
        if storage_bytes(want) != storage_bytes(got):
            raise Mismatch(f"{path}: storage bytes differ")
        self.same_storage(want, got, path)


def compare_state_dicts(want: dict[str, Any], got: dict[str, Any], label: str) -> None:
    """Compares flat name -> tensor mappings by names, dtypes, shapes and value bytes."""
    if sorted(want) != sorted(got):
        raise Mismatch(f"{label}: names {sorted(got)!r:.300}, expected {sorted(want)!r:.300}")
    for name, w in want.items():
        g = got[name]
        if w.dtype != g.dtype or tuple(w.shape) != tuple(g.shape):
            raise Mismatch(
                f"{label}: {name!r}: {g.dtype}{tuple(g.shape)}, expected {w.dtype}{tuple(w.shape)}"
            )
        if value_bytes(w) != value_bytes(g):
            raise Mismatch(f"{label}: {name!r}: bytes differ")


def zeros_like(t: torch.Tensor) -> torch.Tensor:
    """A zero-filled contiguous tensor like `t`, also of dtypes torch cannot fill (float4)."""
    out = torch.empty(t.shape, dtype=t.dtype)
    if out.numel():
        bytes_view(out.untyped_storage()).zero_()
    return out


# ---------------------------------------------------------------------------- helpers


def safe_repr(o: Any, limit: int = 150) -> str:
    """repr(o) cut to `limit` characters; torch cannot print tensors of some dtypes (float4,
    bits): their bytes then."""
    try:
        text = repr(o)
    except Exception:  # noqa: BLE001 - no printing kernel for this dtype
        text = f"<{o.dtype} {tuple(o.shape)}: {value_bytes(o).hex()}>"
    return text[:limit]


def describe(e: BaseException) -> str:
    """An exception's type and first line."""
    text = str(e).splitlines()[0][:300] if str(e) else ""
    return f"{type(e).__name__}: {text}"


def attempt(fn: Callable[[], Any]) -> tuple[Any, Exception | None]:
    """fn()'s result and None, or None and what it raised."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - any refusal is compared with the reference's
        return None, e


def torch_load(path: str | io.BytesIO, **kwargs: Any) -> Any:
    """The reference reader: torch.load(weights_only=True)."""
    return torch.load(path, weights_only=True, **kwargs)


def sketch(obj: Any) -> str:
    """A short description of an object graph for --case: types, dtypes, shapes, strides, and
    storages named s0, s1... in order of appearance (torch cannot print float4, bits and some
    exotic tensors, and their values say little)."""
    storages: dict[int, str] = {}

    def storage_name(storage: Any) -> str:
        key = storage._cdata if hasattr(storage, "_cdata") else id(storage)
        return storages.setdefault(key, f"s{len(storages)}")

    def visit(o: Any, depth: int) -> str:
        if depth > 6:
            return "..."
        if isinstance(o, torch.Tensor):
            kind = type(o).__name__
            if o.is_nested:
                return f"{kind}(nested {o.dtype}, {o.size(0)} tensors)"
            if o.layout != torch.strided or o.is_quantized or o.device.type != "cpu":
                return f"{kind}({o.dtype}, {tuple(o.shape)}, {o.layout}, {o.device})"
            flags = [name for name, on in (("conj", o.is_conj()), ("neg", o.is_neg()),
                                           ("requires_grad", o.requires_grad)) if on]
            storage = o.untyped_storage()
            return (f"{kind}({o.dtype}, shape={tuple(o.shape)}, stride={o.stride()}, "
                    f"offset={o.storage_offset()}, {storage_name(storage)}: "
                    f"{storage.nbytes()} B{''.join(', ' + f for f in flags)})")
        if is_storage(o):
            untyped = o._untyped_storage if isinstance(o, torch.storage.TypedStorage) else o
            return f"{type(o).__name__}({storage_name(untyped)}: {o.nbytes()} B)"
        if isinstance(o, dict):
            items = ", ".join(f"{k!r}: {visit(v, depth + 1)}" for k, v in o.items())
            return f"{type(o).__name__}{{{items}}}"
        if isinstance(o, (list, tuple)) and not isinstance(o, torch.Size):
            return f"{type(o).__name__}[{', '.join(visit(v, depth + 1) for v in o)}]"
        return repr(o)[:80]

    return visit(obj, 0)


def walk(obj: Any) -> Iterable[Any]:
    """Every value reachable through dicts, lists and tuples, each once."""
    seen: set[int] = set()
    todo = [obj]
    while todo:
        o = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        yield o
        if isinstance(o, dict):
            todo += list(o.values())
        elif isinstance(o, (list, tuple)) and not isinstance(o, torch.Size):
            todo += list(o)


def is_storage(o: Any) -> bool:
    return isinstance(o, (torch.UntypedStorage, torch.storage.TypedStorage))


def has_bare_storage(obj: Any) -> bool:
    """Whether obj holds a storage outside tensors (torch.load returns those typed)."""
    return any(is_storage(o) for o in walk(obj))


def has_stored_bytes(obj: Any) -> bool:
    """Whether saving obj stores any byte of tensor data (so there is a CRC-32 to check)."""
    for o in walk(obj):
        if isinstance(o, torch.Tensor):
            if o.layout != torch.strided or o.is_nested:
                return True
            if o.device.type != "meta" and o.untyped_storage().nbytes() > 0:
                return True
        elif is_storage(o) and o.nbytes() > 0:
            return True
    return False


def converted(obj: Any, dtype: torch.dtype) -> Any:
    """What `load(dtype=...)` must give for a freshly loaded `obj`: every floating-point,
    non-quantized tensor `.to(dtype)`, Parameters kept Parameters with their requires_grad,
    attributes kept, a tensor seen twice converted once. Changes obj's containers."""
    # id -> (original, converted): the original is kept alive, or once no container holds it any
    # more its id could be reused by a new tensor and look like one seen before.
    memo: dict[int, tuple[Any, Any]] = {}

    def visit(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            if id(o) in memo:
                return memo[id(o)][1]
            out = o
            if not o.is_quantized and o.is_floating_point() and o.dtype != dtype:
                with torch.no_grad():
                    c = o.to(dtype)
                if isinstance(o, torch.nn.Parameter):
                    out = torch.nn.Parameter(c, requires_grad=o.requires_grad)
                else:
                    out = c.requires_grad_(o.requires_grad)
                out.__dict__.update(o.__dict__)
            memo[id(o)] = (o, out)
            return out
        if isinstance(o, dict):
            for key in list(o):
                o[key] = visit(o[key])
        elif isinstance(o, list):
            o[:] = [visit(v) for v in o]
        elif isinstance(o, tuple) and not isinstance(o, torch.Size):
            return tuple(visit(v) for v in o)
        return o

    return visit(obj)


def converted_state_dict(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
    """A flat state dict with its floating-point tensors `.to(dtype)`."""
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}


def rewrite_zip(src: str, dst: str, rng: random.Random, big_endian: bool) -> None:
    """Writes the torch.save archive `src` again with Python's zipfile: records in random order,
    without data descriptors or torch's alignment padding, some with extra fields; with
    `big_endian` as a big-endian machine's torch.save would (byteorder "big", storages
    byte-swapped). Needs an archive that torch.load(weights_only=True) reads."""
    dtypes: dict[str, torch.dtype] = {}  # storage key -> dtype: what swapping its bytes needs
    with zipfile.ZipFile(src) as archive:
        names = archive.namelist()
        prefix = next(n for n in names if n.endswith("/data.pkl"))[: -len("data.pkl")]

        def persistent_load(saved_id: tuple[Any, ...]) -> Any:
            _, storage_type, key, _, numel = saved_id
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
            dtypes[key] = dtype
            # Zeros of the right size: every rebuild function accepts them (meta storages fail
            # nested tensors', whose sizes are data; so would uninitialized bytes).
            zeros = torch.zeros(numel * dtype.itemsize, dtype=torch.uint8)
            return torch.storage.TypedStorage(
                wrap_storage=zeros.untyped_storage(),
                dtype=dtype,
                _internal=True,
            )

        unpickler = _weights_only_unpickler.Unpickler(
            io.BytesIO(archive.read(prefix + "data.pkl")), encoding="utf-8"
        )
        unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
        with torch.no_grad():
            unpickler.load()
        order = list(names)
        rng.shuffle(order)
        with zipfile.ZipFile(dst, "w", compression=zipfile.ZIP_STORED) as out:
            for name in order:
                if name.endswith((".format_version", ".storage_alignment")):
                    continue  # these let torch.load assume torch's own layout
                data = archive.read(name)
                if big_endian and name == prefix + "byteorder":
                    data = b"big"
                elif big_endian and name.startswith(prefix + "data/") and data:
                    storage = torch.UntypedStorage.from_buffer(data, dtype=torch.uint8).clone()
                    storage.byteswap(dtypes[name[len(prefix + "data/") :]])
                    data = bytes(storage)
                info = zipfile.ZipInfo(name)
                padding = rng.randint(0, 7)
                info.extra = b"\x00" * padding if padding >= 4 else b""  # zero extra-field IDs
                out.writestr(info, data)


def flatten(obj: Any, prefix: str, out: dict[str, torch.Tensor], duplicates: list[str]) -> None:
    """The names `tensortier convert` gives the tensors of nested containers: keys and list
    indices joined by dots. Names seen twice go to `duplicates`."""
    if isinstance(obj, torch.Tensor):
        if prefix in out:
            duplicates.append(prefix)
        out[prefix] = obj.detach()
        return
    if isinstance(obj, dict):
        items = [
            (str(k) if isinstance(k, (str, int)) and not isinstance(k, bool) else "<key>", v)
            for k, v in obj.items()
        ]
    elif isinstance(obj, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(obj)]
    else:
        return
    for key, value in items:
        flatten(value, f"{prefix}.{key}" if prefix else key, out, duplicates)


def find_cli() -> Path:
    """The `tensortier` executable: $TENSORTIER_CLI, beside sys.executable, or on PATH. Exits
    with status 2 when there is none."""
    if os.environ.get("TENSORTIER_CLI"):
        candidate: str | None = os.environ["TENSORTIER_CLI"]
        where = f"at TENSORTIER_CLI={candidate}"
    elif (Path(sys.executable).parent / "tensortier").is_file():
        candidate = str(Path(sys.executable).parent / "tensortier")
        where = f"at {candidate}"
    else:
        candidate = shutil.which("tensortier")
        where = f"beside {sys.executable} nor on PATH"
    if candidate is None or not os.access(candidate, os.X_OK) or os.path.isdir(candidate):
        print(f"checkpoint_fuzz: no `tensortier` executable {where} (install the "
              "package into this Python's environment, or set TENSORTIER_CLI)", file=sys.stderr)
        raise SystemExit(2)
    return Path(candidate)


# ---------------------------------------------------------------------------- cases


@dataclass
class Finding:
    """One failed check of one case."""

    mode: str
    seed: int
    case: int
    check: str
    message: str
    known_gap: str | None = None


class Case:
    """One generated case: its random source, scratch directory, findings and check counts."""

    def __init__(self, mode: str, seed: int, index: int, work_dir: Path, cli_path: Path,
                 verbose: bool) -> None:
        self.mode, self.seed, self.index, self.verbose = mode, seed, index, verbose
        self.work_dir, self.cli_path = work_dir, cli_path
        # Everything the case does is drawn from here: rerunning case `index` alone repeats it.
        self.rng = random.Random(f"{mode}:{seed}:{index}")
        torch.manual_seed(self.rng.randint(0, 2**31))
        self.dir = work_dir / f"{mode}-{index}"
        self.dir.mkdir()
        self.findings: list[Finding] = []
        self.checks: collections.Counter[str] = collections.Counter()

    def path(self, name: str) -> str:
        """A file name in the case's scratch directory."""
        return str(self.dir / name)

    def find(self, check: str, message: str) -> None:
        """Records a finding; paths in it name the scratch directory as $TMP (stable output)."""
        message = message.replace(str(self.work_dir), "$TMP")
        gap = known_gap(check, message)
        self.findings.append(
            Finding(self.mode, self.seed, self.index, check, message, gap.name if gap else None)
        )
        if self.verbose:
            note = f" (known gap {gap.name}: {gap.reason})" if gap else ""
            print(f"FINDING [{check}]{note} {message}")

    def count(self, check: str) -> None:
        self.checks[check] += 1

    def run_check(self, check: str, fn: Callable[[], None]) -> None:
        """Runs one check: a Mismatch or any other exception out of fn is a finding."""
        self.count(check)
        try:
            fn()
        except Mismatch as e:
            self.find(check, str(e))
        except Exception as e:  # noqa: BLE001 - tensortier or the check crashed: report it
            self.find(check, "crash: " + describe(e) + (
                "\n" + traceback.format_exc() if self.verbose else ""))

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Runs the `tensortier` CLI."""
        return subprocess.run(
            [str(self.cli_path), *args], capture_output=True, text=True, errors="replace",
            timeout=CLI_TIMEOUT_S,
        )

    def expect_cli_ok(self, label: str, *args: str) -> None:
        """Runs the CLI; a non-zero exit is a Mismatch."""
        p = self.cli(*args)
        if p.returncode != 0:
            words = " ".join(os.path.basename(a) for a in args)
            raise Mismatch(
                f"{label}: `tensortier {words}` exit {p.returncode}: "
                f"{(p.stdout + p.stderr).strip()[:300]}"
            )


# torch mode ------------------------------------------------------------------


def case_torch(case: Case) -> None:
    """A random object: tensortier.save against torch.save; then torch.save files of it
    (protocols, alignments, CRCs, rewritten archives) read by tensortier against torch.load."""
    rng = case.rng
    gen = ObjectGenerator(rng, exotic=rng.random() < 0.25)
    obj = gen.top()
    if case.verbose:
        print("object:", sketch(obj)[:4000])
    if check_tensortier_save(case, obj):
        check_torch_files(case, obj)


def check_tensortier_save(case: Case, obj: Any) -> bool:
    """tensortier.save(obj) must succeed where torch.save and torch.load(weights_only) do, and
    write what both torch.load and tensortier.load read as obj. Returns whether torch.save
    accepted obj."""
    path = case.path("tt.pt")
    reference = io.BytesIO()
    _, torch_error = attempt(lambda: torch.save(obj, reference))
    _, error = attempt(lambda: tensortier.save(obj, path))
    case.count("a.save")
    if error is not None:
        if torch_error is None:
            reference.seek(0)
            _, load_error = attempt(lambda: torch_load(reference))
            if load_error is None:
                case.find("a.save", "tensortier.save refused what torch.save and torch.load"
                          f"(weights_only) accept: {describe(error)}")
        elif not isinstance(error, (ValueError, TypeError)):
            case.find("a.save",
                      f"unclear refusal {describe(error)} (torch.save: {describe(torch_error)})")
        if os.path.exists(path):
            case.find("a.save", "a failed save left a file under the final name")
        return torch_error is None
    if torch_error is not None:
        case.find("a.save", f"tensortier.save accepted what torch.save refuses: "
                  f"{describe(torch_error)}")
    loaded, load_error = attempt(lambda: torch_load(path))
    if load_error is not None:
        # Fine where torch.load(weights_only) refuses torch.save's own file as well.
        case.count("a.torch_load")
        reference.seek(0)
        _, reference_error = attempt(lambda: torch_load(reference))
        if reference_error is None:
            case.find("a.torch_load", "torch.load refuses tensortier's file but not torch.save's: "
                      f"{describe(load_error)}")
        return torch_error is None
    reference.seek(0)
    round_trip, _ = attempt(lambda: torch_load(reference))

    def same_as_torch() -> None:
        # Against torch.save + torch.load (which returns bare storages typed and does not share
        # 0-byte storages), and against obj itself where it has no bare storage.
        GraphComparer().compare(round_trip if round_trip is not None else obj, loaded)
        if not has_bare_storage(obj):
            GraphComparer().compare(obj, loaded)

    case.run_check("a.roundtrip", same_as_torch)
    case.run_check("a.tt_load_own", lambda: GraphComparer().compare(loaded, tensortier.load(path)))
    case.run_check("a.verify_cli", lambda: case.expect_cli_ok("tensortier.save file", "verify",
                                                              path))
    return torch_error is None


def check_torch_files(case: Case, obj: Any) -> None:
    """torch.save(obj) with a random protocol, alignment and CRC setting, and that archive
    rewritten by zipfile: tensortier.load (plain, mmap, verify, dtype), load_into and the CLI
    must agree with torch.load(weights_only=True)."""
    rng = case.rng
    protocol = rng.choice([2, 2, 3, 4, 5])
    alignment = rng.choice([64, 64, 1, 8, 4096])
    crc = rng.random() < 0.85
    path = case.path("ref.pt")
    settings = {"save.storage_alignment": alignment, "save.compute_crc32": crc}
    try:
        with serialization_config.patch(settings):  # type: ignore[attr-defined]
            torch.save(obj, path, pickle_protocol=protocol, _use_new_zipfile_serialization=True)
    except Exception as e:  # noqa: BLE001 - this protocol cannot pickle obj: nothing to read
        if case.verbose:
            print(f"torch.save(protocol={protocol}) refused: {describe(e)}")
        return
    label = f"torch.save(protocol={protocol}, align={alignment}, crc={crc})"
    if not crc:
        case.count("b.verify_nocrc")
        _, error = attempt(lambda: tensortier.load(path, verify=True))
        if error is None and has_stored_bytes(obj):
            case.find("b.verify_nocrc", "load(verify=True) accepted a file without CRC-32s")
        elif error is not None and not isinstance(error, ValueError):
            case.find("b.verify_nocrc", f"unclear refusal {describe(error)}")
    case.run_check("b.load_into", lambda: check_load_into(case, obj, path))
    variants = [(path, label, crc)]
    rewrite = rng.random() < 0.35 and protocol <= 3 and crc
    if rewrite and attempt(lambda: torch_load(path))[1] is None:
        big_endian = rng.random() < 0.5
        rewritten = case.path("rewritten.pt")
        try:
            rewrite_zip(path, rewritten, rng, big_endian)
            variants.append((rewritten, f"rewritten zip (big_endian={big_endian})", True))
        except Exception as e:  # noqa: BLE001
            case.find("setup", f"rewriting the archive failed: {describe(e)}")
    for variant, variant_label, has_crc in variants:
        check_torch_file(case, variant, variant_label, has_crc)


def check_torch_file(case: Case, path: str, label: str, has_crc: bool) -> None:
    """tensortier.load(path) plain, mmap and verify, with dtype=, and `tensortier info`/`verify`
    against torch.load(path, weights_only=True)."""
    rng = case.rng
    expected, expected_error = attempt(lambda: torch_load(path))
    loads: list[tuple[str, dict[str, Any]]] = [("b.load", {}), ("c.mmap", {"mmap": True})]
    if has_crc:
        loads.append(("b.verify", {"verify": True}))
    for check, kwargs in loads:
        case.count(check)
        got, error = attempt(functools.partial(tensortier.load, path, **kwargs))
        if expected_error is not None:
            if error is None:
                case.find(check, f"{label}: tensortier.load accepted a file torch.load refuses "
                          f"({describe(expected_error)})")
            elif not isinstance(error, ValueError):
                case.find(check, f"{label}: unclear refusal {describe(error)}")
            continue
        if error is not None:
            case.find(check, f"{label}: tensortier.load({kwargs}) failed: {describe(error)} "
                      "(torch.load reads it)")
            continue
        try:
            GraphComparer().compare(expected, got)
        except Mismatch as e:
            case.find(check, f"{label} load({kwargs}): {e}")
            continue
        if kwargs.get("mmap") and rng.random() < 0.3:
            case.run_check("c.mmap_cow", functools.partial(check_mmap_private, path, got))
    if expected_error is not None:
        return
    check_dtype_conversion(case, path, label)
    if rng.random() < 0.3:

        def info_and_verify() -> None:
            case.expect_cli_ok(label, "info", path)
            if has_crc:  # `verify` exits 1 on a file without CRC-32s, as documented
                case.expect_cli_ok(label, "verify", path)

        case.run_check("b.cli", info_and_verify)


def check_dtype_conversion(case: Case, path: str, label: str) -> None:
    """load(dtype=...) must give torch.load + .to(dtype) of each floating-point tensor; where
    torch cannot convert (float4, complex32), tensortier may refuse, but clearly."""
    rng = case.rng
    dtype = rng.choice([torch.float16, torch.bfloat16, torch.float32, torch.float64])
    mmap = rng.random() < 0.3
    case.count("d.dtype")
    got, error = attempt(lambda: tensortier.load(path, dtype=dtype, mmap=mmap))
    expected, expected_error = attempt(lambda: converted(torch_load(path), dtype))
    call = f"{label}: load(dtype={dtype}, mmap={mmap})"
    if expected_error is not None:
        if error is not None and not isinstance(error, CONVERSION_REFUSALS):
            case.find("d.dtype", f"{call}: unclear error {describe(error)}")
        # else tensortier converted what .to() cannot: nothing to compare with
    elif error is not None:
        case.find("d.dtype", f"{call} failed: {describe(error)} (torch.load + .to() works)")
    else:
        try:
            GraphComparer(exact_layout=False).compare(expected, got)
        except Mismatch as e:
            case.find("d.dtype", f"{call}: {e}")


def check_load_into(case: Case, obj: Any, path: str) -> None:
    """load_into a dict of zero targets (some transposed, some of another dtype) must give
    what torch.load + target.copy_(value) gives."""
    if not isinstance(obj, dict) or not obj:
        return
    loaded, error = attempt(lambda: torch_load(path))
    if error is not None:
        return
    rng = case.rng
    targets, expected = {}, {}
    for name, value in loaded.items():
        if (not isinstance(name, str) or not isinstance(value, torch.Tensor)
                or value.layout != torch.strided or value.is_quantized or value.is_nested
                or value.device.type == "meta"):
            return  # not a state dict load_into takes
        if value.dtype in (torch.float4_e2m1fn_x2, torch.complex32, torch.bool) or (
            "bits" in str(value.dtype)
        ):
            return  # torch has no copy_ for these: no reference
        dtype = value.dtype
        if value.is_floating_point() and rng.random() < 0.3:
            dtype = rng.choice([torch.float32, torch.float64, torch.bfloat16])
        if value.dim() >= 2 and rng.random() < 0.3:
            reversed_dims = tuple(reversed(range(value.dim())))
            target = torch.zeros(tuple(reversed(value.shape)), dtype=dtype).permute(reversed_dims)
        else:
            target = torch.zeros(value.shape, dtype=dtype)
        targets[name] = target
        want = torch.zeros(value.shape, dtype=dtype)
        with torch.no_grad():
            want.copy_(value.detach())
        expected[name] = want
    case.count("b.load_into_run")
    tensortier.load_into(targets, path)
    for name, want in expected.items():
        if value_bytes(want) != value_bytes(targets[name]):
            raise Mismatch(f"load_into[{name!r}]: values {safe_repr(targets[name])} "
                           f"expected {safe_repr(want)}")


def check_mmap_private(path: str, loaded: Any) -> None:
    """Writing into tensors that load(mmap=True) returned must not change the file."""
    with open(path, "rb") as f:
        before = f.read()
    for o in walk(loaded):
        if (isinstance(o, torch.Tensor) and o.layout == torch.strided and o.device.type == "cpu"
                and not o.is_quantized and not o.is_nested and o.untyped_storage().nbytes()):
            bytes_view(o.untyped_storage()).fill_(0xA5)
    with open(path, "rb") as f:
        if f.read() != before:
            raise Mismatch("writing into mmap=True tensors changed the file")


# st mode ---------------------------------------------------------------------


def case_st(case: Case) -> None:
    """A random state dict and metadata: tensortier's safetensors files read by safetensors
    and by tensortier; safetensors' files read by tensortier; `convert` there and back."""
    rng = case.rng
    state = random_state_dict(rng)
    metadata = random_metadata(rng)
    checksum = rng.random() < 0.5
    if case.verbose:
        print({k: (t.dtype, tuple(t.shape)) for k, t in state.items()}, metadata, checksum)
    ours = case.path("tt.safetensors")
    _, error = attempt(lambda: tensortier.save(state, ours, metadata=metadata, checksum=checksum))
    case.count("st.save")
    if error is not None:
        contiguous = {k: v.contiguous() for k, v in state.items()}
        _, st_error = attempt(lambda: st.save_file(contiguous, case.path("st0.safetensors"),
                                                   metadata=metadata))
        if st_error is None:
            case.find("st.save", f"tensortier.save refused what safetensors saves: "
                      f"{describe(error)}")
        elif not isinstance(error, (ValueError, TypeError)):
            case.find("st.save", f"unclear refusal {describe(error)}")
        return

    def safetensors_reads_ours() -> None:
        compare_state_dicts(state, st.load_file(ours), "st.load_file(tensortier's file)")
        with safetensors.safe_open(ours, "pt") as f:
            stored = f.metadata() or {}
        want = dict(metadata or {})
        want.setdefault("format", "pt")  # as safetensors.torch.save_file writes it
        stored = {k: v for k, v in stored.items() if not k.startswith("tensortier.")}
        if stored != want:
            raise Mismatch(f"metadata {stored!r:.300}, expected {want!r:.300}")

    case.run_check("st.a", safetensors_reads_ours)
    case.run_check("st.tt_own", lambda: compare_state_dicts(
        state, tensortier.load(ours, verify=checksum), "tensortier.load(own file)"))
    case.run_check("st.tt_own_mmap", lambda: compare_state_dicts(
        state, tensortier.load(ours, mmap=True), "tensortier.load(own file, mmap=True)"))
    if checksum:
        case.run_check("st.verify_cli", lambda: case.expect_cli_ok("own file", "verify", ours))

    theirs = case.path("st.safetensors")
    contiguous = {k: v.contiguous() for k, v in state.items()}
    _, st_error = attempt(lambda: st.save_file(contiguous, theirs, metadata=metadata))
    if st_error is None:
        # safetensors 0.8 writes some metadata (empty keys and values) it cannot read back.
        _, st_error = attempt(lambda: st.load_file(theirs))
    if st_error is None:
        check_safetensors_file(case, theirs, contiguous)
    source = ours if rng.random() < 0.5 or st_error is not None else theirs
    case.run_check("cli.st_pt_st", lambda: check_convert_round_trip(case, source))


def check_safetensors_file(case: Case, path: str, state: dict[str, torch.Tensor]) -> None:
    """A safetensors.torch file: tensortier.load (plain, mmap, dtype) and load_into."""
    rng = case.rng
    for check, kwargs in (("st.b.load", {}), ("st.b.mmap", {"mmap": True})):

        def same_as_safetensors(kwargs: dict[str, Any] = kwargs) -> None:
            got = tensortier.load(path, **kwargs)
            compare_state_dicts(st.load_file(path), got, f"tensortier.load({kwargs})")

        case.run_check(check, same_as_safetensors)
    dtype = rng.choice([torch.float16, torch.bfloat16, torch.float32])
    mmap = rng.random() < 0.3

    def conversion() -> None:
        got, error = attempt(lambda: tensortier.load(path, dtype=dtype, mmap=mmap))
        want, want_error = attempt(lambda: converted_state_dict(st.load_file(path), dtype))
        call = f"tensortier.load(dtype={dtype}, mmap={mmap})"
        if want_error is not None:  # torch cannot convert (float4): tensortier may refuse
            if error is not None and not isinstance(error, CONVERSION_REFUSALS):
                raise Mismatch(f"{call}: unclear error {describe(error)}")
            return
        if error is not None:
            raise Mismatch(f"{call} failed: {describe(error)} (safetensors + .to() works)")
        compare_state_dicts(want, got, call)

    case.run_check("st.dtype", conversion)

    def into_zeros() -> None:
        targets = {k: zeros_like(v) for k, v in state.items()}
        tensortier.load_into(targets, path)
        compare_state_dicts(state, targets, "load_into")

    case.run_check("st.load_into", into_zeros)


def check_convert_round_trip(case: Case, source: str) -> None:
    """`tensortier convert` safetensors -> .pt (read by torch.load and tensortier.load, CRCs
    verified) -> safetensors again (the same tensors, checksums verified)."""
    want = st.load_file(source)
    as_torch = case.path("converted.pt")
    case.expect_cli_ok("safetensors -> .pt", "convert", source, as_torch)
    compare_state_dicts(want, torch_load(as_torch), "torch.load(converted .pt)")
    compare_state_dicts(want, tensortier.load(as_torch), "tensortier.load(converted .pt)")
    case.expect_cli_ok("converted .pt", "verify", as_torch)
    back = case.path("back.safetensors")
    case.expect_cli_ok(".pt -> safetensors", "convert", as_torch, back)
    compare_state_dicts(want, st.load_file(back), "st.load_file(converted back)")
    case.expect_cli_ok("converted back", "verify", back)


# cli mode --------------------------------------------------------------------


def case_cli(case: Case) -> None:
    """A torch.save or tensortier.save file of nested dicts and lists of tensors (some slices
    of one storage): `convert` to safetensors, `info`, `verify`, and load_into from the .pt."""
    rng = case.rng
    bases: list[torch.Tensor] = []

    def tensor() -> torch.Tensor:
        if bases and rng.random() < 0.4:
            base = rng.choice(bases)
            start = rng.randint(0, base.numel())
            t = base[start : rng.randint(start, base.numel())]
            if t.numel() and rng.random() < 0.5:
                t = t.view(-1, 1) if rng.random() < 0.5 else t.view(1, -1, 1)
        else:
            t = random_packed_tensor(rng, rng.choice(ST_DTYPES), random_shape(rng, 100))
            if t.dim() == 1 and rng.random() < 0.5:
                bases.append(t)
        if rng.random() < 0.2:
            t = torch.nn.Parameter(t, requires_grad=False)
        return t

    def value(depth: int) -> Any:
        x = rng.random()
        if depth < 3 and x < 0.25:
            if rng.random() < 0.5:
                return [value(depth + 1) for _ in range(rng.randint(0, 3))]
            return collections.OrderedDict(
                (random_name(rng, i) if rng.random() < 0.7 else i, value(depth + 1))
                for i in range(rng.randint(0, 3))
            )
        if x < 0.3:
            return rng.choice([1, "s", None, 2.5])
        return tensor()

    top: dict[Any, Any] = collections.OrderedDict()
    for i in range(rng.randint(0, 6)):
        top[random_name(rng, i) if rng.random() < 0.9 else i] = value(0)
    flat: dict[str, torch.Tensor] = {}
    duplicates: list[str] = []
    flatten(top, "", flat, duplicates)
    path = case.path("in.pt")
    if rng.random() < 0.5:
        torch.save(top, path, pickle_protocol=rng.choice([2, 3]))
    else:
        tensortier.save(top, path)

    def convert() -> None:
        out = case.path("out.safetensors")
        p = case.cli("convert", path, out)
        if duplicates:
            if p.returncode == 0:
                raise Mismatch(f"convert .pt -> safetensors accepted duplicate names {duplicates}")
            return
        if p.returncode != 0:
            raise Mismatch(f"convert .pt -> safetensors exit {p.returncode}: "
                           f"{(p.stdout + p.stderr).strip()[:300]}")
        compare_state_dicts(flat, st.load_file(out), "st.load_file(converted)")
        case.expect_cli_ok("converted", "verify", out)
        compare_state_dicts(flat, tensortier.load(out, verify=True), "tensortier.load(converted)")

    case.run_check("cli.pt_st", convert)
    def info_and_verify() -> None:
        case.expect_cli_ok("torch file", "info", path)
        case.expect_cli_ok("torch file", "verify", path)

    case.run_check("cli.info_verify", info_and_verify)
    if all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in top.items()):

        def into_zeros() -> None:
            targets = {k: zeros_like(v) for k, v in top.items()}
            tensortier.load_into(targets, path)
            compare_state_dicts({k: v.detach() for k, v in top.items()}, targets, "load_into(.pt)")

        case.run_check("cli.load_into_pt", into_zeros)


# craft mode ------------------------------------------------------------------


def case_craft(case: Case) -> None:
    """A hand-written safetensors file (tensors in any order, so at unaligned offsets; header
    padding; metadata absent, empty or not): safetensors against tensortier.load (plain,
    mmap, dtype), load_into, `convert` and `info`."""
    rng = case.rng
    state = {}
    for i in range(rng.randint(0, 6)):
        t = random_packed_tensor(rng, rng.choice(ST_DTYPES), random_shape(rng, 50))
        state[f"t{i}" if rng.random() < 0.8 else random_name(rng, i)] = t
    names = list(state)
    rng.shuffle(names)
    header: dict[str, Any] = {}
    blobs = []
    position = 0
    for name in names:
        t = state[name]
        blob = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [position, position + len(blob)],
        }
        blobs.append(blob)
        position += len(blob)
    if rng.random() < 0.5:
        header["__metadata__"] = random_metadata(rng) or {}
    entries = list(header.items())
    rng.shuffle(entries)
    header_json = json.dumps(dict(entries), ensure_ascii=rng.random() < 0.5).encode()
    header_json += b" " * rng.randint(0, 9)
    path = case.path("crafted.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_json)) + header_json + b"".join(blobs))

    expected, expected_error = attempt(lambda: st.load_file(path))
    variants: tuple[dict[str, Any], ...] = (
        {}, {"mmap": True}, {"dtype": torch.float32}, {"mmap": True, "dtype": torch.bfloat16}
    )
    for kwargs in variants:
        case.count("craft")
        got, error = attempt(functools.partial(tensortier.load, path, **kwargs))
        if expected_error is not None:
            if error is None:
                case.find("craft", f"tensortier.load({kwargs}) accepted a file safetensors "
                          f"refuses: {describe(expected_error)}")
            continue
        if error is not None:
            case.find("craft", f"tensortier.load({kwargs}) failed: {describe(error)} "
                      "(safetensors reads it)")
            continue
        want = converted_state_dict(expected, kwargs["dtype"]) if "dtype" in kwargs else expected
        try:
            compare_state_dicts(want, got, f"tensortier.load({kwargs})")
        except Mismatch as e:
            case.find("craft", str(e))
    if expected_error is not None:
        return

    def into_zeros() -> None:
        targets = {k: zeros_like(v) for k, v in expected.items()}
        tensortier.load_into(targets, path)
        compare_state_dicts(expected, targets, "load_into")

    def convert() -> None:
        out = case.path("crafted.pt")
        case.expect_cli_ok("crafted file", "convert", path, out)
        compare_state_dicts(expected, torch_load(out), "torch.load(converted)")

    case.run_check("craft.load_into", into_zeros)
    case.run_check("craft.convert", convert)
    case.run_check("craft.info", lambda: case.expect_cli_ok("crafted file", "info", path))


# agree mode ------------------------------------------------------------------
#
# One crafted file (or shard index) goes through the four readers that must agree:
# `tensortier.load(verify=True)` and `tensortier verify` accept the same files, `tensortier.load`
# and `tensortier info` accept the same files, both loads give the same values, and `tensortier
# convert` accepts what load(verify=True) accepts (and nothing load refuses), writing a file
# whose values are those load gives, to an output name whose suffix tensortier.save reads as the
# format convert writes (else it refuses). What is crafted is described by [tags] in every
# finding's message; KNOWN_GAPS entries match them.

TENSORS_KEY = "tensortier.xxh64"
HEADER_KEY = "tensortier.header_xxh64"
# Names of crafted inputs: any suffix case, or none (formats go by content when loading).
INPUT_SUFFIXES = (".safetensors", ".SafeTensors", ".ST", ".st", ".pt", ".PT", ".Pt", ".pth",
                  ".bin", ".BIN", ".ckpt", "", ".data")
OUTPUT_SUFFIXES = (".pt", ".PT", ".Pt", ".pth", ".Bin", ".safetensors", ".SafeTensors", ".ST",
                   ".st", ".out", "")


def agree_state(rng: random.Random) -> dict[str, torch.Tensor]:
    """0 to 4 tensors of any safetensors dtype (zero-length ones included)."""
    return {
        random_name(rng, i): random_packed_tensor(rng, rng.choice(ST_DTYPES), random_shape(rng, 40))
        for i in range(rng.randint(0, 4))
    }


def read_safetensors_parts(path: str) -> tuple[dict[str, Any], bytes]:
    """A safetensors file's header (order kept) and data bytes."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    return json.loads(raw[8 : 8 + n], object_pairs_hook=collections.OrderedDict), raw[8 + n :]


def write_safetensors_parts(path: str, header_json: bytes, data: bytes) -> None:
    header_json += b" " * (-len(header_json) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(header_json)) + header_json + data)


def header_json_with(header: dict[str, Any], checksums_text: str | None) -> bytes:
    """`header` serialized with its tensor checksums metadata replaced by `checksums_text` (a
    JSON string's contents, written as they are: duplicate keys survive)."""
    header = collections.OrderedDict(header)
    metadata = collections.OrderedDict(header.get("__metadata__") or {})
    metadata.pop(TENSORS_KEY, None)
    header["__metadata__"] = metadata
    text = json.dumps(header, ensure_ascii=False)
    if checksums_text is None:
        return text.encode()
    # Spliced in as the metadata's first member (the digest of the header skips it).
    marker = '"__metadata__": {'
    at = text.index(marker) + len(marker)
    member = f"{json.dumps(TENSORS_KEY)}: {json.dumps(checksums_text)}"
    return (text[:at] + member + ("" if text[at] == "}" else ", ") + text[at:]).encode()


def lenient_hex(rng: random.Random, hex16: str) -> tuple[str, str]:
    """A spelling of the 16-digit `hex16` that Python's int(v, 16) reads as the same number but
    that is not 16 hex digits; and its tag."""
    choices = [
        ("0x", lambda h: "0x" + h), ("0X", lambda h: "0X" + h),
        ("underscore", lambda h: h[:8] + "_" + h[8:]),
        ("spaces", lambda h: rng.choice([" ", "\t", "\n "]) + h + rng.choice(["", " "])),
        ("plus", lambda h: "+" + h), ("long", lambda h: "0" * rng.randint(1, 3) + h),
        ("unicode-digit", lambda h: h.replace("1", "\u0661").replace("7", "\uff17")),
    ]
    if hex16.startswith("0"):
        choices.append(("short", lambda h: h.lstrip("0") or "0"))
    tag, spell = rng.choice(choices)
    spelled = spell(hex16)
    return (spelled, tag) if spelled != hex16 else (hex16.upper() + " ", "spaces")


def craft_checksums(rng: random.Random, sums: dict[str, str], tags: list[str]) -> str:
    """The tensor checksums' JSON text with one edge case of its syntax (recorded in tags)."""
    items = list(sums.items())
    names = [k for k, _ in items]
    edit = rng.choice(["upper", "lenient", "duplicate-last-right", "duplicate-first-right",
                       "duplicate-same", "unknown-name", "missing", "number", "wrong",
                       "not-json", "not-object", "empty-object"])
    if not names and edit not in ("unknown-name", "not-json", "not-object"):
        edit = "unknown-name"
    tags.append(f"checksum-{edit}")
    pairs = [(json.dumps(k), json.dumps(v)) for k, v in items]
    victim = rng.randrange(len(items)) if items else 0
    wrong = f"{(int(items[victim][1], 16) ^ (1 << rng.randrange(64))):016x}" if items else ""
    if edit == "upper":
        pairs = [(k, v.upper()) for k, v in pairs]
    elif edit == "lenient":
        spelled, tag = lenient_hex(rng, items[victim][1])
        tags.append(f"checksum-lenient-{tag}")
        pairs[victim] = (pairs[victim][0], json.dumps(spelled))
    elif edit == "duplicate-last-right":
        pairs.insert(victim, (pairs[victim][0], json.dumps(wrong)))
    elif edit == "duplicate-first-right":
        pairs.insert(victim + 1, (pairs[victim][0], json.dumps(wrong)))
    elif edit == "duplicate-same":
        pairs.insert(victim, pairs[victim])
    elif edit == "unknown-name":
        pairs.append((json.dumps("not.a.tensor"), json.dumps("0123456789abcdef")))
    elif edit == "missing":
        del pairs[victim]
    elif edit == "number":
        pairs[victim] = (pairs[victim][0], str(int(items[victim][1], 16)))
    elif edit == "wrong":
        pairs[victim] = (pairs[victim][0], json.dumps(wrong))
    elif edit == "not-json":
        return "{" + ",".join(f"{k}:{v}" for k, v in pairs)  # unterminated
    elif edit == "not-object":
        return json.dumps([v for _, v in items])
    elif edit == "empty-object":
        return "{}"
    return "{" + ", ".join(f"{k}: {v}" for k, v in pairs) + "}"


def craft_safetensors(rng: random.Random, path: str, tags: list[str]) -> None:
    """A tensortier.save safetensors file (with checksums, mostly) and, half the time, its
    tensor checksums' metadata rewritten with one edge case."""
    state = agree_state(rng)
    metadata = random_metadata(rng) if rng.random() < 0.3 else None
    checksum = rng.random() < 0.85
    tags.append("safetensors" + ("" if checksum else "-no-checksums"))
    tensortier.save(state, path, format="safetensors", metadata=metadata, checksum=checksum)
    if not checksum or rng.random() < 0.5:
        return
    header, data = read_safetensors_parts(path)
    sums = json.loads(header["__metadata__"][TENSORS_KEY])
    text = craft_checksums(rng, sums, tags)
    if rng.random() < 0.2:
        tags.append("no-header-checksum")
        del header["__metadata__"][HEADER_KEY]
    write_safetensors_parts(path, header_json_with(header, text), data)


def craft_torch(rng: random.Random, path: str, tags: list[str]) -> None:
    """A flat state dict saved by tensortier.save (with or without checksum=True) or
    torch.save (CRC-32s on or off)."""
    state = agree_state(rng)
    writer = rng.choice(["tensortier", "tensortier-checksum", "torch", "torch-no-crc"])
    tags.append(f"torch-by-{writer}")
    if writer.startswith("tensortier"):
        tensortier.save(state, path, format="torch", checksum=writer.endswith("checksum"))
    else:
        with serialization_config.patch({"save.compute_crc32": writer == "torch"}):
            torch.save(state, path)


def damage(rng: random.Random, path: str, tags: list[str]) -> None:
    """Truncates the file, flips one of its bytes, appends bytes, or makes a size it records
    lie (safetensors header length or data offsets; zip record sizes)."""
    raw = bytearray(Path(path).read_bytes())
    how = rng.choice(["truncate", "flip", "append", "lie"])
    if how == "truncate" and raw:
        cut = rng.choice([rng.randrange(len(raw)), max(0, len(raw) - rng.randint(1, 8)),
                          rng.randint(0, 16)])
        raw = raw[:cut]
    elif how == "flip" and raw:
        at = rng.randrange(len(raw)) if rng.random() < 0.5 else rng.randrange(
            len(raw) // 2, len(raw))
        raw[at] ^= 1 << rng.randrange(8)
    elif how == "append":
        raw += rng.choice([b"\0" * rng.randint(1, 9), rng.randbytes(rng.randint(1, 64))])
    elif raw[:4] == b"PK\x03\x04":  # a zip: a local or central record's size lies
        sig = rng.choice([b"PK\x03\x04", b"PK\x01\x02"])
        spots = [i for i in range(len(raw) - 4) if raw[i : i + 4] == sig]
        at = rng.choice(spots) + (18 if sig == b"PK\x03\x04" else 20) + rng.choice([0, 4])
        if at + 4 <= len(raw):
            (n,) = struct.unpack_from("<I", raw, at)
            struct.pack_into("<I", raw, at, max(0, n + rng.choice([-1, 1, 64, 1 << 20])) % 2**32)
    elif len(raw) >= 8:  # safetensors: the header length, or one tensor's data offsets
        (n,) = struct.unpack_from("<Q", raw)
        if rng.random() < 0.5 or n > len(raw):
            struct.pack_into("<Q", raw, 0, max(0, n + rng.choice([-8, -1, 1, 8, 1 << 40])))
        else:
            header = json.loads(raw[8 : 8 + n], object_pairs_hook=collections.OrderedDict)
            names = [k for k in header if k != "__metadata__"]
            if names:
                entry = header[rng.choice(names)]
                entry["data_offsets"][rng.randrange(2)] += rng.choice([-1, 1, 2, 4096])
            text = json.dumps(header, ensure_ascii=False).encode()
            raw = bytearray(struct.pack("<Q", len(text)) + text) + raw[8 + n :]
    tags.append(f"damaged-{how}")
    Path(path).write_bytes(bytes(raw))


# Shard paths as an index may spell them: (spelling of the file `f` in the index, where the file
# really is relative to the index's directory, tag). None: no file is made.
def shard_spellings(f: str) -> list[tuple[str, str | None, str]]:
    return [
        (f, f, "plain"), (f"./{f}", f, "dot-slash"), (f"sub/{f}", f"sub/{f}", "subdir"),
        (f"sub//{f}", f"sub/{f}", "double-slash"), (f"sub/./{f}", f"sub/{f}", "sub-dot"),
        (f"sub/../{f}", f, "dot-dot"), (f"/abs/{f}", None, "absolute"),
        (f"sub\\{f}", f"sub\\{f}", "backslash"),
        (f"x\\..\\{f}", f"x\\..\\{f}", "backslash-dot-dot"),
        (f"{f} ", None, "trailing-space"), (f"\u00dfub {f}", f"\u00dfub {f}", "unicode-space"),
        ("", None, "empty"), (f"{f}/", None, "trailing-slash"), (f"../{f}", None, "parent"),
    ]


def craft_index(rng: random.Random, directory: Path, tags: list[str]) -> str:
    """A shard index of 1 to 3 shards (safetensors or torch files, paths spelled oddly, some
    listed under two spellings, some tensors missing or extra) and its path."""
    weight_map: list[tuple[str, str]] = []
    for s in range(rng.randint(1, 3)):
        spelling, real, tag = rng.choice(shard_spellings(f"shard-{s}"))
        tags.append(f"index-path-{tag}")
        state = {f"s{s}.{name}": t for name, t in agree_state(rng).items()}
        if not state and rng.random() < 0.9:
            state[f"s{s}.w"] = random_packed_tensor(rng, rng.choice(ST_DTYPES), [3])
        if real is not None:
            where = directory / real
            where.parent.mkdir(parents=True, exist_ok=True)
            fmt = rng.choice(["safetensors", "torch"])
            tensortier.save(state, str(where), format=fmt, checksum=rng.random() < 0.9)
        names = list(state)
        if names and rng.random() < 0.15:
            tags.append("index-extra-tensor")
            names.pop()
        if rng.random() < 0.1:
            tags.append("index-missing-tensor")
            names.append(f"s{s}.absent")
        if len(names) >= 2 and rng.random() < 0.2:  # the same file under another spelling
            tags.append("index-two-spellings")
            weight_map.append((names.pop(), f"./{spelling}"))
        weight_map += [(n, spelling) for n in names]
    if rng.random() < 0.05:
        tags.append("index-duplicate-tensor")
        weight_map += weight_map[:1]
    if rng.random() < 0.05:
        tags.append("index-empty")
        weight_map = []
    members = [f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
               for k, v in weight_map]
    top = [f'"weight_map": {{{", ".join(members)}}}']
    if rng.random() < 0.3:
        top.insert(0, '"metadata": {"total_size": 1}')
    if rng.random() < 0.05:
        tags.append("index-duplicate-key")
        top.insert(0, '"metadata": {"total_size": 2}')
    text = rng.choice(["", " ", "\n"]) + "{" + ", ".join(top) + "}"
    if rng.random() < 0.05:
        tags.append("index-trailing-garbage")
        text += " x"
    suffix = rng.choice([".index.json", ".index.json", ".json", ".INDEX.JSON"])
    tags.append(f"index-suffix{suffix}")
    path = directory / f"model{suffix}"
    path.write_text(text, encoding="utf-8")
    return str(path)


def flat_tensors(obj: Any) -> dict[str, torch.Tensor] | None:
    """A loaded checkpoint as name -> tensor (None if it is not a flat dict of tensors)."""
    if isinstance(obj, dict) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    ):
        return dict(obj)
    return None


def format_save_writes(path: str) -> str | None:
    """The format tensortier.save writes to a file named `path` where its suffix names one
    ("safetensors", "torch"), found by saving {} there (then removed); None where the suffix
    names none (save then writes a torch file, as torch.save writes any name, and convert may
    write either)."""
    if tensortier._core.format_of_suffix(path) is None:
        return None
    tensortier.save({}, path)
    try:
        return "torch" if Path(path).read_bytes()[:4] == b"PK\x03\x04" else "safetensors"
    finally:
        os.unlink(path)


def cli_outcome(p: subprocess.CompletedProcess[str]) -> str:
    """A CLI run's exit and the first line it printed to stderr."""
    line = next((ln for ln in p.stderr.splitlines() if ln.strip()), "")
    return f"exit {p.returncode}: {line[:240]}"


def case_agree(case: Case) -> None:
    """A crafted checkpoint (safetensors with checksum metadata edge cases, torch zip, shard
    index with odd paths; any suffix case; sometimes truncated, flipped or with lying sizes):
    load(verify=True), load, `tensortier verify`, `info` and `convert` must agree."""
    rng = case.rng
    tags: list[str] = []
    kind = rng.choice(["safetensors", "safetensors", "safetensors", "torch", "torch", "index"])
    if kind == "index":
        path = craft_index(rng, case.dir, tags)
    else:
        suffix = rng.choice(INPUT_SUFFIXES)
        tags.append(f"suffix{suffix or '-none'}")
        path = case.path(f"model{suffix}")
        staged = case.path("staged." + ("safetensors" if kind == "safetensors" else "pt"))
        (craft_safetensors if kind == "safetensors" else craft_torch)(rng, staged, tags)
        os.replace(staged, path)
        if rng.random() < 0.25:
            damage(rng, path, tags)
    label = " ".join(f"[{t}]" for t in tags)
    if case.verbose:
        print("crafted:", path, label)

    def check(name: str, fn: Callable[[], None]) -> None:
        def tagged() -> None:
            try:
                fn()
            except Mismatch as e:
                raise Mismatch(f"{e} {label}") from e

        case.run_check(name, tagged)

    plain, plain_error = attempt(lambda: tensortier.load(path))
    verified, verify_error = attempt(lambda: tensortier.load(path, verify=True))
    info = case.cli("info", path)
    verify = case.cli("verify", path)

    def errors_are_refusals() -> None:
        for what, e in (("load", plain_error), ("load(verify=True)", verify_error)):
            if e is not None and not isinstance(e, (OSError, ValueError)):
                raise Mismatch(f"{what} raised {describe(e)} (not OSError/ValueError)")
        for what, p in (("info", info), ("verify", verify)):
            if p.returncode not in (0, 1):
                raise Mismatch(f"`tensortier {what}` {cli_outcome(p)} (a crash, not a refusal)")

    def verify_agrees() -> None:
        if (verify_error is None) != (verify.returncode == 0):
            said = "accepted" if verify_error is None else f"refused ({describe(verify_error)})"
            cli_said = "accepted" if verify.returncode == 0 else f"refused ({cli_outcome(verify)})"
            raise Mismatch(f"load(verify=True) {said}, `tensortier verify` {cli_said}")

    def info_agrees() -> None:
        if (plain_error is None) != (info.returncode == 0):
            said = "accepted" if plain_error is None else f"refused ({describe(plain_error)})"
            cli_said = "accepted" if info.returncode == 0 else f"refused ({cli_outcome(info)})"
            raise Mismatch(f"load {said}, `tensortier info` {cli_said}")
        if plain_error is None and kind != "index":
            flat = flat_tensors(plain)
            shown = [int(ln.split()[1]) for ln in info.stdout.splitlines()
                     if ln.startswith("tensors:")]
            if flat is not None and shown != [len(flat)]:
                raise Mismatch(f"`tensortier info` shows tensors: {shown}, load gives {len(flat)}")
        if plain_error is None and kind == "index":
            # An index's tensors are its weight_map's names, for load as for info.
            listed = re.findall(r"^index: .* shards?, (\d+) tensors?\)$", info.stdout, re.M)
            if listed != [str(len(plain))]:
                raise Mismatch(f"`tensortier info` shows an index of {listed} tensors, load "
                               f"gives {len(plain)}")

    def loads_agree() -> None:
        if verify_error is None and plain_error is not None:
            raise Mismatch(f"load(verify=True) accepted, load refused ({describe(plain_error)})")
        if verify_error is None and plain_error is None:
            compare_state_dicts(plain, verified, "load(verify=True) against load")

    check("agree.refusals", errors_are_refusals)
    check("agree.verify", verify_agrees)
    check("agree.info", info_agrees)
    check("agree.loads", loads_agree)
    if kind == "index":
        return  # convert converts one file: it refuses an index, by design

    def convert_agrees() -> None:
        out_suffix = rng.choice(OUTPUT_SUFFIXES)
        out = case.path(f"converted{out_suffix}")
        is_zip = Path(path).read_bytes()[:4] == b"PK\x03\x04"
        writes = "safetensors" if is_zip else "torch"
        named = format_save_writes(case.path(f"probe{out_suffix}"))
        p = case.cli("convert", path, out)
        where = f"`tensortier convert {os.path.basename(path)} {os.path.basename(out)}`"
        if p.returncode not in (0, 1):
            raise Mismatch(f"{where} {cli_outcome(p)} (a crash, not a refusal)")
        if p.returncode != 0:
            left = sorted(n for n in os.listdir(case.dir) if n.startswith(".converted"))
            if os.path.exists(out) or left:
                raise Mismatch(f"{where} refused but left {[os.path.basename(out), *left]}")
        if named is not None and named != writes:
            if p.returncode == 0:
                raise Mismatch(f"{where} wrote {writes} to a name tensortier.save reads as "
                               f"{named} [out-suffix{out_suffix}]")
            return
        if p.returncode != 0:
            if verify_error is None:
                raise Mismatch(f"load(verify=True) accepted, {where} refused ({cli_outcome(p)})")
            return
        if plain_error is not None:
            raise Mismatch(f"load refused ({describe(plain_error)}), {where} accepted")
        want = flat_tensors(plain)
        if want is None:
            raise Mismatch(f"{where} accepted what load reads as {sketch(plain)[:200]}")
        got, error = attempt(lambda: tensortier.load(out, verify=True))
        if error is not None:
            raise Mismatch(f"convert's output: load(verify=True) refused ({describe(error)})")
        compare_state_dicts(want, got, "load(verify=True) of convert's output against load")

    check("agree.convert", convert_agrees)


CASES: dict[str, Callable[[Case], None]] = {
    "torch": case_torch,
    "st": case_st,
    "cli": case_cli,
    "craft": case_craft,
    "agree": case_agree,
}

# ---------------------------------------------------------------------------- driver


@dataclass
class ModeResult:
    """What running the cases of one mode found."""

    cases: int = 0
    checks: collections.Counter[str] = field(default_factory=collections.Counter)
    new: list[Finding] = field(default_factory=list)
    known: collections.Counter[str] = field(default_factory=collections.Counter)
    seconds: float = 0.0


def shown_path(path: str) -> str:
    """`path` relative to the working directory where it is inside it (shorter commands)."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def reproduce_command(mode: str, seed: int, index: int) -> str:
    """The command that runs one case again, verbosely."""
    return shlex.join([shown_path(sys.executable), shown_path(os.path.abspath(__file__)),
                       mode, str(seed), "--case", str(index)])


def run_mode(mode: str, seed: int, indices: Iterable[int], *, work_dir: Path, cli_path: Path,
             verbose: bool, stop: bool, findings_file: TextIO | None) -> ModeResult:
    """Runs the cases `indices` of (mode, seed), printing each new finding as it comes."""
    result = ModeResult()
    start = time.monotonic()
    for index in indices:
        case = Case(mode, seed, index, work_dir, cli_path, verbose)
        try:
            CASES[mode](case)
        except Exception as e:  # noqa: BLE001 - the harness itself broke: report, go on
            case.find("harness", describe(e) + "\n" + traceback.format_exc()[-1500:])
        finally:
            shutil.rmtree(case.dir, ignore_errors=True)
        result.cases += 1
        result.checks.update(case.checks)
        for finding in case.findings:
            if findings_file is not None:
                findings_file.write(json.dumps(asdict(finding)) + "\n")
                findings_file.flush()
            if finding.known_gap is not None:
                result.known[finding.known_gap] += 1
                continue
            result.new.append(finding)
            if not verbose:
                print(f"FINDING {mode} seed={seed} case={index} [{finding.check}] "
                      f"{finding.message}\n  reproduce: {reproduce_command(mode, seed, index)}",
                      flush=True)
        if stop and result.new:
            break
    result.seconds = time.monotonic() - start
    return result


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Differential fuzzing of tensortier checkpoints against torch and "
        "safetensors (see the module docstring).")
    parser.add_argument("mode", help=f"{', '.join(MODES)}, several of them comma-separated, "
                        "or all")
    parser.add_argument("seed", type=int)
    parser.add_argument("cases", type=int, nargs="?", help="cases per mode (not with --case)")
    parser.add_argument("--case", type=int, help="run only this case, verbosely")
    parser.add_argument("--stop", action="store_true", help="stop a mode at its first finding")
    parser.add_argument("--findings", type=Path,
                        help="also append every finding, known gaps included, to this JSONL file")
    args = parser.parse_args(argv)
    args.modes = MODES if args.mode == "all" else tuple(args.mode.split(","))
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"no mode {', '.join(unknown)} (modes: {', '.join(MODES)}, or all)")
    if (args.cases is None) == (args.case is None):
        parser.error("give either N (cases per mode) or --case I")
    if args.case is not None and len(args.modes) != 1:
        parser.error("--case needs one MODE")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the fuzzer; returns the exit status (1 on a finding not in KNOWN_GAPS)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cli_path = find_cli()
    modes = args.modes
    verbose = args.case is not None
    indices = [args.case] if verbose else range(args.cases)
    work_dir = Path(tempfile.mkdtemp(prefix="tensortier-difffuzz-"))
    new = 0
    known: collections.Counter[str] = collections.Counter()
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, work_dir, ignore_errors=True)
        findings_file = cleanup.enter_context(open(args.findings, "a")) if args.findings else None
        for mode in modes:
            result = run_mode(mode, args.seed, indices, work_dir=work_dir, cli_path=cli_path,
                              verbose=verbose, stop=args.stop, findings_file=findings_file)
            new += len(result.new)
            known.update(result.known)
            print(f"{mode} seed={args.seed}: {result.cases} cases, "
                  f"{sum(result.checks.values())} checks, {len(result.new)} new findings, "
                  f"{sum(result.known.values())} known gaps ({result.seconds:.1f} s)", flush=True)
            if verbose:
                print("checks:", dict(result.checks))
    if known:
        print("known gaps hit: " + ", ".join(f"{k} {n}" for k, n in sorted(known.items())))
    if new:
        print(f"{new} findings not in KNOWN_GAPS (tests/differential/checkpoint_fuzz.py): "
              "rerun each with its command above", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
