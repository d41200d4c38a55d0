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


def main():
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
