"""Objects that own files or descriptors: a copy would share them, and dropping the copy would
close them under the original."""

from __future__ import annotations

from typing import Any, NoReturn


class NotCopyable:
    """Refuses ``copy.copy``, ``copy.deepcopy`` and pickling with ``TypeError``, as the
    pybind11 objects of the libraries these classes stand in for do."""

    _owned = "its files"  # what the message says the object owns

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError(f"{type(self).__name__} cannot be pickled or copied: it owns "
                        f"{self._owned}; make another one")

    def __copy__(self) -> NoReturn:
        self.__reduce_ex__(2)

    def __deepcopy__(self, memo: Any) -> NoReturn:
        self.__reduce_ex__(2)
