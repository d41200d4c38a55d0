"""Notes on exceptions (PEP 678) where Python has them, and a warning where it does not."""

from __future__ import annotations

import warnings


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` on Python 3.11+. Python 3.10 neither has it nor prints
    ``__notes__``: the note is kept there for code that reads it, and warned too, so that it is
    not lost."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
        return
    notes = getattr(exc, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
        exc.__notes__ = notes  # type: ignore[attr-defined]
    notes.append(note)
    warnings.warn(f"{type(exc).__name__}: {note}", RuntimeWarning, stacklevel=3)
