"""tensortier.data against NVIDIA DALI (CPU-only pipelines): shards and padding equal to
fn.readers.file's, dali_source() feeding fn.external_source over several epochs, decoded images
equal to PIL's."""

from __future__ import annotations

import io
import os
import random
from pathlib import Path

import numpy as np
import pytest

from tensortier.data import FileReader

dali = pytest.importorskip("nvidia.dali")
from nvidia.dali import fn, pipeline_def, types  # noqa: E402


def make_tree(root: Path, classes: int = 3, per_class: int = 7, seed: int = 0) -> None:
    """Class folders of files with unique bytes (names end in .jpg so readers.file takes them)."""
    rng = random.Random(seed)
    for label in range(classes):
        d = root / f"c{label}"
        d.mkdir(parents=True)
        for i in range(per_class):
            size = rng.choice([1, 100, 4095, 4096, 4097, 30000, 70001])
            (d / f"{i:03d}.jpg").write_bytes((f"{label}/{i}/".encode() + rng.randbytes(size))[:size + 8])


def dali_file_stream(root: Path, batch_size: int, batches: int, **reader_args) -> list[list[tuple[bytes, int]]]:
    @pipeline_def(batch_size=batch_size, num_threads=1, device_id=None)
    def pipe():
        data, labels = fn.readers.file(file_root=str(root), random_shuffle=False, **reader_args)
        return data, labels

    p = pipe()
    p.build()
    out = []
    for _ in range(batches):
        data, labels = p.run()
        out.append([(bytes(np.array(data[i])), int(np.array(labels[i])[0]))
                    for i in range(len(data))])
    return out


def reader_stream(reader: FileReader, epochs: int) -> list[list[tuple[bytes, int]]]:
    out = []
    for _ in range(epochs):
        for samples, labels in reader:
            out.append([(bytes(s.numpy()), int(l)) for s, l in zip(samples, labels)])
    return out


@pytest.mark.parametrize("num_shards,shard_id", [(1, 0), (2, 0), (2, 1), (3, 0), (3, 2), (4, 1)])
@pytest.mark.parametrize("stick_to_shard", [False, True])
@pytest.mark.parametrize("pad_last_batch", [False, True])
def test_same_samples_as_readers_file(disk_dir: Path, num_shards: int, shard_id: int,
                                      stick_to_shard: bool, pad_last_batch: bool) -> None:
    make_tree(disk_dir)  # 21 files
    batch_size = 4
    args = dict(shard_id=shard_id, num_shards=num_shards, stick_to_shard=stick_to_shard,
                pad_last_batch=pad_last_batch)
    reader = FileReader(file_root=disk_dir, batch_size=batch_size, shuffle=False, **args)
    ours = reader_stream(reader, 4)
    theirs = dali_file_stream(disk_dir, batch_size, len(ours) + 1, **args)
    if pad_last_batch:
        # Batches line up with epochs: the same batches.
        assert ours == theirs[:len(ours)]
    else:
        # DALI fills an epoch's last batch with the next epoch's samples: the same stream.
        flat_ours = sum(ours, [])
        assert flat_ours == sum(theirs, [])[:len(flat_ours)]


def test_a_shuffled_reader_stuck_to_its_shard_reads_its_files_each_epoch(disk_dir: Path) -> None:
    """stick_to_shard with shuffling: fn.readers.file reads the same files every epoch (what a
    node caches), in another order; so must the reader, while its shards still split the set."""
    make_tree(disk_dir, classes=2, per_class=10)  # 20 files, 10 per shard
    everything: set[tuple[bytes, int]] = set()
    for shard in range(2):
        args = dict(shard_id=shard, num_shards=2, stick_to_shard=True)
        ours = FileReader(file_root=disk_dir, batch_size=5, shuffle=True, seed=3, **args)
        epochs = [sum(reader_stream(ours, 1), []) for _ in range(4)]
        assert all(sorted(epoch) == sorted(epochs[0]) for epoch in epochs)
        assert any(epoch != epochs[0] for epoch in epochs)
        everything.update(epochs[0])

        @pipeline_def(batch_size=5, num_threads=1, device_id=None)
        def pipe():
            data, labels = fn.readers.file(file_root=str(disk_dir), random_shuffle=True,
                                           initial_fill=10, **args)
            return data, labels

        p = pipe()
        p.build()
        theirs = [sum(dali_file_stream_of(p, 2), []) for _ in range(4)]
        assert all(sorted(epoch) == sorted(theirs[0]) for epoch in theirs)
    assert len(everything) == 20


def dali_file_stream_of(pipe, batches: int) -> list[list[tuple[bytes, int]]]:
    out = []
    for _ in range(batches):
        data, labels = pipe.run()
        out.append([(bytes(np.array(data[i])), int(np.array(labels[i])[0]))
                    for i in range(len(data))])
    return out


def run_epochs(pipe, epochs: int) -> list[list[list[tuple[bytes, int]]]]:
    out = []
    for _ in range(epochs):
        batches = []
        try:
            while True:
                data, labels = pipe.run()
                batches.append([(bytes(np.array(data[i])), int(np.array(labels[i])[0]))
                                for i in range(len(data))])
        except StopIteration:
            pass
        pipe.reset()
        out.append(batches)
    return out


@pytest.mark.parametrize("no_copy", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_dali_source_epochs_with_reset(disk_dir: Path, no_copy: bool, shuffle: bool) -> None:
    make_tree(disk_dir, classes=4, per_class=9)  # 36 files
    batch_size = 5
    reader = FileReader(file_root=disk_dir, batch_size=batch_size, shuffle=shuffle, seed=9,
                        num_shards=2, shard_id=1, pad_last_batch=True)
    reference = FileReader(file_root=disk_dir, batch_size=batch_size, shuffle=shuffle, seed=9,
                           num_shards=2, shard_id=1, pad_last_batch=True)

    @pipeline_def(batch_size=batch_size, num_threads=1, device_id=None, prefetch_queue_depth=2)
    def pipe():
        data, labels = fn.external_source(source=reader.dali_source(queue_depth=2), num_outputs=2,
                                          batch=True, no_copy=no_copy,
                                          dtype=[types.UINT8, types.INT32])
        return data, labels

    p = pipe()
    p.build()
    got = run_epochs(p, 3)
    want = [reader_stream(reference, 1) for _ in range(3)]
    assert got == want
    assert all(len(epoch) == 4 for epoch in got)  # 18 samples + padding: 4 batches of 5


def test_no_copy_samples_outlive_the_sources_own_queue(disk_dir: Path) -> None:
    """With no_copy=True DALI's inputs are the arenas themselves: each one must stay the batch's
    until DALI frees it, however far the source has read past it."""
    make_tree(disk_dir, classes=3, per_class=8)  # 24 files
    reader = FileReader(file_root=disk_dir, batch_size=2, shuffle=True, seed=3, prefetch=1)
    reference = FileReader(file_root=disk_dir, batch_size=2, shuffle=True, seed=3)
    source = reader.dali_source(queue_depth=1)
    fed = [next(source) for _ in range(4)]  # the source keeps the last three
    for _ in range(6):
        next(source)  # arenas given back would be refilled by these reads
    want = reader_stream(reference, 1)[:4]
    got = [[(bytes(np.array(samples[i])), int(np.array(labels[i])[0])) for i in range(len(samples))]
           for samples, labels in fed]
    assert [[data for data, _ in batch] for batch in got] == [[d for d, _ in b] for b in want]


def test_a_state_loaded_after_dali_asked_for_batches_is_where_the_source_goes_on(
        disk_dir: Path) -> None:
    """A DALI iterator runs its pipeline when made, so the source is under way before a training
    script loads its checkpoint: the source must go on from the loaded state (after the batches
    DALI already holds), not from its own epoch, and the reader's state must then be the
    loaded one's."""
    make_tree(disk_dir, classes=3, per_class=8)  # 24 files: 8 batches of 3
    args = dict(file_root=disk_dir, batch_size=3, seed=6)
    whole = reader_stream(FileReader(**args), 2)
    saved = FileReader(**args)
    reader_stream(saved, 1)
    it = iter(saved)
    for _ in range(2):
        next(it)
    state = saved.state_dict()  # epoch 1, two batches in
    reader = FileReader(**args)
    depth = 2

    @pipeline_def(batch_size=3, num_threads=1, device_id=None, prefetch_queue_depth=depth)
    def pipe():
        data, labels = fn.external_source(source=reader.dali_source(), num_outputs=2,
                                          batch=True, dtype=[types.UINT8, types.INT32])
        return data, labels

    p = pipe()
    p.build()
    got = [run_one(p)]  # DALI asked for `depth` batches
    reader.load_state_dict(state)
    try:
        while True:
            got.append(run_one(p))
    except StopIteration:
        pass
    assert got[:depth] == whole[:depth]  # what DALI had asked for before the load
    assert got[depth:] == whole[8 + 2:16]
    assert (reader.epoch, reader.state_dict()["position"]) == (2, 0)


@pytest.mark.parametrize("sized", [False, True])
def test_setting_each_epoch_while_dali_reads_ahead_gives_each_batch_once(disk_dir: Path,
                                                                         sized: bool) -> None:
    """A script that calls reader.set_epoch(epoch) as each epoch starts (DistributedSampler's
    habit), after the DALI iterator's reset has already asked for that epoch's first batches."""
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    make_tree(disk_dir, classes=3, per_class=7)  # 21 files: 6 batches of 4, padded
    args = dict(file_root=disk_dir, batch_size=4, seed=1, pad_last_batch=True)
    want = reader_stream(FileReader(**args), 1), reader_stream(FileReader(**args), 2)[6:]
    reader = FileReader(**args)

    @pipeline_def(batch_size=4, num_threads=1, device_id=None, prefetch_queue_depth=2)
    def pipe():
        data, labels = fn.external_source(source=reader.dali_source(), num_outputs=2,
                                          batch=True, dtype=[types.UINT8, types.INT32])
        return fn.pad(data), data.shape(), labels

    p = pipe()
    p.build()
    sizing = dict(size=21, last_batch_padded=True, last_batch_policy=LastBatchPolicy.FILL)
    it = DALIGenericIterator([p], ["data", "shape", "label"], auto_reset=True,
                             **(sizing if sized else {}))
    for epoch in range(2):
        reader.set_epoch(epoch)
        got = [[(bytes(data[i][:int(shape[i][0])].numpy()), int(label[i][0]))
                for i in range(data.shape[0])]
               for data, shape, label in ((b[0]["data"], b[0]["shape"], b[0]["label"])
                                          for b in it)]
        assert got == want[epoch], f"epoch {epoch}"


def run_one(pipe) -> list[tuple[bytes, int]]:
    data, labels = pipe.run()
    return [(bytes(np.array(data[i])), int(np.array(labels[i])[0])) for i in range(len(data))]


def test_after_a_read_error_the_source_goes_on_from_the_failed_batch(disk_dir: Path) -> None:
    """An error ends the reader's iteration under the source; the source must not then report
    an empty epoch (DALI would run one) but read again from the batch that failed."""
    (disk_dir / "k").mkdir()
    for i in range(6):
        (disk_dir / "k" / f"{i}.jpg").write_bytes(bytes([65 + i]) * 10)
    reader = FileReader(file_root=disk_dir, batch_size=2, shuffle=False, prefetch=1)
    source = reader.dali_source()
    (disk_dir / "k" / "2.jpg").rename(disk_dir / "k" / "2.bak")
    next(source)
    with pytest.raises(FileNotFoundError, match="2.jpg"):
        next(source)
    (disk_dir / "k" / "2.bak").rename(disk_dir / "k" / "2.jpg")  # back: the job tries again
    rest = []
    with pytest.raises(StopIteration):
        while True:
            samples, _ = next(source)
            rest.append([bytes(np.array(samples[i])) for i in range(len(samples))])
    assert rest == [[b"C" * 10, b"D" * 10], [b"E" * 10, b"F" * 10]]
    assert reader.epoch == 1


def test_dali_source_covers_every_shard_once(disk_dir: Path) -> None:
    make_tree(disk_dir, classes=3, per_class=9)  # 27 files
    everything = set()
    for shard in range(4):
        reader = FileReader(file_root=disk_dir, batch_size=3, seed=4, shard_id=shard,
                            num_shards=4, pad_last_batch=True)

        @pipeline_def(batch_size=3, num_threads=1, device_id=None)
        def pipe():
            data, labels = fn.external_source(source=reader.dali_source(), num_outputs=2,
                                              batch=True, dtype=[types.UINT8, types.INT32])
            return data, labels

        p = pipe()
        p.build()
        epoch = run_epochs(p, 1)[0]
        samples = sum(epoch, [])
        assert len(samples) == 9  # ceil(27 / 4) = 7, padded to a whole batch
        assert len(epoch) == 3
        everything.update(samples)
    assert len(everything) == 27


def test_a_batch_whose_files_were_all_skipped_is_not_given_to_dali(disk_dir: Path) -> None:
    """on_error="skip" with every file of a batch gone: DALI takes no empty batch, so the
    source goes on to the next one."""
    files = []
    for i in range(6):
        path = disk_dir / f"f{i}.bin"
        path.write_bytes(bytes([i]) * 3)
        files.append(str(path))
    reader = FileReader(files=files, batch_size=2, shuffle=False, on_error="skip",
                        check_files=False)
    os.unlink(files[2])
    os.unlink(files[3])

    @pipeline_def(batch_size=2, num_threads=1, device_id=None)
    def pipe():
        data, labels = fn.external_source(source=reader.dali_source(), num_outputs=2,
                                          batch=True, dtype=[types.UINT8, types.INT32])
        return data, labels

    p = pipe()
    p.build()
    epoch = run_epochs(p, 1)[0]
    assert [[sample for sample, _ in batch] for batch in epoch] == [
        [bytes([0]) * 3, bytes([1]) * 3], [bytes([4]) * 3, bytes([5]) * 3]]


def test_decoded_images_equal_pils(disk_dir: Path) -> None:
    PIL = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(0)
    for label in range(2):
        d = disk_dir / f"class{label}"
        d.mkdir()
        for i in range(3):
            pixels = rng.integers(0, 256, size=(24 + 8 * i, 40, 3), dtype=np.uint8)
            buf = io.BytesIO()
            PIL.fromarray(pixels).save(buf, format="JPEG", quality=90)
            (d / f"{i}.jpg").write_bytes(buf.getvalue())
    reader = FileReader(file_root=disk_dir, batch_size=3, shuffle=False)

    @pipeline_def(batch_size=3, num_threads=1, device_id=None)
    def pipe():
        data, labels = fn.external_source(source=reader.dali_source(), num_outputs=2, batch=True,
                                          dtype=[types.UINT8, types.INT32])
        return fn.decoders.image(data, device="cpu", output_type=types.RGB), labels

    p = pipe()
    p.build()
    paths = sorted(disk_dir.rglob("*.jpg"))
    decoded = []
    try:
        while True:
            images, labels = p.run()
            decoded.extend(np.array(images[i]) for i in range(len(images)))
    except StopIteration:
        pass
    assert len(decoded) == 6
    for path, image in zip(paths, decoded):
        want = np.asarray(PIL.open(path).convert("RGB"))
        assert image.shape == want.shape
        # libjpeg-turbo in both; allow the IDCT's rounding differences.
        assert np.abs(image.astype(int) - want.astype(int)).max() <= 2


@pytest.mark.parametrize("filters", [
    {},
    {"file_filters": ["*.txt", "*.PNG"]},
    {"file_filters": "*.PNG", "case_sensitive_filter": True},
    {"file_filters": ["*.jpg", "?oext"], "case_sensitive_filter": True},
    {"case_sensitive_filter": True},
])
def test_file_filters_take_the_files_readers_file_takes(disk_dir: Path,
                                                       filters: dict[str, object]) -> None:
    make_tree(disk_dir, classes=3, per_class=3)
    others = ["c0/notes.txt", "c0/UPPER.JPG", "c1/img.PNG", "c1/img2.png", "c1/noext",
              "c2/a.jpeg.bak", "c2/.hidden.jpg", "c2/sound.WAV", "c1/x.webp", "c0/y.TXT"]
    for i, name in enumerate(others):
        (disk_dir / name).write_bytes(f"{name}/{i}".encode() * (i + 1))
    reader = FileReader(file_root=disk_dir, batch_size=4, shuffle=False, **filters)
    ours = sum(reader_stream(reader, 1), [])
    theirs = sum(dali_file_stream(disk_dir, 4, len(ours) // 4 + 1, **filters), [])
    assert ours == theirs[:len(ours)]
    assert len(ours) != 9 + len(others)  # some file was left out
    assert theirs[len(ours)] == ours[0]  # DALI's next epoch starts: no file of DALI's is missing


@pytest.mark.parametrize("filters", [
    {"dir_filters": "c*"},
    {"dir_filters": ["C1", "t*"]},
    {"dir_filters": ["C1", "t*"], "case_sensitive_filter": True},
    {"dir_filters": ["c[02]", "*rain*"], "file_filters": ["*.jpg", "*.txt"]},
    {"dir_filters": ["c*", "*1"]},  # c1 matches both: one class
])
def test_dir_filters_take_the_folders_readers_file_takes(disk_dir: Path,
                                                        filters: dict[str, object]) -> None:
    make_tree(disk_dir, classes=3, per_class=3)
    others = ["train/a.jpg", "train/b.txt", "Tmp/c.jpg", "val1/d.jpg", "c3x/e.jpg"]
    for i, name in enumerate(others):
        (disk_dir / name).parent.mkdir(exist_ok=True)
        (disk_dir / name).write_bytes(f"{name}/{i}".encode() * (i + 1))
    (disk_dir / "c9.jpg").write_bytes(b"a file named like a folder the globs take")
    reader = FileReader(file_root=disk_dir, batch_size=4, shuffle=False, **filters)
    ours = sum(reader_stream(reader, 1), [])
    theirs = sum(dali_file_stream(disk_dir, 4, len(ours) // 4 + 1, **filters), [])
    assert ours == theirs[:len(ours)]
    assert theirs[len(ours)] == ours[0]  # DALI's next epoch starts: no file of DALI's is missing


def test_empty_dir_filters_are_refused_as_readers_file_refuses_them(disk_dir: Path) -> None:
    make_tree(disk_dir, classes=2, per_class=2)
    with pytest.raises(ValueError, match="dir_filters is an empty list"):
        FileReader(file_root=disk_dir, dir_filters=[])
    with pytest.raises(RuntimeError, match="dir_filters.. list cannot be empty"):
        dali_file_stream(disk_dir, 2, 1, dir_filters=[])


def test_parallel_external_source_is_refused_with_the_reason(disk_dir: Path) -> None:
    make_tree(disk_dir, classes=1, per_class=3)
    reader = FileReader(file_root=disk_dir, batch_size=3)

    @pipeline_def(batch_size=3, num_threads=1, device_id=None, py_num_workers=1,
                  py_start_method="spawn")
    def pipe():
        samples, labels = fn.external_source(source=reader.dali_source(), num_outputs=2,
                                             batch=True, parallel=True,
                                             dtype=[types.UINT8, types.INT32])
        return samples, labels

    # DALI pickles a parallel source into its worker processes; the reader's C++ state and
    # batch memory cannot go there, and the error says what to do instead.
    with pytest.raises(TypeError, match="parallel=False"):
        pipe().build()
