"""``DaliSource``: a ``FileReader`` as the source of DALI's ``fn.external_source``."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .reader import FileReader


class DaliSource:
    """Feeds ``fn.external_source(source=reader.dali_source(), num_outputs=2, batch=True,
    dtype=[types.UINT8, types.INT32])``: each batch is a DALI ``TensorListCPU`` of uint8
    samples (one per file) and one of int32 labels of shape (1,), as ``fn.readers.file`` gives
    them.

    An iterator that rewinds itself: the call after the one that raised ``StopIteration`` (the
    end of an epoch) starts the reader's next epoch. With DALI's default ``cycle="no"`` the
    source is iterated once and never rewound by DALI, so each ``pipe.reset()`` reads the next
    epoch; ``cycle="quiet"`` or ``"raise"`` work too.

    The samples wrap the batch arenas in place (``TensorCPU`` views made from DLPack capsules,
    gathered without a copy): handed a list of arrays, ``external_source`` inspects and converts
    each in Python, which cost more than reading the files when they are cached. DALI copies the
    batch unless ``no_copy=True``; then the arenas must live until DALI has used them: each
    sample holds its batch's arena until DALI frees it, and this source keeps the last
    ``queue_depth + 2`` batches' labels alive, so pass at least the pipeline's
    ``prefetch_queue_depth`` as ``queue_depth``. With ``no_copy=True`` nothing is copied on the
    way in; DALI copies a CPU pipeline's outputs into its own buffers, so pass the samples on to
    an operator (a decoder) rather than returning them from the pipeline.

    Not for ``parallel=True``, which pickles the source into DALI's worker processes: that is
    refused with a ``TypeError`` (the reader reads ahead on its own threads already).

    DALI asks for batches ahead of the outputs it returns (its prefetch queue): the reader's
    ``state_dict()`` counts the batches handed to DALI, not those the pipeline has returned.
    Load a state into the reader before the pipeline first runs (before a DALI iterator is made:
    it runs the pipeline at once); loaded later, the source goes on from the state, after the
    batches DALI has already asked for.
    """

    def __init__(self, reader: FileReader, queue_depth: int = 2) -> None:
        if not isinstance(queue_depth, int) or queue_depth < 1:
            raise ValueError(f"queue_depth must be a positive integer, not {queue_depth!r}")
        from nvidia.dali import tensors  # DALI is needed only by this adapter

        self._tensors = tensors
        self._reader = reader
        self._batches = reader._state.iterate(reader._core, rewinds=True)
        self._kept: collections.deque[Any] = collections.deque(maxlen=queue_depth + 2)

    def __reduce__(self) -> Any:
        raise TypeError(
            "a FileReader's dali_source() cannot be pickled into DALI's worker processes: "
            "use it with external_source's parallel=False (the default); the reader already "
            "reads ahead on its own threads (prefetch=)")

    def __iter__(self) -> DaliSource:
        return self

    def __next__(self) -> tuple[Any, Any]:
        batch = next(self._batches)
        labels = self._reader.batch_labels(batch).reshape(-1, 1)
        while labels.size == 0:  # every file skipped (on_error="skip"): DALI takes no empty batch
            batch = next(self._batches)
            labels = self._reader.batch_labels(batch).reshape(-1, 1)
        self._kept.append((batch, labels))
        wrap = self._tensors.TensorCPU
        samples = self._tensors.TensorListCPU([wrap(c) for c in batch.dlpack_samples()],
                                              contiguous=False)
        return samples, self._tensors.TensorListCPU(labels)
