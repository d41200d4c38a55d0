"""Regenerates the small checkpoint fixtures of the C++ tests (tests/cpp/test_checkpoint_*.cpp).

Run with the project's venv (torch and safetensors installed):
    .venv/bin/python tests/data/checkpoint/make_fixtures.py
The files are small and committed; torch.save puts a random serialization id in each .pt file, so
regenerating changes their bytes but not what the tests check.
"""

import collections
import io
import os
import pickle
import zipfile

import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))


def tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "layer.weight": torch.randn(4, 3, generator=g),
        "layer.bias": torch.randn(3, generator=g).to(torch.bfloat16),
        "step": torch.tensor(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 2, dtype=torch.float16),
    }


# (name, dtype, shape) of the plain dict whose torch.save pickle is dict.pkl. Mirrored in
# tests/cpp/test_checkpoint_convert.cpp, which checks that SerializeTorchPickle emits those bytes.
DICT_TENSORS = (
    [
        ("f64", torch.float64, (2,)),
        ("f32", torch.float32, (4, 3)),
        ("f16", torch.float16, (2, 3, 4, 5)),
        ("bf16", torch.bfloat16, (3,)),
        ("i64", torch.int64, ()),
        ("i32", torch.int32, (300,)),
        ("i16", torch.int16, (0, 3)),
        ("i8", torch.int8, (70000,)),
        ("u8", torch.uint8, (1,)),
        ("bool", torch.bool, (2, 2)),
        ("c64", torch.complex64, (1,)),
        ("c128", torch.complex128, (1,)),
        ("u16", torch.uint16, (2,)),
        ("u32", torch.uint32, (3, 0, 2)),
        ("u64", torch.uint64, (1,)),
        ("f8_e4m3fn", torch.float8_e4m3fn, (2,)),
        ("f8_e5m2", torch.float8_e5m2, (2,)),
        ("f8_e4m3fnuz", torch.float8_e4m3fnuz, (2,)),
        ("f8_e5m2fnuz", torch.float8_e5m2fnuz, (2,)),
        ("f8_e8m0fnu", torch.float8_e8m0fnu, (2,)),
        ("\u00fcn\u00efcode.weight", torch.float32, (1, 1, 1, 1, 1)),
    ]
    # past 256 memo entries: LONG_BINPUT / LONG_BINGET
    + [(f"extra.{i}", torch.float32, (i + 1,)) for i in range(20)]
)


def dict_pickle():
    d = {name: torch.zeros(shape, dtype=dtype) for name, dtype, shape in DICT_TENSORS}
    buf = io.BytesIO()
    torch.save(d, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        pkl = z.read("archive/data.pkl")
    with open(os.path.join(HERE, "dict.pkl"), "wb") as f:
        f.write(pkl)


def state_dict_fixtures():
    """state_dict.pt: torch.save(model.state_dict()); train_state.pt: a training checkpoint nesting
    it. state_dict() sets OrderedDict._metadata, so their pickles end each state dict with a BUILD
    opcode (the attribute's value) that a plain dict's pickle lacks. Run alone with
        .venv/bin/python -c "import make_fixtures as m; m.state_dict_fixtures()"
    (from this folder) to regenerate only these two files."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    torch.save(model.state_dict(), os.path.join(HERE, "state_dict.pt"))
    torch.save(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 5},
        os.path.join(HERE, "train_state.pt"),
    )
    with zipfile.ZipFile(os.path.join(HERE, "train_state.pt")) as z:  # seeds the fuzz target
        pkl = z.read("train_state/data.pkl")
    with open(os.path.join(HERE, "../../fuzz/corpus/torch_pickle/train_state.pkl"), "wb") as f:
        f.write(pkl)


def main():
    dict_pickle()
    state_dict_fixtures()
    save_file(tensors(), os.path.join(HERE, "small.safetensors"), metadata={"source": "make_fixtures.py"})

    # A state dict as torch.save writes it: nested dicts, non-tensor values, a view sharing its
    # base's storage (with a storage offset), a parameter, several dtypes.
    t = tensors()
    base = torch.arange(12, dtype=torch.float32)
    sd = collections.OrderedDict()
    sd["model"] = collections.OrderedDict(
        [("layer.weight", t["layer.weight"]), ("layer.bias", t["layer.bias"]), ("mask", t["mask"])]
    )
    sd["shared"] = {"base": base, "view": base[4:10].view(2, 3)}
    sd["param"] = torch.nn.Parameter(torch.ones(2, 2, dtype=torch.float64))
    sd["step"] = 7
    sd["lr"] = 0.5
    sd["name"] = "small"
    sd["list"] = [1, (2, 3), None, True, torch.tensor([5, 6], dtype=torch.int32)]
    torch.save(sd, os.path.join(HERE, "small.pt"))
    # The pickle alone seeds the pickle fuzz target.
    with zipfile.ZipFile(os.path.join(HERE, "small.pt")) as z:
        pkl = z.read("small/data.pkl")
    with open(os.path.join(HERE, "../../fuzz/corpus/torch_pickle/small.pkl"), "wb") as f:
        f.write(pkl)

    # A pickle naming a disallowed global, in an otherwise valid torch zip.
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    buf = io.BytesIO()
    torch.save({"x": torch.zeros(2)}, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(
        os.path.join(HERE, "evil.pt"), "w", zipfile.ZIP_STORED
    ) as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("data.pkl"):
                data = pickle.dumps({"x": Evil()}, protocol=2)
            dst.writestr(info.filename.replace("archive/", "evil/", 1), data)

    # A torch.save archive recompressed with deflate (torch never writes those).
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(
        os.path.join(HERE, "deflated.zip"), "w", zipfile.ZIP_DEFLATED
    ) as dst:
        for info in src.infolist():
            dst.writestr(info.filename.replace("archive/", "deflated/", 1), src.read(info))

    # The legacy (pre-1.6, non-zip) format.
    torch.save({"x": torch.zeros(2)}, os.path.join(HERE, "legacy.pt"), _use_new_zipfile_serialization=False)


if __name__ == "__main__":
    main()
