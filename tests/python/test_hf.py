"""tensortier.hf against transformers itself: tiny models built from configs with random weights
(no downloads), loaded and saved both ways and compared bit for bit."""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import stat
import signal
import struct
import subprocess
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
import safetensors.torch  # noqa: E402

from conftest import mounted  # noqa: E402
from faults import with_faults  # noqa: E402
import tensortier  # noqa: E402
from tensortier import _core, hf  # noqa: E402

try:  # a machine with another transformers (a GPU image's) skips; CI pins a supported one
    hf._transformers()
except ImportError as e:
    if os.environ.get("CI"):
        raise
    pytest.skip(str(e), allow_module_level=True)

KW = dict(vocab_size=96, max_position_embeddings=32)
MODELS: dict[str, Any] = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, **KW)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=32)),
    "bert": lambda: transformers.BertModel(transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, **KW)),
    "t5": lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
        d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4, vocab_size=96)),
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **KW)),
}
AUTO = transformers.AutoModel
CLI = str(Path(sys.executable).parent / "tensortier")


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files tensortier.load read for tensortier.hf (none: transformers read them)."""
    seen: list[str] = []
    real = hf.load

    def load(path: str, *args: Any, **kwargs: Any) -> Any:
        seen.append(os.path.basename(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(hf, "load", load)
    return seen


def ours(reads: list[str], cls: Any, path: Path, **kwargs: Any) -> Any:
    """hf.from_pretrained, checked to have read the checkpoint with tensortier.load."""
    model = hf.from_pretrained(cls, path, **kwargs)
    assert len(reads) == 1 and reads.pop().startswith("model.safetensors")
    return model


def make(kind: str, directory: Path, shard: str | None = None) -> Any:
    """A random model of `kind`, saved by transformers into `directory` (sharded in pieces of
    `shard` bytes, or one file)."""
    torch.manual_seed(0)
    model = MODELS[kind]()
    model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    return model


def inputs(model: Any) -> dict[str, torch.Tensor]:
    ids = torch.arange(1, 9).reshape(1, 8)
    if model.config.is_encoder_decoder:
        return {"input_ids": ids, "decoder_input_ids": ids}
    return {"input_ids": ids}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def assert_same(ours: Any, theirs: Any) -> None:
    """Same class, parameters and buffers (bit for bit, non-persistent ones too), tied weights
    and forward outputs."""
    assert type(ours) is type(theirs)
    a = dict(ours.named_parameters(remove_duplicate=False)) | dict(ours.named_buffers())
    b = dict(theirs.named_parameters(remove_duplicate=False)) | dict(theirs.named_buffers())
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].device == b[name].device, name
        assert a[name].shape == b[name].shape and torch.equal(bits(a[name]), bits(b[name])), name
    ties = {n: t.data_ptr() for n, t in a.items()}
    theirs_ties = {n: t.data_ptr() for n, t in b.items()}
    assert {(m, n) for m in ties for n in ties if m < n and ties[m] == ties[n]} == \
        {(m, n) for m in b for n in b if m < n and theirs_ties[m] == theirs_ties[n]}
    assert ours.training == theirs.training
    with torch.no_grad():
        x, y = ours(**inputs(ours)), theirs(**inputs(theirs))
    key = "logits" if "logits" in x else "last_hidden_state"
    assert torch.equal(x[key], y[key])


@pytest.mark.parametrize("kind,shard", [
    ("llama", "20KB"), ("gpt2", None), ("bert", "30KB"), ("t5", "25KB"), ("mixtral", "40KB"),
])
def test_from_pretrained_gives_transformers_model(tmp_path: Path, kind: str, shard: str | None,
                                                  reads: list[str]) -> None:
    make(kind, tmp_path, shard)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard is not None)
    cls = type(MODELS[kind]())
    for dtype in (None, torch.bfloat16) if kind != "llama" else (None, "float32", torch.bfloat16,
                                                                 torch.float16):
        kw = {} if dtype is None else {"dtype": dtype}
        assert_same(ours(reads, cls, tmp_path, **kw), cls.from_pretrained(tmp_path, **kw))
    assert_same(ours(reads, AUTO, tmp_path), AUTO.from_pretrained(tmp_path))


def test_cached_shards_are_mapped_and_others_read(tmp_path: Path, reads: list[str]) -> None:
    make("llama", tmp_path, "20KB")
    shards = [str(p) for p in tmp_path.glob("*.safetensors")]

    def mapped(model: Any) -> bool:  # every parameter in a mapping of a shard
        maps = Path("/proc/self/maps").read_text().splitlines()
        spans = [[int(a, 16) for a in f[0].split("-")] for f in map(str.split, maps)
                 if len(f) == 6 and f[5].startswith(str(tmp_path))]
        return all(any(lo <= p.data_ptr() < hi for lo, hi in spans) for p in model.parameters())

    for shard in shards:  # out of the page cache (where the file system lets them go)
        fd = os.open(shard, os.O_RDONLY)
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    cold = _core.files_residency(shards)[0] == 0
    cls = transformers.LlamaForCausalLM
    ours_cold = ours(reads, cls, tmp_path)
    assert not (cold and mapped(ours_cold))
    for shard in shards:  # into the page cache (direct reads left them out)
        Path(shard).read_bytes()
    for kw in ({}, {"dtype": torch.bfloat16}):  # read early, then while transformers loads
        warm = ours(reads, cls, tmp_path, **kw)
        assert mapped(warm) == (not kw)
        assert_same(warm, cls.from_pretrained(tmp_path, **kw))
    assert_same(ours_cold, cls.from_pretrained(tmp_path))
    # torch.load's MAP_SHARED setting is not transformers': writes to the model never reach
    # the checkpoint's files (device_map: read on this thread, whose setting it is).
    before = {shard: Path(shard).read_bytes() for shard in shards}
    with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        warm = ours(reads, cls, tmp_path, device_map="cpu")
        assert mapped(warm)
        with torch.no_grad():
            for p in warm.parameters():
                p.fill_(3.0)
        del warm
    assert all(Path(shard).read_bytes() == data for shard, data in before.items())


def test_variants_and_subfolders(tmp_path: Path, reads: list[str]) -> None:
    torch.manual_seed(0)
    model = MODELS["gpt2"]()
    model.save_pretrained(tmp_path / "sub", variant="v1", max_shard_size="20KB")
    (tmp_path / "config.json").write_text((tmp_path / "sub" / "config.json").read_text())
    kw = {"variant": "v1", "subfolder": "sub"}
    assert_same(ours(reads, AUTO, tmp_path, **kw), AUTO.from_pretrained(tmp_path, **kw))


def test_a_load_under_inference_mode_gives_ordinary_parameters(
        tmp_path: Path, reads: list[str]) -> None:
    """Loaded under torch.inference_mode(), as transformers loads: ordinary tensors, which
    training and in-place edits outside inference mode take (inference tensors refuse both)."""
    make("llama", tmp_path, "20KB")
    for kw in ({"device_map": "cpu"}, {"dtype": torch.bfloat16}, {}):
        with torch.inference_mode():
            model = hf.from_pretrained(AUTO, tmp_path, **kw)
        assert reads and reads.pop().startswith("model.safetensors")
        assert not any(p.is_inference() for p in model.parameters())
        with torch.no_grad():
            next(model.parameters())[0] = 0.0
        with torch.inference_mode():
            theirs = AUTO.from_pretrained(tmp_path, **kw)
        with torch.no_grad():
            next(theirs.parameters())[0] = 0.0
        assert_same(model, theirs)


def test_t5_keeps_its_fp32_modules(tmp_path: Path, reads: list[str]) -> None:
    make("t5", tmp_path, "25KB")
    model = ours(reads, transformers.T5ForConditionalGeneration, tmp_path, dtype=torch.float16)
    wo = model.encoder.block[0].layer[1].DenseReluDense.wo.weight
    assert wo.dtype == torch.float32 and model.shared.weight.dtype == torch.float16


def test_older_key_names_are_renamed(tmp_path: Path, reads: list[str]) -> None:
    """A BERT checkpoint with LayerNorm.gamma/beta: transformers' own renames apply."""
    make("bert", tmp_path)
    f = tmp_path / "model.safetensors"
    sd = safetensors.torch.load_file(f)
    old = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias",
                                                                    "LayerNorm.beta"): v
           for k, v in sd.items()}
    assert old.keys() != sd.keys()
    safetensors.torch.save_file(old, f, metadata={"format": "pt"})
    assert_same(ours(reads, AUTO, tmp_path), AUTO.from_pretrained(tmp_path))


def test_save_pretrained_writes_transformers_files(tmp_path: Path) -> None:
    torch.manual_seed(0)
    for kind in ("gpt2", "mixtral"):
        model = MODELS[kind]()
        ours, theirs = tmp_path / f"ours-{kind}", tmp_path / f"theirs-{kind}"
        hf.save_pretrained(model, ours, max_shard_size="20KB")
        model.save_pretrained(theirs, max_shard_size="20KB")
        assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
        # The same modes too (shards 0600 where safetensors writes them through a temporary).
        assert {n: stat.S_IMODE((ours / n).stat().st_mode) for n in os.listdir(ours)} == \
            {n: stat.S_IMODE((theirs / n).stat().st_mode) for n in os.listdir(theirs)}
        index = json.loads((ours / "model.safetensors.index.json").read_text())
        assert index == json.loads((theirs / "model.safetensors.index.json").read_text())
        for shard in set(index["weight_map"].values()):
            with safetensors.safe_open(ours / shard, "pt") as f:
                assert "tensortier.xxh64" in f.metadata()
            a, b = (safetensors.torch.load_file(d / shard) for d in (ours, theirs))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert_same(type(model).from_pretrained(ours), type(model).from_pretrained(theirs))
        n = len(set(index["weight_map"].values()))
        got = subprocess.run([CLI, "verify", str(ours)], capture_output=True, text=True)
        assert got.returncode == 0 and f"all {n} shards OK" in got.stdout, got.stdout + got.stderr
        got = subprocess.run([CLI, "info", str(ours)], capture_output=True, text=True)
        assert got.returncode == 0 and f"({n} shards," in got.stdout, got.stdout + got.stderr


def test_save_pretrained_keeps_other_files_and_replaces_the_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = MODELS["llama"]()
    hf.save_pretrained(model, tmp_path / "m", max_shard_size="20KB")
    (tmp_path / "m" / "tokenizer.json").write_text("{}")
    with torch.no_grad():
        model.lm_head.weight.add_(1)
    hf.save_pretrained(model, tmp_path / "m")  # one file now: the shards go, as in transformers
    names = set(os.listdir(tmp_path / "m"))
    assert {"tokenizer.json", "model.safetensors", "config.json"} <= names
    assert not any("-of-" in n for n in names)
    got = subprocess.run([CLI, "verify", str(tmp_path / "m")], capture_output=True, text=True)
    assert got.returncode == 0 and "m/model.safetensors: data OK" in got.stdout, got.stderr
    assert_same(hf.from_pretrained(type(model), tmp_path / "m"), model.eval())
    assert [n for n in os.listdir(tmp_path) if n != "m"] == []


def posix_acl(entries: list[tuple[int, int, int]]) -> bytes:
    """The kernel's binary ACL (version 2): (tag, permissions, id) entries, sorted by tag."""
    import struct

    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


def test_save_pretrained_keeps_the_directory_s_acls_and_attributes(tmp_path: Path) -> None:
    """A shared output folder's default ACL (which files written into it inherit) and its
    user.* attributes stay, as in the folder transformers writes into in place."""
    model = MODELS["llama"]()
    out = tmp_path / "m"
    out.mkdir()
    # user::rwx, group::r-x, group 1234: rwx, mask::rwx, other::r-x
    default_acl = posix_acl([(0x01, 7, 0xFFFFFFFF), (0x04, 5, 0xFFFFFFFF), (0x08, 7, 1234),
                             (0x10, 7, 0xFFFFFFFF), (0x20, 5, 0xFFFFFFFF)])
    try:
        os.setxattr(out, "user.tensortier.team", b"nlp")
        os.setxattr(out, "system.posix_acl_default", default_acl)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EPERM, errno.EOPNOTSUPP):
            pytest.skip(f"no extended attributes or ACLs on this file system: {e}")
        raise
    for _ in range(2):  # a new directory, then one over it
        hf.save_pretrained(model, out)
        assert os.getxattr(out, "user.tensortier.team") == b"nlp"
        assert os.getxattr(out, "system.posix_acl_default") == default_acl
        # The shards written into it inherited the named group's entry.
        access = os.getxattr(out / "model.safetensors", "system.posix_acl_access")
        assert struct.pack("<HHI", 0x08, 7, 1234) in access


KILLED_SAVE = """
import sys, time, torch, transformers
from tensortier import hf
torch.manual_seed(1)
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=96, max_position_embeddings=32))
written = hf.save
def save(*args, **kwargs):
    written(*args, **kwargs)
    print("shard", flush=True)
    time.sleep(60)
hf.save = save
hf.save_pretrained(model, sys.argv[1], max_shard_size="20KB")
"""


def test_a_killed_save_leaves_the_old_directory(tmp_path: Path) -> None:
    old = make("llama", tmp_path / "m", "20KB")
    child = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(tmp_path / "m")],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "shard\n"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    (killed,) = [n for n in os.listdir(tmp_path) if n.startswith(".m.tmp-")]
    assert_same(hf.from_pretrained(type(old), tmp_path / "m"), old.eval())
    # The next save removes the killed save's staging directory, not a running one's (ours).
    running = Path(_core.temporary_path_prefix(str(tmp_path / "m")) + "0000abcd")
    running.mkdir()
    (running / "model.safetensors").write_bytes(b"partial")
    hf.save_pretrained(old, tmp_path / "m")
    assert sorted(n for n in os.listdir(tmp_path) if n != "m") == [running.name]
    assert killed != running.name


def test_enable_and_disable(tmp_path: Path, reads: list[str]) -> None:
    make("llama", tmp_path / "m", "20KB")
    model = MODELS["llama"]()
    save_pretrained = transformers.PreTrainedModel.save_pretrained
    hf.enable()
    try:
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
        assert reads == ["model.safetensors.index.json"]
        model.save_pretrained(tmp_path / "ours")
        with safetensors.safe_open(tmp_path / "ours" / "model.safetensors", "pt") as f:
            assert "tensortier.xxh64" in f.metadata()
    finally:
        hf.disable()
    assert transformers.PreTrainedModel.save_pretrained is save_pretrained
    reads.clear()
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")  # transformers' reading
    assert reads == []
    model.save_pretrained(tmp_path / "theirs")
    with safetensors.safe_open(tmp_path / "theirs" / "model.safetensors", "pt") as f:
        assert "tensortier.xxh64" not in f.metadata()


def test_an_empty_save_path_is_refused_as_transformers_refuses_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unset output directory ("") is not the working directory."""
    monkeypatch.chdir(tmp_path)
    model = MODELS["llama"]()
    with pytest.raises(FileNotFoundError):
        model.save_pretrained("")
    with pytest.raises(FileNotFoundError):
        hf.save_pretrained(model, "")
    hf.enable()
    try:
        with pytest.raises(FileNotFoundError):
            model.save_pretrained("")
    finally:
        hf.disable()
    assert os.listdir(tmp_path) == []


def test_dot_dot_after_a_symbolic_link_is_resolved_as_transformers_resolves_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """"ckpts/../final" with ckpts a link to another disk's folder: the folder beside the link's
    target, where the kernel (and transformers' writes) find it, not the path's text's."""
    (tmp_path / "disk" / "ckpts").mkdir(parents=True)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "ckpts").symlink_to(tmp_path / "disk" / "ckpts")
    monkeypatch.chdir(tmp_path / "home")
    model = MODELS["llama"]()
    model.save_pretrained("ckpts/../theirs")
    hf.save_pretrained(model, "ckpts/../ours/")
    assert sorted(os.listdir(tmp_path / "home")) == ["ckpts"]
    assert sorted(os.listdir(tmp_path / "disk")) == ["ckpts", "ours", "theirs"]
    assert sorted(os.listdir(tmp_path / "disk" / "ours")) == sorted(
        os.listdir(tmp_path / "disk" / "theirs"))
    assert_same(hf.from_pretrained(AUTO, "ckpts/../ours"), AUTO.from_pretrained("ckpts/../theirs"))
    hf.save_pretrained(model, "ckpts/../ours")  # again: swapped where it is
    assert sorted(os.listdir(tmp_path / "disk")) == ["ckpts", "ours", "theirs"]


def test_a_model_made_from_a_config_and_a_state_dict(reads: list[str]) -> None:
    """No path, config= and state_dict= given: the model transformers makes of them (nothing
    to read), where a path check refused the None."""
    torch.manual_seed(0)
    source = MODELS["gpt2"]()
    cls = type(source)
    kw = dict(config=source.config, state_dict=source.state_dict())
    assert_same(hf.from_pretrained(cls, None, **kw), cls.from_pretrained(None, **kw))
    assert_same(hf.from_pretrained(cls, None, **kw), source.eval())
    assert reads == []


def test_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError, match="huggingface_hub.snapshot_download"):
        hf.from_pretrained(AUTO, "meta-llama/Llama-3.2-1B")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(NotADirectoryError, match="pass the one holding config.json"):
        hf.from_pretrained(AUTO, tmp_path / "config.json")
    (tmp_path / "config.json").unlink()
    make("llama", tmp_path, "20KB")
    with pytest.raises(ValueError, match="not a floating-point dtype"):
        hf.from_pretrained(AUTO, tmp_path, dtype=torch.int32)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    os.truncate(shards[1], shards[1].stat().st_size - 100)
    # transformers' error (code catching it keeps working), and a ValueError naming the shard.
    with pytest.raises(safetensors.SafetensorError):
        AUTO.from_pretrained(tmp_path)
    with pytest.raises(safetensors.SafetensorError, match=shards[1].name) as damaged:
        hf.from_pretrained(AUTO, tmp_path)
    assert isinstance(damaged.value, ValueError)
    shards[1].unlink()
    with pytest.raises(OSError, match=shards[1].name):
        hf.from_pretrained(AUTO, tmp_path)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.40.0")
    with pytest.raises(ImportError, match=r">=5\.23\.0,<5\.24"):
        hf.from_pretrained(AUTO, tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_map(tmp_path: Path) -> None:
    make("llama", tmp_path, "20KB")
    cls = transformers.LlamaForCausalLM
    for device_map in ("cuda", {"": 0}, "auto"):
        assert_same(hf.from_pretrained(cls, tmp_path, device_map=device_map, dtype=torch.bfloat16),
                    cls.from_pretrained(tmp_path, device_map=device_map, dtype=torch.bfloat16))


@pytest.fixture
def early(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any, list[Any]]]:
    """The reads of tensortier.hf: (thread, dtype, weak references to the tensors read)."""
    seen: list[tuple[str, Any, list[Any]]] = []
    real = hf.load

    def load(path: str, device: Any, dtype: Any, **kwargs: Any) -> Any:
        state_dict = real(path, device, dtype, **kwargs)
        seen.append((threading.current_thread().name, dtype,
                     [weakref.ref(t) for t in state_dict.values()]))
        return state_dict

    monkeypatch.setattr(hf, "load", load)
    return seen


def test_early_read_is_not_started_where_transformers_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, early: list[Any]) -> None:
    make("llama", tmp_path)
    with hf._read_early(AUTO, str(tmp_path), {}):  # the read that the cases below do not start
        assert hf._early.get() is not None
    assert [thread for thread, _, _ in early] == ["tensortier-hf_0"]
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    config.quantization_config = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    with hf._read_early(AUTO, str(tmp_path), {"config": config}):  # quantized by the call
        assert hf._early.get() is None
    saved = (tmp_path / "config.json").read_text()
    (tmp_path / "config.json").write_text(json.dumps(
        json.loads(saved) | {"quantization_config": {"quant_method": "bitsandbytes"}}))
    with hf._read_early(AUTO, str(tmp_path), {}):  # saved quantized
        assert hf._early.get() is None
    (tmp_path / "config.json").write_text(saved)
    monkeypatch.setattr(transformers.modeling_utils, "is_deepspeed_zero3_enabled", lambda: True)
    with hf._read_early(AUTO, str(tmp_path), {}):  # ZeRO-3 partitions the weights as it loads them
        assert hf._early.get() is None
    monkeypatch.undo()
    for reads_no_weights in (transformers.AutoConfig, transformers.LlamaConfig):
        with hf._read_early(reads_no_weights, str(tmp_path), {}):
            assert hf._early.get() is None
    hf.from_pretrained(transformers.AutoConfig, tmp_path)
    assert len(early) == 1


def test_an_early_read_of_another_dtype_is_converted_not_read_again(
        tmp_path: Path, early: list[Any]) -> None:
    """A checkpoint whose dtypes differ from the model's was read a second time, converting as
    read, while the first read's tensors were still held: twice the bytes read, three times
    the memory."""
    make("llama", tmp_path)  # float32 in config.json; the weights bfloat16: converted
    weights = tmp_path / "model.safetensors"
    state_dict = safetensors.torch.load_file(weights)
    safetensors.torch.save_file({k: v.to(torch.bfloat16) for k, v in state_dict.items()},
                                weights, metadata={"format": "pt"})
    cls = transformers.LlamaForCausalLM
    model = hf.from_pretrained(cls, tmp_path)
    assert [(thread, dtype) for thread, dtype, _ in early] == [("tensortier-hf_0", None)]
    assert not any(ref() is not None for ref in early[0][2])  # the early read's tensors
    assert_same(model, cls.from_pretrained(tmp_path))


def test_a_checkpoint_of_mixed_dtypes_is_read_once(tmp_path: Path, early: list[Any]) -> None:
    """fp32 norms in a bf16 checkpoint: the model is bf16 ("auto"), the norms converted."""
    torch.manual_seed(0)
    model = MODELS["llama"]().to(torch.bfloat16)
    model.model.norm.float()
    model.save_pretrained(tmp_path)
    cls = transformers.LlamaForCausalLM
    for kw in ({}, {"dtype": "auto"}):
        early.clear()
        ours = hf.from_pretrained(cls, tmp_path, **kw)
        assert [(thread, dtype) for thread, dtype, _ in early] == [("tensortier-hf_0", None)]
        theirs = cls.from_pretrained(tmp_path, **kw)
        assert theirs.model.norm.weight.dtype == torch.bfloat16
        assert_same(ours, theirs)


def test_error_while_the_model_builds_does_not_wait_for_the_early_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make("llama", tmp_path)
    started, release, finished = threading.Event(), threading.Event(), threading.Event()
    real = hf.load

    def load(*args: Any, **kwargs: Any) -> Any:
        started.set()
        release.wait(60)
        try:
            return real(*args, **kwargs)
        finally:
            finished.set()

    class Failing(transformers.LlamaForCausalLM):
        def __init__(self, config: Any) -> None:
            assert started.wait(60)  # the early read is under way
            raise RuntimeError("the model cannot be built")

    monkeypatch.setattr(hf, "load", load)
    try:
        with pytest.raises(RuntimeError, match="cannot be built"):
            hf.from_pretrained(Failing, tmp_path)
        assert not finished.is_set()  # returned while the read still waits
    finally:
        release.set()
    for thread in threading.enumerate():
        if thread.name.startswith("tensortier-hf"):
            thread.join(60)
    assert finished.is_set()


def test_a_weight_map_that_is_not_names_to_files_is_a_type_error(tmp_path: Path) -> None:
    """transformers' reading of a malformed index reaches us as it is: a TypeError naming the
    weight map, not a cast error."""
    shard = tmp_path / "model-00001-of-00001.safetensors"
    safetensors.torch.save_file({"w": torch.ones(2)}, str(shard))
    for weight_map in ({"w": 1}, None, ["w"]):
        with pytest.raises(TypeError, match="weight_map must map tensor names to file names"):
            _core.hf_load_target([str(shard)], {"weight_map": weight_map})


def weights_of(directory: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(directory / "model.safetensors")


def test_a_rank_that_does_not_save_leaves_the_directory_alone(tmp_path: Path) -> None:
    """Every rank calls save_pretrained(out, is_main_process=rank == 0), as accelerate has them:
    the others write what transformers writes there (nothing), never a copy of the directory
    swapped in over the main rank's save."""
    old = make("llama", tmp_path / "m")
    before, inode = weights_of(tmp_path / "m"), os.stat(tmp_path / "m").st_ino
    other = MODELS["llama"]()
    hf.save_pretrained(other, tmp_path / "m", is_main_process=False)
    assert os.stat(tmp_path / "m").st_ino == inode  # not swapped: the main rank's save may be
    after = weights_of(tmp_path / "m")
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in after)
    assert os.listdir(tmp_path) == ["m"]
    assert_same(hf.from_pretrained(type(old), tmp_path / "m"), old.eval())


@pytest.fixture
def bind_mount(tmp_path: Path) -> Iterator[Path]:
    """A directory with another bind-mounted on it (a container's volume): a mount point that
    os.path.ismount does not see. Needs root; unmounted even when the test fails."""
    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    source, mnt = tmp_path / "volume", tmp_path / "out"
    source.mkdir()
    mnt.mkdir()
    with mounted(["mount", "--bind", str(source), str(mnt)], mnt, "a bind mount"):
        yield mnt


@pytest.mark.parametrize("case", ["working directory", "symbolic link", "bind mount"])
def test_a_directory_that_cannot_be_swapped_is_written_in_place(
        tmp_path: Path, case: str, request: pytest.FixtureRequest,
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = MODELS["llama"]()
    if case == "bind mount":
        out = request.getfixturevalue("bind_mount")
    elif case == "symbolic link":
        (tmp_path / "real").mkdir()
        out = tmp_path / "out"
        out.symlink_to(tmp_path / "real")
    else:
        out = tmp_path / "out"
        out.mkdir()
        monkeypatch.chdir(out)
    hf.save_pretrained(model, out, max_shard_size="20KB")
    hf.save_pretrained(model, out)  # over the first: the shards go, as in transformers
    assert not any("-of-" in n for n in os.listdir(out))
    assert_same(hf.from_pretrained(type(model), out), model.eval())
    assert [n for n in os.listdir(out.parent) if ".tmp-" in n] == []
    if case == "symbolic link":
        assert out.is_symlink() and (tmp_path / "real" / "model.safetensors").is_file()
    if case == "working directory":
        assert Path(os.getcwd()).samefile(out)


def test_files_beside_the_model_stay_the_same_files(tmp_path: Path) -> None:
    """What a save keeps of the directory is the same files (a log open there goes on being
    written into the directory), links stay links (one to the directory itself too), and what
    a save may rewrite in place is copied (the old directory stays whole until the swap)."""
    torch.manual_seed(0)
    model = MODELS["llama"]()
    out = tmp_path / "m"
    hf.save_pretrained(model, out)
    (out / "checkpoint-1").mkdir()
    (out / "checkpoint-1" / "optimizer.pt").write_bytes(b"x" * 4096)
    (out / "shared.json").write_text("{}")
    (out / "tokenizer.json").symlink_to(out / "shared.json")
    (out / "self").symlink_to(".")
    inodes = {n: os.stat(out / n).st_ino for n in ("checkpoint-1/optimizer.pt", "config.json")}
    with open(out / "train.log", "a") as log:
        log.write("before\n")
        log.flush()
        hf.save_pretrained(model, out)
        log.write("after\n")
    assert (out / "train.log").read_text() == "before\nafter\n"
    assert os.stat(out / "checkpoint-1" / "optimizer.pt").st_ino == inodes[
        "checkpoint-1/optimizer.pt"]
    assert os.stat(out / "config.json").st_ino != inodes["config.json"]
    assert (out / "tokenizer.json").is_symlink() and (out / "self").is_symlink()
    assert_same(hf.from_pretrained(type(model), out), model.eval())


def test_a_model_class_s_own_save_pretrained_is_used(tmp_path: Path) -> None:
    """A class with a save_pretrained of its own (PEFT models, subclasses that write more) is
    saved by it, with transformers' part through tensortier; under enable() too, once."""

    class WithNotes(transformers.LlamaForCausalLM):
        calls = 0

        def save_pretrained(self, directory, **kwargs):  # type: ignore[no-untyped-def]
            WithNotes.calls += 1
            super().save_pretrained(directory, **kwargs)
            Path(directory, "notes.txt").write_text("mine")

    torch.manual_seed(0)
    model = WithNotes(MODELS["llama"]().config)
    hf.save_pretrained(model, tmp_path / "direct")
    hf.enable()
    try:
        model.save_pretrained(tmp_path / "enabled")
    finally:
        hf.disable()
    assert WithNotes.calls == 2
    for out in (tmp_path / "direct", tmp_path / "enabled"):
        assert (out / "notes.txt").read_text() == "mine"
        with safetensors.safe_open(out / "model.safetensors", "pt") as f:
            assert "tensortier.xxh64" in f.metadata()
    with pytest.raises(TypeError, match="save_pretrained"):
        hf.save_pretrained(torch.nn.Linear(2, 2), tmp_path / "linear")


def test_a_failed_save_of_a_class_that_writes_files_in_place_leaves_them_old(
        tmp_path: Path) -> None:
    """A class's own save_pretrained that writes small files in place (a PEFT model's card and
    adapter configs), then fails: the old directory's files are as they were (the staged ones
    are copies, not links to them)."""

    class Adapter(transformers.LlamaForCausalLM):
        def save_pretrained(self, directory, **kwargs):  # type: ignore[no-untyped-def]
            super().save_pretrained(directory, **kwargs)
            for name in ("README.md", "adapter_b/adapter_config.json"):
                with open(Path(directory, name), "w") as f:  # in place, as open() writes
                    f.write("new")
            raise RuntimeError("the save failed")

    torch.manual_seed(0)
    model = Adapter(MODELS["llama"]().config)
    (tmp_path / "adapter_b").mkdir()
    for name in ("README.md", "adapter_b/adapter_config.json"):
        (tmp_path / name).write_text("old")
    with pytest.raises(RuntimeError, match="the save failed"):
        hf.save_pretrained(model, tmp_path)
    assert (tmp_path / "README.md").read_text() == "old"
    assert (tmp_path / "adapter_b" / "adapter_config.json").read_text() == "old"


def test_files_another_process_changes_during_a_save_stay_changed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files of the directory another process rewrites, replaces by rename or removes while the
    save runs: the new directory has their changes, as an in-place save would."""
    model = MODELS["llama"]()
    model.save_pretrained(tmp_path)
    for name in ("metrics.json", "status.txt", "old.txt"):
        (tmp_path / name).write_text(f"before {name}")
    real = hf._transformers_writer

    def writer(m: Any) -> Any:
        write = real(m)

        def during(directory: Any, **kwargs: Any) -> None:
            (tmp_path / "metrics.json").write_text('{"step": 2}')
            (tmp_path / "status.tmp").write_text("step 2")
            os.replace(tmp_path / "status.tmp", tmp_path / "status.txt")
            os.unlink(tmp_path / "old.txt")
            write(directory, **kwargs)

        return during

    monkeypatch.setattr(hf, "_transformers_writer", writer)
    hf.enable()
    try:
        model.save_pretrained(tmp_path)
    finally:
        hf.disable()
    assert (tmp_path / "metrics.json").read_text() == '{"step": 2}'
    assert (tmp_path / "status.txt").read_text() == "step 2"
    assert not (tmp_path / "old.txt").exists()


def test_a_log_appended_to_and_rotated_during_a_save_loses_no_line(tmp_path: Path) -> None:
    """A logger appending to train.log, then rotating it (renamed aside, a new one begun) while
    the save runs: the lines of the new log were lost with the old directory."""
    model = MODELS["llama"]()
    out = tmp_path / "m"
    hf.save_pretrained(model, out)
    (out / "train.log").write_text("1\n")
    write = hf._transformers_writer(model)

    def write_while_logging(directory: str, **kwargs: Any) -> None:
        with open(out / "train.log", "a") as f:
            f.write("2\n")
        os.replace(out / "train.log", out / "train.log.1")
        (out / "train.log").write_text("3\n")
        write(directory, **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf._save(model, str(out), write_while_logging, {})
    assert (out / "train.log.1").read_text() == "1\n2\n"
    assert (out / "train.log").read_text() == "3\n"
    assert not [p for p in tmp_path.iterdir() if p.name != "m"]


def test_files_made_and_removed_in_the_directory_during_saves_fail_none(tmp_path: Path) -> None:
    """Another thread makes and removes scratch files in the directory while saves run: a file
    removed while the save staged the directory failed the save (FileNotFoundError)."""
    model = MODELS["llama"]()
    out = tmp_path / "m"
    hf.save_pretrained(model, out)
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            for j in range(20):
                with contextlib.suppress(OSError):  # the swap's moment: see docs/hf.md
                    (out / f"tmp{j}.lock").touch()
            for j in range(20):
                with contextlib.suppress(OSError):
                    os.remove(out / f"tmp{j}.lock")

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a name taken meanwhile is kept aside: not this test's
            for _ in range(15):
                hf.save_pretrained(model, out)
    finally:
        stop.set()
        thread.join(timeout=60)
    assert_same(hf.from_pretrained(type(model), out), model.eval())


@pytest.mark.parametrize("code,cls", [(errno.ENOSPC, OSError), (errno.EACCES, PermissionError)])
def test_an_error_writing_the_staged_directory_names_the_model_directory(
        tmp_path: Path, code: int, cls: type) -> None:
    """A full disk or a read-only file while the model is written beside `path` named the
    staging directory, gone by the time the error is seen."""
    model = MODELS["llama"]()
    out = tmp_path / "m"

    def write_failing(directory: str, **kwargs: Any) -> None:
        raise OSError(code, os.strerror(code), os.path.join(directory, "model.safetensors"))

    with pytest.raises(cls) as e:
        hf._save(model, str(out), write_failing, {})
    assert e.value.errno == code and e.value.filename == str(out / "model.safetensors")
    assert not [p for p in tmp_path.iterdir() if p.name != "m"]


def test_a_shard_with_white_space_before_its_header_loads_as_transformers_loads_it(
        tmp_path: Path, reads: list[str]) -> None:
    """The safetensors package reads JSON's white space before the header's object (and
    transformers then loads the model); it was refused as a damaged shard."""
    model = make("llama", tmp_path)
    weights = tmp_path / "model.safetensors"
    raw = weights.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = b" \n" + raw[8:8 + n]
    weights.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n:])
    cls = type(model)
    assert_same(ours(reads, cls, tmp_path), cls.from_pretrained(tmp_path))
    assert torch.equal(tensortier.load(weights)["lm_head.weight"],
                       safetensors.torch.load_file(weights)["lm_head.weight"])


def test_a_fifo_in_the_directory_stays_a_fifo(tmp_path: Path) -> None:
    """Files a save may rewrite in place (.json) are staged as copies: a FIFO so named failed
    the save (EINVAL copying it)."""
    model = MODELS["llama"]()
    model.save_pretrained(tmp_path)
    os.mkfifo(tmp_path / "events.json")
    hf.save_pretrained(model, tmp_path)
    assert stat.S_ISFIFO(os.lstat(tmp_path / "events.json").st_mode)
    assert_same(hf.from_pretrained(type(model), tmp_path), model.eval())


def test_disable_mmap_reads_cached_files_rather_than_mapping_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make("llama", tmp_path)
    (tmp_path / "model.safetensors").read_bytes()  # in the page cache
    mapped: list[bool] = []
    real = hf._load

    def load(target: str, device: Any, dtype: Any, mmap: bool) -> Any:
        mapped.append(mmap)
        return real(target, device, dtype, mmap)

    monkeypatch.setattr(hf, "_load", load)
    hf.from_pretrained(AUTO, tmp_path, disable_mmap=True)
    assert mapped == [False]


def test_a_tensor_the_index_leaves_out_is_loaded_as_transformers_loads_it(
        tmp_path: Path, reads: list[str]) -> None:
    """transformers loads every tensor of a shard, named by the index or not: such a checkpoint
    is read by transformers, never loaded without the tensor (initialised at random)."""
    make("llama", tmp_path, "20KB")
    index = tmp_path / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    by_shard: dict[str, list[str]] = {}
    for name, shard in content["weight_map"].items():
        by_shard.setdefault(shard, []).append(name)
    left_out = next(names for names in by_shard.values() if len(names) > 1)[-1]
    del content["weight_map"][left_out]  # its shard is still read, for the others
    index.write_text(json.dumps(content))
    cls = transformers.LlamaForCausalLM
    assert_same(hf.from_pretrained(cls, tmp_path), cls.from_pretrained(tmp_path))
    assert reads in ([], ["model.safetensors.index.json"])  # at most the early read, declined


def test_an_index_naming_a_tensor_its_shard_lacks_loads_as_transformers_loads_it(
        tmp_path: Path, reads: list[str]) -> None:
    """transformers loads such a checkpoint and reports the tensor as missing (initialised at
    random): the same model, never an error of ours."""
    make("llama", tmp_path, "20KB")
    index = tmp_path / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    content["weight_map"]["model.extra.weight"] = next(iter(content["weight_map"].values()))
    index.write_text(json.dumps(content))
    cls = transformers.LlamaForCausalLM
    torch.manual_seed(1)
    theirs = cls.from_pretrained(tmp_path)
    torch.manual_seed(1)
    assert_same(hf.from_pretrained(cls, tmp_path), theirs)
    assert reads in ([], ["model.safetensors.index.json"])  # at most the early read, declined


def test_a_shard_that_is_a_symbolic_link_is_replaced_and_its_target_kept(tmp_path: Path) -> None:
    """A model directory linking into a Hub cache's blobs: the save replaces the link with the
    new file, as transformers does; the blob (another model's weights) stays as it was."""
    torch.manual_seed(0)
    model = MODELS["llama"]()
    out = tmp_path / "m"
    model.save_pretrained(out)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    blob = blobs / "sha256-of-the-weights"
    (out / "model.safetensors").rename(blob)
    (out / "model.safetensors").symlink_to(blob)
    cached = blob.read_bytes()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    for enabled in (False, True):
        if enabled:
            (out / "model.safetensors").unlink()
            (out / "model.safetensors").symlink_to(blob)
            hf.enable()
            try:
                model.save_pretrained(out)
            finally:
                hf.disable()
        else:
            hf.save_pretrained(model, out)
        assert blob.read_bytes() == cached
        assert not (out / "model.safetensors").is_symlink()
        assert_same(hf.from_pretrained(type(model), out), model.eval())


def test_files_another_process_writes_into_the_directory_during_a_save_stay(
        tmp_path: Path) -> None:
    """A Trainer's other ranks write their rng_state_N.pth into the checkpoint folder while
    rank 0 saves the model there: the swap must not drop them with the old directory."""
    torch.manual_seed(0)
    model = MODELS["llama"]()
    out = tmp_path / "checkpoint-2"
    out.mkdir()  # as Trainer makes it before saving
    write = hf._transformers_writer(model)

    def write_while_another_rank_writes(directory: str, **kwargs: Any) -> None:
        write(directory, **kwargs)
        (out / "rng_state_1.pth").write_bytes(b"rank 1")  # into the directory being replaced

    hf._save(model, str(out), write_while_another_rank_writes, {})
    assert (out / "rng_state_1.pth").read_bytes() == b"rank 1"
    assert_same(hf.from_pretrained(type(model), out), model.eval())
    assert [n for n in os.listdir(tmp_path) if ".tmp-" in n] == []


@pytest.mark.parametrize("code", ["EINVAL", "ENOSYS", "EOPNOTSUPP", "EBUSY", "EXDEV"])
def test_a_directory_that_cannot_be_exchanged_is_written_in_place(
        tmp_path: Path, code: str) -> None:
    """NFS, SMB and most FUSE file systems refuse renameat2(RENAME_EXCHANGE) (EINVAL, ENOSYS,
    EOPNOTSUPP), a bind mount refuses it (EBUSY, EXDEV): the save writes into the existing
    directory as transformers does, rather than failing a Trainer's save."""
    torch.manual_seed(0)
    model = MODELS["llama"]()
    out = tmp_path / "m"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    plan = {"kind": "error", "errno": getattr(errno, code), "steps": ["exchange"]}
    with_faults(plan, hf.save_pretrained, model, out)
    assert_same(hf.from_pretrained(type(model), out), model.eval())
    assert (out / "notes.txt").read_text() == "mine\n"
    assert [n for n in os.listdir(tmp_path) if ".tmp-" in n] == []
    # A given state_dict (Trainer's, for FSDP and ZeRO-3 models), which transformers' write
    # empties: the write in place still has every tensor.
    torch.manual_seed(1)
    other = MODELS["llama"]()
    state_dict = other.state_dict()
    with_faults(plan, hf.save_pretrained, model, out, state_dict=state_dict)
    assert_same(hf.from_pretrained(type(model), out), other.eval())


def test_a_directory_holding_a_mount_point_is_written_in_place(tmp_path: Path) -> None:
    """A volume mounted inside the output directory (a scratch tmpfs): a swap would leave the
    mount behind on the old directory and copy its files; the save writes in place instead,
    as transformers does, and the mount stays with its files."""
    from conftest import mounted

    model = MODELS["llama"]()
    out = tmp_path / "m"
    (out / "scratch").mkdir(parents=True)
    with mounted(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(out / "scratch")],
                 out / "scratch", "a tmpfs"):
        (out / "scratch" / "notes.txt").write_text("mine\n")
        hf.save_pretrained(model, out)
        assert os.path.ismount(out / "scratch")
        assert (out / "scratch" / "notes.txt").read_text() == "mine\n"
        assert_same(hf.from_pretrained(type(model), out), model.eval())
        assert [n for n in os.listdir(tmp_path) if n != "m"] == []
    assert os.listdir(out / "scratch") == []  # the file was on the mount only


def test_another_exchange_error_fails_the_save_and_leaves_the_directory(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = MODELS["llama"]()
    out = tmp_path / "m"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    plan = {"kind": "error", "errno": errno.EIO, "steps": ["exchange"]}
    with pytest.raises(OSError) as raised:
        with_faults(plan, hf.save_pretrained, model, out)
    assert raised.value.errno == errno.EIO
    assert raised.value.filename == str(out)
    assert os.listdir(out) == ["notes.txt"]
    assert [n for n in os.listdir(tmp_path) if ".tmp-" in n] == []


def test_a_compiled_model_is_saved_as_transformers_saves_it(tmp_path: Path) -> None:
    """torch.compile's wrapper forwards save_pretrained to the model: so do we."""
    torch.manual_seed(0)
    model = MODELS["llama"]()
    hf.save_pretrained(torch.compile(model), tmp_path / "m")
    assert_same(hf.from_pretrained(type(model), tmp_path / "m"), model.eval())


def test_disable_leaves_another_library_s_save_pretrained(tmp_path: Path) -> None:
    cls = transformers.PreTrainedModel
    original = cls.save_pretrained
    hf.enable()
    try:
        def theirs(self: Any, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("not called")

        cls.save_pretrained = theirs
        hf.disable()
        assert cls.save_pretrained is theirs
    finally:
        cls.save_pretrained = original
        hf.disable()
    assert cls.save_pretrained is original


def test_after_disable_a_hook_over_ours_saves_as_transformers(tmp_path: Path) -> None:
    """Another library's hook put over ours after enable() calls ours: after disable(), that
    call is transformers' own save (no staging, no checksums of ours)."""
    cls = transformers.PreTrainedModel
    original = cls.save_pretrained
    torch.manual_seed(0)
    model = MODELS["llama"]()
    hf.enable()
    try:
        inner = cls.save_pretrained

        def theirs(self: Any, *args: Any, **kwargs: Any) -> None:
            return inner(self, *args, **kwargs)

        cls.save_pretrained = theirs
        model.save_pretrained(tmp_path / "on")
        hf.disable()
        model.save_pretrained(tmp_path / "off")
    finally:
        cls.save_pretrained = original
        hf.disable()
    from safetensors import safe_open

    def ours(d: Path) -> bool:
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            return any(k.startswith("tensortier.") for k in (f.metadata() or {}))

    assert (ours(tmp_path / "on"), ours(tmp_path / "off")) == (True, False)


def saved_with_a_folder(tmp_path: Path) -> tuple[Any, Path]:
    """A model saved into tmp_path/m, which holds a folder "logs": (model, directory)."""
    torch.manual_seed(0)
    model = MODELS["llama"]()
    hf.save_pretrained(model, tmp_path / "m")
    (tmp_path / "m" / "logs").mkdir()
    return model, tmp_path / "m"


def test_another_process_working_in_the_directory_keeps_it(tmp_path: Path) -> None:
    """A process whose working directory is the model's (a logger, a shell) would be left in a
    removed folder by a swap: the save writes in place, and the process's relative writes
    still land in the directory."""
    model, out = saved_with_a_folder(tmp_path)
    for cwd in (out, out / "logs"):
        child = subprocess.Popen(
            [sys.executable, "-c",
             "import sys; sys.stdin.readline(); open('after.txt', 'w').write('x')"],
            cwd=cwd, stdin=subprocess.PIPE)
        try:  # Popen returns once the child runs its program, in `cwd`
            hf.save_pretrained(model, out)
            child.communicate(b"go\n", timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        assert child.returncode == 0 and (cwd / "after.txt").read_text() == "x"
    assert_same(hf.from_pretrained(type(model), out), model.eval())


def test_a_folder_of_the_directory_held_open_keeps_it(tmp_path: Path) -> None:
    """An uploader or watcher working through a folder's descriptor (openat) was left holding a
    removed folder by the swap: its writes failed (ENOENT). The save writes in place."""
    model, out = saved_with_a_folder(tmp_path)
    for held in (out, out / "logs"):
        folder = os.open(held, os.O_RDONLY | os.O_DIRECTORY)
        try:
            hf.save_pretrained(model, out)
            fd = os.open("metrics.json", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=folder)
            os.close(fd)
        finally:
            os.close(folder)
        assert (held / "metrics.json").exists()
    assert_same(hf.from_pretrained(type(model), out), model.eval())


def test_files_written_inside_a_folder_of_the_directory_during_a_save_stay(
        tmp_path: Path) -> None:
    """A log another process appends to a folder the directory already had (runs/), a file it
    makes there, and one with a name that is not UTF-8: all in the new directory."""
    torch.manual_seed(0)
    model = MODELS["llama"]()
    out = tmp_path / "m"
    hf.save_pretrained(model, out)
    (out / "runs").mkdir()
    (out / "runs" / "old.log").write_text("before\n")
    odd = os.fsencode(out / "runs") + b"/caf\xe9.txt"  # Latin-1: not UTF-8
    with open(odd, "wb") as f:
        f.write(b"odd")
    write = hf._transformers_writer(model)

    def write_while_another_process_writes(directory: str, **kwargs: Any) -> None:
        write(directory, **kwargs)
        (out / "runs" / "new.log").write_text("during\n")
        (out / "made").mkdir()
        (out / "made" / "x").write_text("during\n")

    hf._save(model, str(out), write_while_another_process_writes, {})
    assert (out / "runs" / "new.log").read_text() == "during\n"
    assert (out / "made" / "x").read_text() == "during\n"
    assert (out / "runs" / "old.log").read_text() == "before\n"
    with open(odd, "rb") as f:
        assert f.read() == b"odd"
    assert_same(hf.from_pretrained(type(model), out), model.eval())
    assert [n for n in os.listdir(tmp_path) if ".tmp-" in n] == []


def test_an_index_naming_a_tensor_twice_loads_as_transformers_loads_it(
        tmp_path: Path, reads: list[str]) -> None:
    """json.load keeps the last of a key named twice; tensortier's index reader refuses the
    file: transformers reads the checkpoint, rather than a FileNotFoundError."""
    make("llama", tmp_path, "20KB")
    index = tmp_path / "model.safetensors.index.json"
    text = index.read_text()
    name, shard = next(iter(json.loads(text)["weight_map"].items()))
    index.write_text(text.replace('"weight_map": {', f'"weight_map": {{"{name}": "{shard}", ', 1))
    cls = transformers.LlamaForCausalLM
    assert_same(hf.from_pretrained(cls, tmp_path), cls.from_pretrained(tmp_path))


def test_a_failed_save_of_a_symlinked_shard_leaves_the_link(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = MODELS["llama"]()
    out = tmp_path / "m"
    model.save_pretrained(out)
    blob = tmp_path / "blob"
    (out / "model.safetensors").rename(blob)
    (out / "model.safetensors").symlink_to(blob)
    real_save = hf.save

    def failing_save(tensors: Any, path: str, *args: Any, **kwargs: Any) -> None:
        if os.path.dirname(path) != str(out):  # staged: the in-place write is the one to fail
            return real_save(tensors, path, *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf, "save", failing_save)
    plan = {"kind": "error", "errno": errno.EINVAL, "steps": ["exchange"]}
    with pytest.raises(OSError):  # in place (no exchange): the link is written beside
        with_faults(plan, hf.save_pretrained, model, out)
    assert (out / "model.safetensors").is_symlink()
    assert [n for n in os.listdir(out) if ".tmp-" in n] == []
    monkeypatch.setattr(hf, "save", real_save)
    hf.save_pretrained(model, out)
    assert not (out / "model.safetensors").is_symlink()
    assert_same(hf.from_pretrained(type(model), out), model.eval())


def test_an_old_directory_kept_for_what_could_not_move_is_named_to_stay(tmp_path: Path) -> None:
    """A folder another process made in the directory during the save and mounted a file
    system on cannot move into the new directory: the old directory is kept, under a name
    that no removal of killed saves' temporary files takes (a save of another file in the
    parent directory leaves it), and the warning names it."""
    import subprocess as sp

    torch.manual_seed(0)
    model = MODELS["llama"]()
    out = tmp_path / "m"
    hf.save_pretrained(model, out)
    write = hf._transformers_writer(model)
    mnt = out / "mnt"

    def write_while_another_process_mounts(directory: str, **kwargs: Any) -> None:
        write(directory, **kwargs)
        mnt.mkdir()
        done = sp.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                      capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")

    kept: list[Path] = []
    try:
        with pytest.warns(UserWarning, match="could not be moved") as warned:
            hf._save(model, str(out), write_while_another_process_mounts, {})
        kept = [p for p in tmp_path.iterdir() if p.name.startswith("m.previous-")]
        assert len(kept) == 1 and str(kept[0]) in str(warned[0].message), warned[0].message
        assert (kept[0] / "mnt").is_dir() and not [p for p in tmp_path.iterdir()
                                                   if ".tmp-" in p.name]
        assert [p.name for p in kept[0].iterdir()] == ["mnt"]  # not the old model
        assert_same(hf.from_pretrained(type(model), out), model.eval())
        # Another process's save into the parent directory leaves it.
        sp.run([sys.executable, "-c", "import sys, torch, tensortier; "
                "tensortier.save({'w': torch.ones(1)}, sys.argv[1])", str(tmp_path / "o.pt")],
               check=True, timeout=120)
        assert kept[0].is_dir()
    finally:
        for where in [*(k / "mnt" for k in kept), mnt]:
            sp.run(["umount", str(where)], capture_output=True, timeout=60)
