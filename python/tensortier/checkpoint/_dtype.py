"""The dtype a load converts to: the argument checked, and floating-point tensors converted
(in place through containers, so each original can go once converted)."""

from __future__ import annotations

from typing import Any

from ._format import _require, _torch


def _target_dtype(dtype: Any) -> Any:
    if dtype is not None:
        is_dtype = isinstance(dtype, _torch().dtype)
        _require("check_load_dtype")(dtype, is_dtype, is_dtype and dtype.is_floating_point)
    return dtype


def _convert(t: Any, dtype: Any) -> Any:
    """`t` in `dtype` when both are floating point; otherwise `t` unchanged. A Parameter stays
    one, and a tensor that requires grad stays a leaf (no autograd history from `.to`)."""
    if dtype is None or t.dtype == dtype:
        return t
    if not t.is_floating_point() or not dtype.is_floating_point:
        return t
    torch = _torch()
    with torch.no_grad():
        out = t.to(dtype)
    if isinstance(t, torch.nn.Parameter):
        out = torch.nn.Parameter(out, requires_grad=t.requires_grad)
    else:
        out.requires_grad_(t.requires_grad)
    if getattr(t, "__dict__", None):  # Python attributes a file gave it, as torch.load keeps
        out.__dict__.update(t.__dict__)
    return out


def _converts(saved: Any, dtype: Any) -> bool:
    """Whether ``_convert`` changes a tensor saved in `saved` into `dtype`."""
    return saved != dtype and saved.is_floating_point and dtype.is_floating_point


def _convert_in_place(obj: Any, dtype: Any) -> Any:
    """`obj` with every tensor inside dicts, lists and tuples converted by ``_convert``, dicts
    and lists in place so that each original can go once converted (memory for one converted
    tensor more, not a second copy of all). A tensor or container met twice stays one object."""
    torch = _torch()
    converted: dict[int, Any] = {}  # id(original) -> converted, for tensors met again
    done: set[int] = set()  # containers already converted

    def visit(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            out = converted.get(id(o))
            if out is None:
                out = _convert(o, dtype)
                if out is not o:
                    converted[id(o)] = out
            return out
        if id(o) in done:
            return o
        if isinstance(o, dict):
            done.add(id(o))
            for k in list(o):
                o[k] = visit(o[k])
        elif isinstance(o, list):
            done.add(id(o))
            for i, v in enumerate(o):
                o[i] = visit(v)
        elif isinstance(o, tuple) and not hasattr(o, "_fields"):
            items = [visit(v) for v in o]
            if all(new is old for new, old in zip(items, o)):
                return o  # nothing converted: torch.Size and other tuple types kept as they are
            return type(o)(items) if type(o) is not tuple else tuple(items)
        return o

    return visit(obj)
