"""tensortier.data.FileReader on real file trees: bytes, labels, shards, shuffles, resume,
errors; FileDataset in a DataLoader with workers."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tensortier
from tensortier import _core
from tensortier.data import FileDataset, FileReader

from conftest import exits_cleanly
from faults import with_faults

# Around page and O_DIRECT boundaries.
SIZES = [1, 511, 4095, 4096, 4097, 8192, 12289, 70001, 131072, 200003]


def make_tree(root: Path, classes: int = 4, per_class: int = 7, empty: bool = False,
              seed: int = 0) -> dict[str, tuple[bytes, int]]:
    """A folder per class of files with unique contents; {path: (bytes, label)}."""
    rng = random.Random(seed)
    tree: dict[str, tuple[bytes, int]] = {}
    for label in range(classes):
        d = root / f"class_{label:02d}"
        d.mkdir(parents=True)
        for i in range(per_class):
            size = 0 if empty and i == 0 else rng.choice(SIZES)
            data = f"{label}/{i}|".encode()[:size] + rng.randbytes(max(0, size - 8))
            data = data[:size]
            path = d / f"img_{i:03d}.jpg"
            path.write_bytes(data)
            tree[str(path)] = (data, label)
    return tree


def stream(reader: FileReader, epochs: int) -> list[list[tuple[bytes, int]]]:
    """Every batch of `epochs` epochs as (bytes, label) pairs."""
    out = []
    for _ in range(epochs):
        for samples, labels in reader:
            assert labels.dtype == torch.int32
            assert all(s.dtype == torch.uint8 and s.dim() == 1 for s in samples)
            out.append([(bytes(s.numpy()), int(l)) for s, l in zip(samples, labels)])
    return out


def expected(reader: FileReader, tree: dict[str, tuple[bytes, int]], epoch: int,
             batch_size: int) -> list[list[tuple[bytes, int]]]:
    files = reader.files
    samples = [tree[files[i]] for i in reader.epoch_indices(epoch)]
    return [samples[i:i + batch_size] for i in range(0, len(samples), batch_size)]


def test_reads_every_file_exactly_with_its_label(disk_dir: Path) -> None:
    tree = make_tree(disk_dir, empty=True)
    reader = FileReader(file_root=disk_dir, batch_size=5, shuffle=False)
    batches = stream(reader, 1)
    assert sum(batches, []) == [tree[p] for p in sorted(tree)]
    assert [len(b) for b in batches] == [5] * 5 + [3]
    assert reader.stats["files"] == 28 and reader.stats["skipped"] == 0
    assert reader.epoch == 1


def test_shuffle_is_a_seeded_permutation_per_epoch(disk_dir: Path) -> None:
    tree = make_tree(disk_dir)
    a = FileReader(file_root=disk_dir, batch_size=4, seed=5)
    b = FileReader(file_root=disk_dir, batch_size=4, seed=5)
    ea, eb = stream(a, 3), stream(b, 3)
    assert ea == eb
    per_epoch = [sum(ea[i * 7:(i + 1) * 7], []) for i in range(3)]
    for samples in per_epoch:
        assert sorted(samples) == sorted(tree.values())
    assert per_epoch[0] != per_epoch[1]
    c = FileReader(file_root=disk_dir, batch_size=4, seed=6)
    assert stream(c, 1) != ea[:7]
    assert a.epoch_indices(1) == list(_core.epoch_permutation(28, 5, 1))


@pytest.mark.parametrize("num_shards", [1, 2, 3, 5])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("pad", [False, True])
def test_shards_of_an_epoch_cover_every_file_once(disk_dir: Path, num_shards: int,
                                                  shuffle: bool, pad: bool) -> None:
    tree = make_tree(disk_dir, classes=3, per_class=9)  # 27 files
    for epoch in range(3):
        seen: list[tuple[bytes, int]] = []
        lengths = set()
        for shard in range(num_shards):
            reader = FileReader(file_root=disk_dir, batch_size=4, shuffle=shuffle, seed=1,
                                shard_id=shard, num_shards=num_shards, pad_last_batch=pad)
            reader.set_epoch(epoch)
            batches = stream(reader, 1)
            assert sum(batches, []) == sum(expected(reader, tree, epoch, 4), [])
            samples = sum(batches, [])
            lengths.add(len(batches))
            if pad:
                assert all(len(b) == 4 for b in batches)
                # Padding repeats the shard's last sample.
                real = -(-27 // num_shards)
                assert len(set(samples[real - 1:])) <= 1 or len(samples) == real
            seen.extend(dict.fromkeys(samples))  # padding repeats removed
        assert sorted(seen) == sorted(tree.values()), f"epoch {epoch}"
        if pad:
            assert len(lengths) == 1  # the same number of batches on every shard


def test_copy_and_views(disk_dir: Path) -> None:
    tree = make_tree(disk_dir, classes=1, per_class=6)
    reader = FileReader(file_root=disk_dir, batch_size=3, shuffle=False, copy=True)
    kept = [samples for samples, _ in reader]
    assert [bytes(s.numpy()) for s in sum(kept, [])] == [tree[p][0] for p in sorted(tree)]
    for samples in kept:  # one block of exactly the batch's bytes, not of its arena
        block = samples[0].untyped_storage()
        assert all(s.untyped_storage().data_ptr() == block.data_ptr() for s in samples)
        assert block.nbytes() == sum(s.numel() for s in samples)
    views = FileReader(file_root=disk_dir, batch_size=3, shuffle=False)
    samples, labels = next(iter(views))
    assert bytes(samples[0].numpy()) == tree[sorted(tree)[0]][0]
    assert labels.tolist() == [0, 0, 0]


def test_dlpack_samples_hold_their_arena_until_the_consumer_lets_go(disk_dir: Path) -> None:
    tree = make_tree(disk_dir, classes=2, per_class=8, empty=True)
    reader = FileReader(file_root=disk_dir, batch_size=4, shuffle=False, prefetch=1)
    want = expected(reader, tree, 0, 4)
    batches = reader.batches()
    first = next(batches)
    taken = [torch.from_dlpack(c) for c in first.dlpack_samples()]
    assert all(t.dtype == torch.uint8 and t.dim() == 1 for t in taken)
    # An arena given back would be refilled by the next batches: these tensors keep theirs.
    del first
    rest = [[bytes(memoryview(b)[o:o + n]) for o, n in zip(b.offsets, b.sizes)] for b in batches]
    assert [bytes(t.numpy()) for t in taken] == [data for data, _ in want[0]]
    assert rest == [[data for data, _ in batch] for batch in want[1:]]
    assert b"" in [data for data, _ in want[0]]  # an empty file's sample is an empty tensor
    # Capsules never consumed give their batch back when dropped.
    unused = FileReader(file_root=disk_dir, batch_size=4, shuffle=False)
    for batch in unused.batches():
        capsules = batch.dlpack_samples()
        assert len(capsules) == len(batch.sizes)
        del capsules


def test_drop_last(disk_dir: Path) -> None:
    make_tree(disk_dir, classes=1, per_class=7)
    assert [len(s) for s, _ in FileReader(file_root=disk_dir, batch_size=3, drop_last=True)] == [3, 3]
    assert len(FileReader(file_root=disk_dir, batch_size=3)) == 3


@pytest.mark.parametrize("shuffle", [False, True])
def test_state_dict_resumes_mid_epoch_exactly(disk_dir: Path, shuffle: bool) -> None:
    make_tree(disk_dir, classes=3, per_class=10)  # 30 files: 15 per shard, 4 batches of 4
    args = dict(file_root=disk_dir, batch_size=4, shuffle=shuffle, seed=3, num_shards=2,
                shard_id=1)
    whole = stream(FileReader(**args), 3)
    reader = FileReader(**args)
    got = stream(reader, 1)
    it = iter(reader)
    for _ in range(3):  # into the middle of epoch 1
        samples, labels = next(it)
        got.append([(bytes(s.numpy()), int(l)) for s, l in zip(samples, labels)])
    state = reader.state_dict()
    assert state["epoch"] == 1 and state["position"] == 3
    del it, reader
    resumed = FileReader(**args)
    resumed.load_state_dict(state)
    got.extend(stream(resumed, 2))  # the rest of epoch 1, then epoch 2
    assert got == whole
    other = FileReader(**{**args, "seed": 4})
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="position"):
        resumed.load_state_dict({**state, "position": -1})
    # The usual loop after a resume sets the epoch it resumed at: it goes on from the state
    # (it started that epoch again, and the batches already trained on came again).
    looped = FileReader(**args)
    looped.load_state_dict(state)
    again = []
    for epoch in range(state["epoch"], 3):
        looped.set_epoch(epoch)
        again.extend(stream(looped, 1))
    assert again == whole[len(whole) - len(again):] and len(again) == len(whole) - 4 - 3
    # Once a batch was given out, setting the epoch under no iteration starts it again.
    looped.load_state_dict(state)
    next(iter(looped))
    looped.set_epoch(state["epoch"])
    assert stream(looped, 1) == whole[4:8]


def test_a_state_from_before_shuffle_versions_resumes_the_order_it_started(
        disk_dir: Path) -> None:
    """States carry shuffle_version (2: epochs shuffled independently). One without it was
    taken under version 1's order (consecutive epochs correlated): it resumes that order, and
    the states taken after carry version 1 on; an unknown version is refused."""
    from tensortier import _core

    make_tree(disk_dir, classes=2, per_class=10)
    args = dict(file_root=disk_dir, batch_size=4, seed=0)
    reader = FileReader(**args)
    state = reader.state_dict()
    assert state["shuffle_version"] == 2
    reader.set_epoch(1)
    assert reader.epoch_indices(1) == list(_core.epoch_permutation(20, 0, 1))
    old = {k: v for k, v in state.items() if k != "shuffle_version"} | {"epoch": 1}
    resumed = FileReader(**args)
    resumed.load_state_dict(old)
    assert resumed.state_dict()["shuffle_version"] == 1
    order = [i for batch in resumed.batches() for i in batch.indices]
    assert order == list(_core.epoch_permutation(20, 0, 1, 1))
    assert order != list(_core.epoch_permutation(20, 0, 1))
    with pytest.raises(ValueError, match="shuffle_version=3"):
        FileReader(**args).load_state_dict({**state, "shuffle_version": 3})
    # Pinned: the permutation is part of the format of a resumable run.
    assert list(_core.epoch_permutation(8, 0, 0)) == [1, 2, 6, 5, 4, 0, 3, 7]
    assert list(_core.epoch_permutation(8, 0, 1)) == [7, 3, 1, 0, 4, 6, 2, 5]
    assert list(_core.epoch_permutation(8, 0, 0, 1)) == [2, 7, 4, 1, 6, 5, 0, 3]


def test_close_from_another_thread_while_epochs_start(disk_dir: Path) -> None:
    """close() (a watchdog's, a shutdown hook's) while another thread starts epoch after
    epoch, and two threads looping one reader: loops end or go on, the process lives."""
    import threading

    make_tree(disk_dir, classes=2, per_class=6)
    reader = FileReader(file_root=disk_dir, batch_size=2)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            for _ in reader:
                pass

    threads = [threading.Thread(target=loop) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(2000):
            reader.close()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    reader.set_epoch(100)
    assert len(stream(reader, 1)) == 6  # and it still reads


def test_a_daemon_thread_reading_at_exit_does_not_abort_the_process(disk_dir: Path) -> None:
    """A daemon thread feeding batches (a background prefetch) while the main thread exits:
    Python ends it as it comes back from a blocking call, which used to abort the process
    (std::terminate from the GIL's re-acquisition in a noexcept destructor)."""
    make_tree(disk_dir, classes=2, per_class=200)
    script = ("import sys, threading\n"
              "from tensortier.data import FileReader\n"
              "r = FileReader(file_root=sys.argv[1], batch_size=16, prefetch=4)\n"
              "started = threading.Event()\n"
              "def feed():\n"
              "    while True:\n"
              "        for batch in r.batches():\n"
              "            started.set()\n"
              "threading.Thread(target=feed, daemon=True).start()\n"
              "assert started.wait(60)\n")
    exits_cleanly(script, str(disk_dir), runs=3)


def test_file_list_and_files_inputs(disk_dir: Path) -> None:
    tree = make_tree(disk_dir, classes=2, per_class=3)
    paths = sorted(tree)
    lst = disk_dir / "list.txt"
    lst.write_text("".join(f"{os.path.relpath(p, disk_dir)} {10 + i}\n" for i, p in enumerate(paths)))
    batches = stream(FileReader(file_list=lst, batch_size=10, shuffle=False), 1)
    assert batches == [[(tree[p][0], 10 + i) for i, p in enumerate(paths)]]
    batches = stream(FileReader(files=paths[::-1], batch_size=10, shuffle=False), 1)
    assert batches == [[(tree[p][0], i) for i, p in enumerate(paths[::-1])]]
    rel = [os.path.relpath(p, disk_dir) for p in paths]
    batches = stream(FileReader(file_root=disk_dir, files=rel, labels=[7] * 6, batch_size=10,
                                shuffle=False), 1)
    assert batches == [[(tree[p][0], 7) for p in paths]]


def test_bad_inputs_are_refused_when_made(disk_dir: Path) -> None:
    make_tree(disk_dir, classes=1, per_class=2)
    files = [str(p) for p in sorted(disk_dir.rglob("*.jpg"))]
    with pytest.raises(FileNotFoundError, match="missing.jpg"):
        FileReader(files=files + [str(disk_dir / "missing.jpg")])
    # One path, not a list: refused, not read as a file per letter ("No such file: 't'").
    for one in (files[0], files[0].encode(), Path(files[0])):
        with pytest.raises(TypeError, match=r"files must be a list of paths, not one path"):
            FileReader(files=one)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"pass files=\[path\]"):
            FileDataset(files=one)  # type: ignore[arg-type]
    empty = disk_dir / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no files"):
        FileReader(file_root=empty)
    with pytest.raises(FileNotFoundError):
        FileReader(file_root=disk_dir / "nope")
    with pytest.raises(ValueError, match="not both"):
        FileReader(files=files, file_list=disk_dir / "x")
    with pytest.raises(ValueError, match="labels"):
        FileReader(files=files, labels=[1])
    with pytest.raises(ValueError, match="only with files"):
        FileReader(file_root=disk_dir, labels=[1])
    with pytest.raises(ValueError, match="batch_size"):
        FileReader(files=files, batch_size=0)
    with pytest.raises(ValueError, match="on_error"):
        FileReader(files=files, on_error="ignore")
    with pytest.raises(ValueError, match="shard_id"):
        FileReader(files=files, shard_id=2, num_shards=2)
    with pytest.raises(ValueError, match="fewer than"):
        FileReader(files=files, num_shards=3)
    with pytest.raises(ValueError, match="device"):
        FileReader(files=files, device="meta")
    (disk_dir / "bad.txt").write_text("no_label_here\n")
    with pytest.raises(ValueError, match="line 1"):
        FileReader(file_list=disk_dir / "bad.txt")


def test_vanished_and_non_regular_files(disk_dir: Path) -> None:
    tree = make_tree(disk_dir, classes=1, per_class=6)
    paths = sorted(tree)
    reader = FileReader(files=paths, batch_size=3, shuffle=False)
    os.unlink(paths[4])
    it = iter(reader)
    next(it)
    with pytest.raises(FileNotFoundError, match=paths[4]):
        next(it)
    os.unlink(paths[1])
    os.mkfifo(paths[1])
    kept = [p for p in paths if p != paths[4]]
    skipping = FileReader(files=kept, labels=[0] * len(kept), batch_size=3, shuffle=False,
                          on_error="skip")
    os.mkdir(paths[4])
    got = stream(skipping, 1)
    assert sum(got, []) == [tree[p] for i, p in enumerate(paths) if i not in (1, 4)]
    assert skipping.stats["skipped"] == 1
    raising = FileReader(files=paths, batch_size=6, shuffle=False)
    with pytest.raises(OSError, match="not a regular file"):
        next(iter(raising))


@pytest.mark.parametrize("workers", [0, 2])
def test_dataset_counts_the_files_skipped_in_its_workers(disk_dir: Path, workers: int) -> None:
    """on_error="skip" in DataLoader workers: the files left out are counted where the
    training loop can read them (dataset.skipped), not only in the workers' readers."""
    tree = make_tree(disk_dir, classes=2, per_class=9)
    dataset = FileDataset(file_root=disk_dir, batch_size=4, seed=1, on_error="skip")
    gone = sorted(tree)[::5]  # four files vanish after the list was made
    for path in gone:
        os.unlink(path)
    assert dataset.skipped == 0
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers,
                                         timeout=60 if workers else 0)
    read = sum(len(samples) for samples, _ in loader)
    assert (read, dataset.skipped) == (len(tree) - len(gone), len(gone))
    dataset.set_epoch(1)
    assert sum(len(samples) for samples, _ in loader) == len(tree) - len(gone)
    assert dataset.skipped == 2 * len(gone)  # since the dataset was made


def _add_ones(address: int, times: int) -> None:
    for _ in range(times):
        _core.shared_counter_add(address, 1)


def test_the_skipped_count_is_added_to_by_processes_at_once_without_losing_any() -> None:
    """FileDataset's workers add their skipped files to one int64 in shared memory: processes
    adding at the same instant lose nothing (a plain += on the tensor loses counts)."""
    import multiprocessing

    counter = torch.zeros(2, dtype=torch.int64).share_memory_()
    address, times = counter[1:].data_ptr(), 50_000
    context = multiprocessing.get_context("fork")
    procs = [context.Process(target=_add_ones, args=(address, times)) for _ in range(3)]
    for p in procs:
        p.start()
    try:
        _add_ones(address, times)
    finally:
        for p in procs:
            p.join(120)
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert counter.tolist() == [0, 4 * times]
    assert _core.shared_counter_add(address, -5) == 4 * times - 5
    for bad in (0, address + 1):
        with pytest.raises(ValueError, match="not that of an int64"):
            _core.shared_counter_add(bad, 1)


def test_labels_are_int32_or_the_label_dtype_asked_for(disk_dir: Path) -> None:
    """int32 labels by default (DALI's); label_dtype=torch.int64 gives what torch's losses take
    (F.cross_entropy refuses int32 targets), through FileDataset's workers too."""
    tree = make_tree(disk_dir, classes=3, per_class=4)
    samples, labels = next(iter(FileReader(file_root=disk_dir, batch_size=6)))
    assert labels.dtype == torch.int32
    reader = FileReader(file_root=disk_dir, batch_size=6, shuffle=False, label_dtype=torch.int64)
    got = [(list(s), l) for s, l in reader]
    assert all(l.dtype == torch.int64 for _, l in got)
    assert [int(x) for _, l in got for x in l] == [label for _, label in
                                                   (tree[p] for p in sorted(tree))]
    torch.nn.functional.cross_entropy(torch.zeros(6, 3), got[0][1])
    dataset = FileDataset(file_root=disk_dir, batch_size=6, label_dtype=torch.int64)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1, timeout=60)
    assert {l.dtype for _, l in loader} == {torch.int64}
    with pytest.raises(ValueError, match="label_dtype must be torch.int32 or torch.int64"):
        FileReader(file_root=disk_dir, label_dtype=torch.float32)
    with pytest.raises(TypeError, match="label_dtype must be a torch.dtype, not str"):
        FileDataset(file_root=disk_dir, label_dtype="int64")


def test_dataset_in_a_dataloader_with_two_workers(disk_dir: Path) -> None:
    tree = make_tree(disk_dir, classes=3, per_class=8)
    dataset = FileDataset(file_root=disk_dir, batch_size=5, seed=2)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, timeout=60)
    for epoch in range(2):
        dataset.set_epoch(epoch)
        seen = []
        for samples, labels in loader:
            seen.extend((bytes(s.numpy()), int(l)) for s, l in zip(samples, labels))
        assert sorted(seen) == sorted(tree.values())
    # In the main process: one shard, the whole set.
    assert sorted(sum(stream_dataset(dataset), [])) == sorted(tree.values())


def test_dataset_split_given_as_rank_and_world_size(disk_dir: Path) -> None:
    """rank=/world_size= replace torch.distributed's for the split (DistributedSampler's
    num_replicas=/rank=): the data-parallel rank, or every file in one process."""
    tree = make_tree(disk_dir, classes=2, per_class=5)
    halves = [sum(stream_dataset(FileDataset(file_root=disk_dir, batch_size=3, seed=1, rank=r,
                                             world_size=2)), []) for r in (0, 1)]
    assert len(halves[0]) == len(halves[1]) == 5
    assert sorted(halves[0] + halves[1]) == sorted(tree.values())
    whole = FileDataset(file_root=disk_dir, batch_size=3, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(whole, batch_size=None, num_workers=2, timeout=60)
    seen = [(bytes(s.numpy()), int(l)) for samples, labels in loader
            for s, l in zip(samples, labels)]
    assert sorted(seen) == sorted(tree.values())


def test_dataset_settings_are_checked_when_it_is_made(disk_dir: Path) -> None:
    """Not in each DataLoader worker at its first batch."""
    make_tree(disk_dir, classes=1, per_class=4)
    for bad, error, match in (
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"prefetch": -1}, ValueError, "prefetch"),
        ({"shufle": True}, TypeError, "unexpected keyword argument 'shufle'"),
        ({"num_shards": 2}, TypeError, "rank= and world_size="),
        ({"check_files": False}, TypeError, "unexpected keyword argument 'check_files'"),
        ({"rank": 2, "world_size": 2}, ValueError, "rank 2 is out of range"),
        ({"rank": 0}, ValueError, "both rank= and world_size="),
        ({"on_error": "ignore"}, ValueError, "on_error"),
        ({"device": "meta"}, ValueError, "device must be 'cpu' or 'cuda'"),
        ({"backend": "bogus"}, ValueError, "backend: 'bogus' is not one of"),
        ({"extent_map": disk_dir / "missing.json"}, FileNotFoundError, "missing.json"),
        ({"pin_memory": "x"}, TypeError, "pin_memory must be True or False, not 'x'"),
        ({"direct": "x"}, TypeError, "direct must be True or False"),
        ({"drop_last": "False"}, TypeError, "drop_last must be True or False, not 'False'"),
        ({"case_sensitive_filter": "no"}, TypeError, "case_sensitive_filter must be True or"),
    ):
        with pytest.raises(error, match=match):
            FileDataset(file_root=disk_dir, **bad)


def test_reader_flags_are_true_or_false_not_strings(disk_dir: Path) -> None:
    """A flag from a config file or the command line ("False") was true: drop_last="False"
    dropped the last batch, shuffle="False" shuffled. Each flag takes bools, 0, 1 and numpy's
    bools; anything else is a TypeError naming it, as DALI refuses strings for its flags."""
    make_tree(disk_dir, classes=1, per_class=5)
    for name in ("shuffle", "stick_to_shard", "pad_last_batch", "drop_last", "pin_memory",
                 "extent_checksums", "case_sensitive_filter", "copy", "direct", "check_files"):
        with pytest.raises(TypeError, match=f"{name} must be True or False, not 'False'"):
            FileReader(file_root=disk_dir, batch_size=2, **{name: "False"})
    reader = FileReader(file_root=disk_dir, batch_size=2, shuffle=np.bool_(False), drop_last=0)
    assert [len(samples) for samples, _ in reader] == [2, 2, 1]
    # None (a config's null) is the default, as DALI takes it: here drop_last=False.
    reader = FileReader(file_root=disk_dir, batch_size=2, shuffle=False, drop_last=None)
    assert [len(samples) for samples, _ in reader] == [2, 2, 1]
    dataset = FileDataset(file_root=disk_dir, batch_size=2, shuffle=None, copy=None)
    assert dataset._options["shuffle"] is True and dataset._options["copy"] is True
    with pytest.raises(TypeError, match="backend must be a str, not int"):
        FileReader(file_root=disk_dir, batch_size=2, backend=1)


def test_more_workers_than_files_read_every_file_once(disk_dir: Path) -> None:
    """A small validation set on many workers: the workers past the last file yield nothing,
    as an IterableDataset may, instead of each raising that there are fewer files than
    shards."""
    tree = make_tree(disk_dir, classes=1, per_class=3)
    dataset = FileDataset(file_root=disk_dir, batch_size=2, shuffle=False)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=4, timeout=60)
    seen = [(bytes(s.numpy()), int(l)) for samples, labels in loader
            for s, l in zip(samples, labels)]
    assert sorted(seen) == sorted(tree.values())


def test_padded_batches_are_as_many_on_every_rank_with_more_workers_than_files(
        disk_dir: Path) -> None:
    """pad_last_batch (every step a collective: DDP) with more ranks x workers than files: the
    workers past the last file read the first files again, as DistributedSampler pads, so that
    every rank gets as many batches (rank 1 got fewer, and rank 0 waited in its last
    all-reduce forever). Without padding they yield nothing."""
    make_tree(disk_dir, classes=1, per_class=3)
    counts = {}
    for pad in (True, False):
        counts[pad] = []
        for rank in (0, 1):
            dataset = FileDataset(file_root=disk_dir, batch_size=2, shuffle=False,
                                  pad_last_batch=pad, rank=rank, world_size=2)
            loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2,
                                                 timeout=60)
            counts[pad].append(sum(1 for _ in loader))
    assert counts[True] == [2, 2] and counts[False] == [2, 1], counts


def test_a_state_loaded_before_the_workers_resumes_one_epoch_only(disk_dir: Path) -> None:
    """load_state_dict() in the training process, then a DataLoader whose worker is made again
    each epoch: the state's epoch resumes, and the later epochs read whole (each new worker got
    the state again and replayed that epoch's tail every epoch). state_dict() in that process
    says the states are in the workers (it returned {}: "nothing read")."""
    make_tree(disk_dir, classes=3, per_class=8)
    first = FileDataset(file_root=disk_dir, batch_size=4, seed=7)
    it = iter(first)
    next(it), next(it)
    state = first.state_dict()
    it.close()
    dataset = FileDataset(file_root=disk_dir, batch_size=4, seed=7)
    dataset.load_state_dict(state)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1, timeout=60)
    lengths = []
    for epoch in range(3):
        dataset.set_epoch(epoch)
        lengths.append(sum(1 for _ in loader))
    assert lengths == [4, 6, 6]
    with pytest.raises(RuntimeError, match="runs in DataLoader workers"):
        dataset.state_dict()


def _load_worker_state(worker: int) -> None:
    """worker_init_fn: what torchdata's StatefulDataLoader does in each worker."""
    info = torch.utils.data.get_worker_info()
    info.dataset.load_state_dict(info.dataset.worker_states[worker])


def test_states_loaded_in_each_worker_all_resume(disk_dir: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """torchdata's StatefulDataLoader protocol: each worker loads its own state and takes its own
    state_dict(). Every worker resumes (not one of them only), and state_dict() in a worker
    answers."""
    make_tree(disk_dir, classes=3, per_class=8)
    states = []
    for worker in range(2):  # what each of two workers' readers had given out: 1 batch
        reader = FileReader(file_root=disk_dir, batch_size=3, seed=5, shard_id=worker,
                            num_shards=2)
        it = iter(reader)
        next(it)
        states.append(reader.state_dict())
        it.close()
    dataset = FileDataset(file_root=disk_dir, batch_size=3, seed=5)
    dataset.worker_states = states  # type: ignore[attr-defined]
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, timeout=60,
                                         worker_init_fn=_load_worker_state)
    assert sum(1 for _ in loader) == 2 * (4 - 1)  # 12 files per worker: 4 batches, 1 read
    # state_dict() where a worker calls it: its reader's state, not an error.
    inside = FileDataset(file_root=disk_dir, batch_size=3, seed=5)
    monkeypatch.setattr(torch.utils.data, "get_worker_info",
                        lambda: type("Info", (), {"id": 1, "num_workers": 2})())
    it = iter(inside)
    next(it)
    assert (inside.state_dict()["shard_id"], inside.state_dict()["position"]) == (1, 1)
    it.close()


def test_drop_last_that_empties_a_workers_epoch_warns(disk_dir: Path) -> None:
    """Each worker forms its own batches: drop_last with few files per worker can leave an epoch
    with nothing, which used to pass in silence."""
    make_tree(disk_dir, classes=1, per_class=4)
    dataset = FileDataset(file_root=disk_dir, batch_size=3, drop_last=True, rank=0,
                          world_size=2)
    with pytest.warns(RuntimeWarning, match="drop_last drops every file of shard 0 of 2"):
        assert list(dataset) == []


def test_dataset_resumes_mid_epoch_from_its_state(disk_dir: Path) -> None:
    """state_dict() taken after k batches (what torchdata's StatefulDataLoader takes in each
    worker); a new dataset given it by load_state_dict() yields the rest of that epoch; a state
    of other settings is refused when the iteration starts."""
    make_tree(disk_dir, classes=3, per_class=8)

    def batches(it: Any, n: int | None = None) -> list[list[bytes]]:
        out = []
        for samples, _ in it:
            out.append([bytes(x.numpy()) for x in samples])
            if n is not None and len(out) == n:
                break
        return out

    whole = FileDataset(file_root=disk_dir, batch_size=5, seed=4)
    whole.set_epoch(3)
    want = batches(whole)
    dataset = FileDataset(file_root=disk_dir, batch_size=5, seed=4)
    assert dataset.state_dict() == {}  # nothing given out yet: from the start
    dataset.load_state_dict({})
    dataset.set_epoch(3)
    it = iter(dataset)
    assert batches(it, 2) == want[:2]
    state = dataset.state_dict()
    resumed = FileDataset(file_root=disk_dir, batch_size=5, seed=4)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # not begun yet: the state it will resume
    assert batches(resumed) == want[2:]
    other = FileDataset(file_root=disk_dir, batch_size=4, seed=4)
    other.load_state_dict(state)
    with pytest.raises(ValueError):
        batches(other)
    with pytest.raises(TypeError, match="state_dict"):
        other.load_state_dict([1, 2])  # type: ignore[arg-type]


def sorted_batches(batches: Any) -> list[tuple[tuple[bytes, int], ...]]:
    return sorted(tuple((bytes(s.numpy()), int(l)) for s, l in zip(samples, labels))
                  for samples, labels in batches)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_set_epoch_reaches_persistent_workers(disk_dir: Path, context: str) -> None:
    """Persistent workers hold their own copy of the dataset: the epoch set in the main process
    after they started (a resume, epochs skipped or repeated) must still be the one they read,
    or ranks whose workers counted differently would read overlapping shards."""
    make_tree(disk_dir, classes=3, per_class=9)
    dataset = FileDataset(file_root=disk_dir, batch_size=4, seed=3)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2,
                                         persistent_workers=True,
                                         multiprocessing_context=context, timeout=60)
    for epoch in (0, 5, 5, 2):
        dataset.set_epoch(epoch)
        want = []
        for worker in range(2):
            reader = FileReader(file_root=disk_dir, batch_size=4, seed=3, shard_id=worker,
                                num_shards=2)
            reader.set_epoch(epoch)
            want += sorted_batches(reader)
        assert sorted_batches(loader) == sorted(want), f"epoch {epoch}"


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_ranks_and_workers_under_torchrun_read_every_file_once(disk_dir: Path,
                                                               context: str) -> None:
    """Two ranks of two DataLoader workers each: every file once per epoch. A worker started by
    spawn or forkserver has no process group of its own: it must still read its rank's part."""
    tree = make_tree(disk_dir / "data", classes=3, per_class=7)
    out = disk_dir / "out"
    out.mkdir()
    epochs = 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__).with_name("data_worker.py")), str(disk_dir / "data"), str(out), "2",
           context, str(epochs)]
    (disk_dir / "tmp").mkdir()  # torchrun's agent leaves its logs there: removed with disk_dir
    env = dict(os.environ, TMPDIR=str(disk_dir / "tmp"))
    proc = subprocess.Popen(cmd, cwd=disk_dir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:  # timed out, or the test was interrupted: no rank left behind
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 0, output[-3000:]
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    everything = sorted(data.hex() for data, _ in tree.values())
    for epoch in range(epochs):
        assert sorted(ranks[0][epoch] + ranks[1][epoch]) == everything, f"epoch {epoch}"


class ReaderDataset(torch.utils.data.IterableDataset):
    """A training script's own dataset around a reader made before the DataLoader's workers."""

    def __init__(self, reader: FileReader) -> None:
        self.reader = reader

    def __iter__(self) -> Any:
        return iter(self.reader)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_reader_made_before_the_workers_is_refused_in_them_by_name(disk_dir: Path,
                                                                    context: str) -> None:
    """A forked worker's copy of the reader has none of its threads (reading from it hung until
    the DataLoader's timeout); a spawned worker cannot be sent it. Both say what to do."""
    make_tree(disk_dir, classes=2, per_class=4)
    reader = FileReader(file_root=disk_dir, batch_size=3)
    next(iter(reader))  # reading ahead in this process
    loader = torch.utils.data.DataLoader(ReaderDataset(reader), batch_size=None, num_workers=1,
                                         multiprocessing_context=context, timeout=120)
    error = RuntimeError if context == "fork" else TypeError
    with pytest.raises(error, match="make the reader in the process that reads|make it in the"):
        list(loader)
    assert len(list(reader)) == 2  # the rest of the epoch, here


def test_dataset_reads_the_epoch_set_in_every_mode(disk_dir: Path) -> None:
    """In the main process as in workers: the epoch last set, 0 until then (DistributedSampler's
    rule), not one that advances by itself only where the dataset is not copied."""
    make_tree(disk_dir, classes=2, per_class=6)
    dataset = FileDataset(file_root=disk_dir, batch_size=4, seed=1)
    first = sorted_batches(dataset)
    assert sorted_batches(dataset) == first
    reader = FileReader(file_root=disk_dir, batch_size=4, seed=1)
    assert first == sorted_batches(reader)
    dataset.set_epoch(1)
    assert sorted_batches(dataset) == sorted_batches(reader)  # the reader's epoch 1
    for bad in (-1, True, 1.0, 2**63, np.bool_(True), np.float32(1)):
        with pytest.raises(ValueError) as raised:
            dataset.set_epoch(bad)  # type: ignore[arg-type]
        assert str(raised.value) == f"epoch must be a non-negative 63-bit integer, not {bad!r}"
    # numpy integers (a loop over np.arange) are integers.
    dataset.set_epoch(np.int64(1))
    again = FileReader(file_root=disk_dir, batch_size=4, seed=1)
    again.set_epoch(np.int64(1))
    assert sorted_batches(dataset) == sorted_batches(again)
    assert len(FileReader(file_root=disk_dir, batch_size=np.int32(4), seed=np.uint8(1))) == 3


def stream_dataset(dataset: FileDataset) -> list[list[tuple[bytes, int]]]:
    return [[(bytes(s.numpy()), int(l)) for s, l in zip(samples, labels)]
            for samples, labels in dataset]


def test_pin_memory_without_cuda_still_reads(disk_dir: Path) -> None:
    tree = make_tree(disk_dir, classes=1, per_class=4)
    reader = FileReader(file_root=disk_dir, batch_size=4, shuffle=False, pin_memory=True)
    assert stream(reader, 1) == [[tree[p] for p in sorted(tree)]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_batches(disk_dir: Path) -> None:
    tree = make_tree(disk_dir, classes=2, per_class=4)
    reader = FileReader(file_root=disk_dir, batch_size=8, shuffle=False, device="cuda")
    samples, labels = next(iter(reader))
    assert all(s.is_cuda for s in samples) and labels.is_cuda
    assert [bytes(s.cpu().numpy()) for s in samples] == [tree[p][0] for p in sorted(tree)]


def test_bench_files_cli(disk_dir: Path) -> None:
    import subprocess
    import sys

    tree = make_tree(disk_dir / "set", classes=2, per_class=5)
    tool = Path(sys.executable).parent / "tensortier"
    r = subprocess.run([str(tool), "bench-files", str(disk_dir / "set"), "--batch-size", "3",
                        "--shuffle", "--cold", "--epochs", "2", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    import json

    out = json.loads(r.stdout)
    assert out["files"] == 20 and out["bytes"] == 2 * sum(len(d) for d, _ in tree.values())
    assert out["files_per_s"] > 0 and out["cold"] is True
    r = subprocess.run([str(tool), "bench-files", str(disk_dir / "set")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "files/s" in r.stdout, r.stderr
    r = subprocess.run([str(tool), "bench-files", str(disk_dir / "missing")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "missing" in r.stderr
    r = subprocess.run([str(tool), "bench-files", str(disk_dir), "--bogus"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0


def test_check_files_false_defers_a_missing_file_to_its_batch(disk_dir: Path) -> None:
    tree = make_tree(disk_dir, classes=1, per_class=2)
    missing = str(disk_dir / "missing.jpg")
    reader = FileReader(files=sorted(tree) + [missing], batch_size=3, shuffle=False,
                        check_files=False)
    with pytest.raises(FileNotFoundError, match="missing.jpg"):
        next(iter(reader))


def drop_from_cache(paths: list[str]) -> None:
    """Cold files: read through the engine's backend (O_DIRECT), where faults are injected;
    cached ones are copied from the page cache."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def test_a_read_error_in_the_middle_of_a_batch(disk_dir: Path) -> None:
    tree = make_tree(disk_dir, classes=2, per_class=6)
    paths = sorted(tree)
    drop_from_cache(paths)
    # The engine's fault-injecting backend fails the 5th read request of the first batch.
    fault = {"kind": "error", "errno": 5, "nth": 5, "count": 1, "writes": False}
    labels = [tree[p][1] for p in paths]
    # prefetch=1: the next batch's reads start after this one's, so the fault lands in it.
    raising = with_faults(fault, FileReader, files=paths, labels=labels, batch_size=8,
                          shuffle=False, prefetch=1, backend="threads")
    it = iter(raising)
    with pytest.raises(OSError) as failure:
        next(it)
    assert failure.value.errno == 5
    assert any(p in str(failure.value) for p in paths[:8]), str(failure.value)
    # The failed batch was not given out: the next loop reads it again (the fault was once).
    assert raising.state_dict()["position"] == 0
    assert stream(raising, 1) == [[tree[p] for p in paths[:8]], [tree[p] for p in paths[8:]]]

    drop_from_cache(paths)
    skipping = with_faults(fault, FileReader, files=paths, labels=labels, batch_size=8,
                           shuffle=False, prefetch=1, backend="threads", on_error="skip")
    batches = stream(skipping, 1)
    assert skipping.stats["skipped"] == 1
    first = batches[0]
    assert len(first) == 7
    wanted = [tree[p] for p in paths[:8]]
    missing = [w for w in wanted if w not in first]
    assert len(missing) == 1
    assert first == [w for w in wanted if w != missing[0]]  # the rest intact, in order
    assert batches[1] == [tree[p] for p in paths[8:]]


def test_short_reads_in_a_batch_are_completed(disk_dir: Path) -> None:
    tree = make_tree(disk_dir, classes=2, per_class=6)
    paths = sorted(tree)
    fault = {"kind": "short", "short_bytes": 4096, "nth": 2, "count": 6, "writes": False}
    drop_from_cache(paths)
    reader = with_faults(fault, FileReader, files=paths, labels=[tree[p][1] for p in paths],
                         batch_size=5, shuffle=False, backend="threads")
    assert sum(stream(reader, 2), []) == [tree[p] for p in paths] * 2
    assert reader.stats["skipped"] == 0


def test_file_filters_select_the_samples_of_a_file_root(disk_dir: Path) -> None:
    tree = make_tree(disk_dir, classes=2, per_class=3)
    (disk_dir / "class_00/readme.txt").write_bytes(b"not an image")
    (disk_dir / "class_01/b.BIN").write_bytes(b"bin")
    # DALI's default: image and audio names only, whatever their case.
    assert sorted(FileReader(file_root=disk_dir).files) == sorted(tree)
    reader = FileReader(file_root=disk_dir, file_filters=["*.txt", "*.bin"], shuffle=False)
    assert stream(reader, 1) == [[(b"not an image", 0), (b"bin", 1)]]
    with pytest.raises(ValueError, match=r"no files matching file_filters \(\*\.bin, case-sens"):
        FileReader(file_root=disk_dir, file_filters="*.bin", case_sensitive_filter=True)
    dataset = FileDataset(file_root=disk_dir, file_filters="*.txt", batch_size=4)
    assert [(bytes(s.numpy()), int(l)) for b, ls in dataset for s, l in zip(b, ls)] == [
        (b"not an image", 0)]
    with pytest.raises(TypeError, match="file_filters"):
        FileReader(file_root=disk_dir, file_filters=[b"*.jpg"])  # type: ignore[list-item]


def test_dir_filters_select_the_class_folders_of_a_file_root(disk_dir: Path) -> None:
    tree = make_tree(disk_dir, classes=4, per_class=2)
    (disk_dir / "Other").mkdir()
    (disk_dir / "Other/a.jpg").write_bytes(b"other")
    chosen = [p for p in sorted(tree) if "class_01" in p or "class_03" in p]
    reader = FileReader(file_root=disk_dir, dir_filters=["*_01", "CLASS_03"], shuffle=False)
    # Labels number the chosen folders only, in sorted order.
    assert stream(reader, 1) == [[(tree[p][0], 0 if "class_01" in p else 1) for p in chosen]]
    assert FileReader(file_root=disk_dir, dir_filters="o*").files == [str(disk_dir / "Other/a.jpg")]
    with pytest.raises(ValueError, match=r"of 5, those matching dir_filters CLASS_03"):
        FileReader(file_root=disk_dir, dir_filters="CLASS_03", case_sensitive_filter=True)
    dataset = FileDataset(file_root=disk_dir, dir_filters="Other", batch_size=4)
    assert [(bytes(s.numpy()), int(l)) for b, ls in dataset for s, l in zip(b, ls)] == [
        (b"other", 0)]
    with pytest.raises(TypeError, match="dir_filters"):
        FileReader(file_root=disk_dir, dir_filters=[1])  # type: ignore[list-item]
    # Ignored, as in DALI, when the files are listed.
    assert FileReader(files=chosen, dir_filters="nothing").files == chosen


def test_file_list_labels_take_every_int32_value_as_dali_does(disk_dir: Path) -> None:
    (disk_dir / "a.jpg").write_bytes(b"a")
    lst = disk_dir / "list.txt"
    # Ten digits, leading zeros, CRLF and tabs: fn.readers.file takes all of them.
    lst.write_bytes(b"a.jpg 2147483647\r\na.jpg\t0000000000007\n\na.jpg 1000000000\n")
    batches = stream(FileReader(file_list=lst, batch_size=3, shuffle=False), 1)
    assert batches == [[(b"a", 2147483647), (b"a", 7), (b"a", 1000000000)]]
    # Past int32 DALI wraps the label round to a negative one; it is refused here instead.
    for label in ("2147483648", "99999999999999999999999"):
        lst.write_text(f"a.jpg {label}\n")
        with pytest.raises(ValueError, match="line 1.*int32"):
            FileReader(file_list=lst)


def test_state_dict_of_other_files_of_the_same_count_is_refused(disk_dir: Path) -> None:
    tree = make_tree(disk_dir, classes=2, per_class=3)
    paths = sorted(tree)
    reader = FileReader(files=paths[:3], batch_size=2, seed=1)
    next(iter(reader))
    state = reader.state_dict()
    with pytest.raises(ValueError, match="other files"):
        FileReader(files=paths[3:], batch_size=2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="other files"):
        FileReader(files=paths[:3], labels=[9, 9, 9], batch_size=2, seed=1).load_state_dict(state)
    same = FileReader(files=paths[:3], batch_size=2, seed=1)
    same.load_state_dict(state)
    assert same.state_dict() == state
    # A state taken before states carried the digest still resumes (settings and count checked).
    older = {k: v for k, v in state.items() if k != "files_digest"}
    resumed = FileReader(files=paths[:3], batch_size=2, seed=1)
    resumed.load_state_dict(older)
    assert resumed.state_dict() == state
    with pytest.raises(ValueError, match="other files or settings"):
        FileReader(files=paths[:2], batch_size=2, seed=1).load_state_dict(older)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None
                    or shutil.which("prlimit") is None,
                    reason="needs root to run a process as another user under a thread limit")
def test_a_refused_open_thread_is_an_os_error_not_an_abort() -> None:
    # RLIMIT_NPROC binds only a non-root user: the reader runs as nobody, allowed 40 threads.
    with tempfile.TemporaryDirectory() as scratch:
        os.chmod(scratch, 0o755)
        path = Path(scratch) / "a.jpg"
        path.write_bytes(b"a")
        code = ("from tensortier.data import FileReader\n"
                "try:\n"
                f"    FileReader(files=[{str(path)!r}], open_threads=200)\n"
                "except OSError as e:\n"
                "    print('OSError', e.errno, e)\n")
        r = subprocess.run(["prlimit", "--nproc=40", "setpriv", "--reuid=65534", "--regid=65534",
                            "--clear-groups", sys.executable, "-c", code],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"OSError {errno.EAGAIN}" in r.stdout and "open_threads" in r.stdout, r.stdout


def test_counts_past_64_bits_are_value_errors(disk_dir: Path) -> None:
    (disk_dir / "a.jpg").write_bytes(b"a")
    files = [str(disk_dir / "a.jpg")]
    for name, kw in (("seed", dict(seed=2**64)), ("num_shards", dict(num_shards=2**64)),
                     ("shard_id", dict(shard_id=2**64, num_shards=2)),
                     ("batch_size", dict(batch_size=2**64))):
        with pytest.raises(ValueError, match=name):
            FileReader(files=files, **kw)
    assert len(list(FileReader(files=files, seed=2**64 - 1))) == 1


def test_a_padding_past_what_an_epoch_can_list_is_refused_when_made(disk_dir: Path) -> None:
    make_tree(disk_dir, classes=1, per_class=3)
    for batch_size in (2**64 - 1, 2**62):  # 2**64 - 1 padded to an empty epoch, silently
        with pytest.raises(ValueError, match="pad_last_batch"):
            FileReader(file_root=disk_dir, batch_size=batch_size, pad_last_batch=True)
    samples, _ = next(iter(FileReader(file_root=disk_dir, batch_size=2**64 - 1)))
    assert len(samples) == 3


def test_labels_that_are_not_integers_are_refused_not_converted(disk_dir: Path) -> None:
    """np.asarray(..., dtype=int64) turned "1" into 1 and 1.5 into 1; DALI takes integers only."""
    (disk_dir / "a.jpg").write_bytes(b"a")
    (disk_dir / "b.jpg").write_bytes(b"b")
    files = [str(disk_dir / "a.jpg"), str(disk_dir / "b.jpg")]
    for bad in (["1", "2"], [1.5, 2.0], [True, False], [[1], [2]], [1, None]):
        with pytest.raises(TypeError, match="labels must be"):
            FileReader(files=files, labels=bad)
    for big in ([2**31, 0], [2**70, 0], [-(2**31) - 1, 0]):
        with pytest.raises(ValueError, match="int32"):
            FileReader(files=files, labels=big)
    reader = FileReader(files=files, labels=np.array([7, 2**31 - 1], dtype=np.uint32),
                        shuffle=False)
    (_, labels), = list(reader)
    assert labels.tolist() == [7, 2**31 - 1]


def test_thread_and_prefetch_counts_past_32_bits_and_boolean_positions_are_refused(
        disk_dir: Path) -> None:
    (disk_dir / "a.jpg").write_bytes(b"a")
    files = [str(disk_dir / "a.jpg")]
    for name in ("prefetch", "open_threads"):
        with pytest.raises(ValueError, match=f"{name} must be a positive 32-bit integer"):
            FileReader(files=files, **{name: 2**32})
    reader = FileReader(files=files)
    state = reader.state_dict()
    for key in ("epoch", "position"):
        with pytest.raises(ValueError, match="bad position"):
            reader.load_state_dict({**state, key: True})


def test_a_state_loaded_during_an_iteration_moves_it(disk_dir: Path) -> None:
    """A loop (or DALI source) under way follows load_state_dict and set_epoch: it must not go
    on with its own epoch and overwrite the loaded position with it."""
    make_tree(disk_dir, classes=3, per_class=8)  # 24 files: 8 batches of 3
    args = dict(file_root=disk_dir, batch_size=3, seed=4)
    whole = stream(FileReader(**args), 3)
    source = FileReader(**args)
    stream(source, 1)
    it = iter(source)
    next(it)
    state = source.state_dict()  # epoch 1, after its first batch
    reader = FileReader(**args)
    it = iter(reader)
    next(it)  # epoch 0's first batch
    reader.load_state_dict(state)
    rest = [[(bytes(s.numpy()), int(l)) for s, l in zip(*batch)] for batch in it]
    assert rest == whole[9:16]  # the rest of epoch 1, then the loop ends
    assert (reader.epoch, reader.state_dict()["position"]) == (2, 0)
    it = iter(reader)
    next(it)
    reader.set_epoch(0)
    assert [[(bytes(s.numpy()), int(l)) for s, l in zip(*batch)] for batch in it] == whole[:8]
    assert reader.epoch == 1
    # A later iteration takes the read-ahead over; close() ends the one under way.
    first, second = iter(reader), iter(reader)
    as_pairs = lambda batch: [(bytes(s.numpy()), int(l)) for s, l in zip(*batch)]  # noqa: E731
    assert as_pairs(next(first)) == whole[8]
    assert as_pairs(next(second)) == whole[9]  # on from where the first left off
    assert list(first) == []
    assert [as_pairs(batch) for batch in second] == whole[10:16]
    it = iter(reader)
    next(it)
    reader.close()
    assert list(it) == []


def test_a_state_past_its_epoch_or_the_64_bit_epochs_is_refused(disk_dir: Path) -> None:
    make_tree(disk_dir, classes=2, per_class=5)  # 10 files: 3 batches of 4
    reader = FileReader(file_root=disk_dir, batch_size=4, seed=1)
    for _ in reader:
        state = reader.state_dict()  # inside the last batch: position 3 of 3
    assert (state["epoch"], state["position"]) == (0, 3)
    resumed = FileReader(file_root=disk_dir, batch_size=4, seed=1)
    resumed.load_state_dict(state)  # the end of epoch 0 is a place to resume from
    assert stream(resumed, 2) == stream(FileReader(file_root=disk_dir, batch_size=4, seed=1), 2)[3:]
    for bad in ({"position": 4}, {"epoch": 2**64}, {"epoch": 1.0}):
        with pytest.raises(ValueError, match="bad position"):
            resumed.load_state_dict({**state, **bad})
    for epoch in (True, 2**64, -1):
        with pytest.raises(ValueError, match="epoch must be"):
            resumed.set_epoch(epoch)  # type: ignore[arg-type]


def test_epoch_indices_names_a_bad_epoch(disk_dir: Path) -> None:
    make_tree(disk_dir, classes=1, per_class=3)
    reader = FileReader(file_root=disk_dir, batch_size=2, shuffle=False)
    assert reader.epoch_indices(2**64 - 1) == [0, 1, 2]
    for epoch, shown in ((-1, "-1"), (2**64, str(2**64)), (True, "True"), (1.0, "1.0"),
                         ("1", "'1'"), (None, "None")):
        with pytest.raises(ValueError) as raised:
            reader.epoch_indices(epoch)  # type: ignore[arg-type]
        # As set_epoch and the other settings say it, not pybind11's signature listing.
        assert str(raised.value) == f"epoch must be a non-negative 64-bit integer, not {shown}"


def test_state_dict_resumes_a_root_spelled_another_way(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_tree(disk_dir / "data" / "train", classes=2, per_class=3)
    root = disk_dir / "data" / "train"
    (disk_dir / "link").symlink_to(disk_dir / "data")
    reader = FileReader(file_root=str(root), batch_size=2, seed=3, shuffle=True)
    next(iter(reader))
    state = reader.state_dict()
    expected = [bytes(t.numpy()) for t in next(iter(reader))[0]]
    monkeypatch.chdir(disk_dir / "data")
    for spelling in (f"{root}/", f"{disk_dir}/data/./train", f"{disk_dir}//data/../data/train",
                     "train", "./train/", f"{disk_dir}/link/train"):
        resumed = FileReader(file_root=spelling, batch_size=2, seed=3, shuffle=True)
        resumed.load_state_dict(state)
        assert [bytes(t.numpy()) for t in next(iter(resumed))[0]] == expected, spelling
        assert resumed.state_dict()["files_digest"] == state["files_digest"]
    # files= relative to another working directory, and the same names in another tree
    monkeypatch.chdir(disk_dir)
    names = [os.path.relpath(p, disk_dir) for p in reader.files]
    FileReader(files=names, labels=reader.labels, batch_size=2, seed=3,
               shuffle=True).load_state_dict(state)
    shutil.copytree(root, disk_dir / "copy")
    with pytest.raises(ValueError, match="other files"):
        FileReader(file_root=disk_dir / "copy", batch_size=2, seed=3,
                   shuffle=True).load_state_dict(state)
    # A state whose digest was taken of the paths as spelled resumes the same spelling.
    import hashlib

    linked = FileReader(file_root=disk_dir / "link" / "train", batch_size=2, seed=3, shuffle=True)
    digest = hashlib.sha256()
    for p in linked.files:
        assert "/link/" in p
        digest.update(os.fsencode(p) + b"\0")
    digest.update(linked.labels.astype("<i4").tobytes())
    spelled = {**state, "files_digest": digest.hexdigest()}
    linked.load_state_dict(spelled)
    with pytest.raises(ValueError, match="other files"):
        FileReader(file_root=root, batch_size=2, seed=3, shuffle=True).load_state_dict(spelled)


@pytest.mark.parametrize("state", [None, [("epoch", 0), ("position", 0)], "state", 3])
def test_load_state_dict_of_something_else_than_a_dict_is_a_type_error(disk_dir: Path,
                                                                       state: Any) -> None:
    make_tree(disk_dir, classes=1, per_class=3)
    reader = FileReader(file_root=disk_dir, batch_size=2)
    with pytest.raises(TypeError, match=r"dict that FileReader.state_dict\(\) returns"):
        reader.load_state_dict(state)


def test_a_file_list_that_is_not_a_regular_file_is_refused_by_name_before_reading(
        disk_dir: Path) -> None:
    (disk_dir / "a.jpg").write_bytes(b"x")
    fifo = disk_dir / "list.fifo"
    os.mkfifo(fifo)
    folder = disk_dir / "list.d"
    folder.mkdir()
    # In a child bounded in time: a FIFO read would wait for a writer forever, /dev/zero never ends.
    script = (
        "import sys\n"
        "from tensortier.data import FileReader\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        FileReader(file_list=name)\n"
        "    except OSError as e:\n"
        "        print(type(e).__name__, e.errno, e.filename == name, 'regular file' in str(e)\n"
        "              or 'directory' in str(e))\n")
    r = subprocess.run([sys.executable, "-c", script, str(fifo), "/dev/zero", str(folder)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        f"OSError {errno.EINVAL} True True",
        f"OSError {errno.EINVAL} True True",
        f"IsADirectoryError {errno.EISDIR} True True",
    ]


def test_a_file_list_past_its_size_bound_is_refused(disk_dir: Path) -> None:
    lst = disk_dir / "huge.txt"
    with open(lst, "wb") as f:
        f.truncate((4 << 30) + 1)  # sparse: no disk space used
    with pytest.raises(OSError) as e:
        FileReader(file_list=lst)
    assert e.value.errno == errno.EFBIG and e.value.filename == str(lst)


def _child(script: str, *args: str) -> list[str]:
    """Runs `script` in a new Python (bounded in time), returning its output lines."""
    r = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.splitlines()


def test_open_files_are_bounded_by_rlimit_nofile_not_by_the_batch(disk_dir: Path) -> None:
    tree = make_tree(disk_dir, classes=3, per_class=100)
    # 300 files in batches of 150 read 4 ahead would keep 750 files open: the child may open 128.
    script = (
        "import hashlib, resource, sys\n"
        "from tensortier.data import FileReader\n"
        "_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))\n"
        "for on_error in ('skip', 'raise'):\n"
        "    reader = FileReader(file_root=sys.argv[1], batch_size=150, prefetch=4, seed=3,\n"
        "                        on_error=on_error)\n"
        "    digest, count = hashlib.sha256(), 0\n"
        "    for epoch in range(2):\n"
        "        for samples, labels in reader:\n"
        "            count += len(samples)\n"
        "            for s, l in zip(samples, labels):\n"
        "                digest.update(s.numpy().tobytes() + int(l).to_bytes(4, 'little'))\n"
        "    print(count, reader.stats['skipped'], digest.hexdigest())\n")
    want = hashlib.sha256()
    reader = FileReader(file_root=disk_dir, batch_size=150, prefetch=4, seed=3)
    for _ in range(2):
        for samples, labels in reader:
            for s, l in zip(samples, labels):
                want.update(s.numpy().tobytes() + int(l).to_bytes(4, "little"))
    assert len(tree) == 300
    assert _child(script, str(disk_dir)) == [f"600 0 {want.hexdigest()}"] * 2


def test_running_out_of_descriptors_raises_even_when_errors_are_skipped(disk_dir: Path) -> None:
    make_tree(disk_dir, classes=2, per_class=10)
    script = (
        "import resource, sys\n"
        "from tensortier.data import FileReader\n"
        "reader = FileReader(file_root=sys.argv[1], batch_size=20, on_error='skip')\n"
        "_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (0, hard))  # no open can succeed now\n"
        "try:\n"
        "    samples, _ = next(iter(reader))\n"
        "    print('read', len(samples), reader.stats['skipped'])\n"
        "except OSError as e:\n"
        "    print('raised', e.errno)\n")
    assert _child(script, str(disk_dir)) == [f"raised {errno.EMFILE}"]


def test_a_file_that_reports_no_size_but_has_bytes_is_refused_by_name(disk_dir: Path) -> None:
    (disk_dir / "a.bin").write_bytes(b"abc")
    (disk_dir / "empty.bin").write_bytes(b"")
    files = ["/proc/self/status", disk_dir / "a.bin", disk_dir / "empty.bin"]
    with pytest.raises(OSError, match="size of 0 bytes but has data") as e:
        list(FileReader(files=files, batch_size=3, shuffle=False))
    assert e.value.errno == errno.EINVAL and e.value.filename == "/proc/self/status"
    reader = FileReader(files=files, batch_size=3, shuffle=False, on_error="skip")
    (samples, labels), = list(reader)
    assert [s.numpy().tobytes() for s in samples] == [b"abc", b""]  # an empty file stays a sample
    assert labels.tolist() == [1, 2] and reader.stats["skipped"] == 1


def test_two_threads_on_one_iteration_get_a_generators_error_not_a_hang(disk_dir: Path) -> None:
    """As with a generator: a second thread stepping the same iteration is refused, and the first
    goes on; no thread waits forever and no batch is None or given twice."""
    import threading

    tree = make_tree(disk_dir / "root", classes=2, per_class=20)
    reader = FileReader(file_root=str(disk_dir / "root"), batch_size=4, shuffle=False)
    for _ in range(5):
        batches = reader.batches()
        got: list[Any] = []

        def drain() -> None:
            try:
                for batch in batches:
                    arena = bytes(np.frombuffer(batch, dtype=np.uint8))
                    got.append([arena[o:o + n] for o, n in zip(batch.offsets, batch.sizes)])
            except ValueError as e:
                got.append(e)

        threads = [threading.Thread(target=drain, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "an iteration stepped by two threads hung"
        errors = [g for g in got if isinstance(g, ValueError)]
        assert all("generator already executing" in str(e) for e in errors), errors
        samples = [s for g in got if not isinstance(g, ValueError) for s in g]
        assert sorted(samples) == sorted(data for data, _ in tree.values())
    reader.close()


def test_close_from_another_thread_ends_an_iteration_under_way(disk_dir: Path) -> None:
    """FileReader.close() while another thread waits for the next batch ends that iteration
    (StopIteration there) instead of leaving it waiting forever."""
    import threading

    make_tree(disk_dir / "root", classes=2, per_class=200)
    for trial in range(5):
        reader = FileReader(file_root=str(disk_dir / "root"), batch_size=2, shuffle=True,
                            seed=trial)
        batches = reader.batches()
        next(batches)
        errors: list[BaseException] = []

        def drain() -> None:
            try:
                for _ in batches:
                    pass
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        thread = threading.Thread(target=drain, daemon=True)
        thread.start()
        reader.close()
        thread.join(60)
        assert not thread.is_alive(), "close() left an iteration waiting forever"
        assert errors == []
