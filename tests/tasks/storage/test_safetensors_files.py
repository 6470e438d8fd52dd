"""safetensors files written from the tensors' memory: the bytes safetensors' own save_file writes."""

import errno
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ppoflow.tasks.storage.safetensors_files import DTYPE_NAMES, read_header, streamable, write_safetensors


def _tensors(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(6, 5, generator=generator) * 20
    if dtype == torch.bool:
        return {"b.mask": values > 0, "a.flag": torch.tensor(True)}
    return {
        "layer.1.weight": values.to(dtype).clone(),
        "layer.0.weight": values.t().to(dtype).clone(),  # transposed: not contiguous
        "layer.0.bias": values[0].to(dtype).clone(),
        "scale": torch.tensor(3).to(dtype),  # no dimensions
        "empty": torch.zeros(0, 4, dtype=dtype),
    }


@pytest.mark.parametrize("dtype", list(DTYPE_NAMES), ids=[DTYPE_NAMES[d] for d in DTYPE_NAMES])
@pytest.mark.parametrize("metadata", [None, {"format": "pt"}], ids=["bare", "metadata"])
def test_the_file_is_the_one_save_file_writes(tmp_path, dtype, metadata):
    tensors = _tensors(dtype)
    assert dtype == torch.bool or not tensors["layer.0.weight"].is_contiguous()
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    write_safetensors(ours, tensors, metadata)
    save_file({name: t.contiguous() for name, t in tensors.items()}, theirs, metadata=metadata)
    assert ours.read_bytes() == theirs.read_bytes()
    loaded = load_file(ours)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors.items())


def test_what_it_does_not_write_as_save_file_would_is_refused(tmp_path):
    one = torch.ones(4)
    refused = {
        "two dtypes": {"a": one, "b": one.to(torch.float16)},  # save_file orders them by dtype first
        "shared memory": {"a": one, "b": one[:2]},
        "a name that is not ASCII": {"größe": one},
        "a complex dtype": {"a": torch.ones(2, dtype=torch.complex64)},
        "a name with DEL": {"a\x7f": one},  # Python's JSON escapes it, safetensors' does not
        "a sparse tensor": {"a": one.to_sparse()},
        "a tensor without memory": {"a": torch.empty(4, device="meta")},
    }
    for case, tensors in refused.items():
        assert not streamable(tensors), case
        with pytest.raises(ValueError, match="one dtype"):
            write_safetensors(tmp_path / "x.safetensors", tensors, None)
    for metadata in ({"note": "é"}, {"é": "pt"}, {"note": "\x7f"}):  # save_file writes them unescaped
        assert not streamable({"a": one}, metadata)
        with pytest.raises(ValueError, match="ASCII"):
            write_safetensors(tmp_path / "x.safetensors", {"a": one}, metadata)
    assert streamable({"a": one, "b": torch.zeros(3)})
    empty = {"a": torch.zeros(0), "b": torch.zeros(0, 3), "c": one}  # no memory to share
    assert streamable(empty)
    write_safetensors(tmp_path / "ours.safetensors", empty, None)
    save_file(empty, tmp_path / "theirs.safetensors")
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()


def test_a_failed_write_names_the_file():
    with pytest.raises(OSError, match="/dev/full") as failure:
        write_safetensors(Path("/dev/full"), {"a": torch.ones(1 << 16)}, None)
    assert failure.value.errno == errno.ENOSPC


def test_sorted_keys_are_the_header_save_file_writes_once_sorted(tmp_path):
    """Several metadata keys (save_file orders them differently in every process) and every level's
    keys sorted: the file the optimizer state's writer makes of save_file's (optimizer_state.py)."""
    from ppoflow.tasks.storage.optimizer_state import _sort_header

    tensors = _tensors(torch.float32)
    metadata = {"format": "pt", "DCP_VERSION": "1.0", "note": 'a "quoted" value'}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    write_safetensors(ours, tensors, metadata, sort_keys=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, theirs, metadata=metadata)
    _sort_header(theirs)
    assert ours.read_bytes() == theirs.read_bytes()


def test_the_header_is_read_back_and_a_file_without_one_is_none(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_file({"w": torch.ones(2, 3)}, path, metadata={"format": "pt"})
    with open(path, "rb") as stream:
        length, header = read_header(stream)
        assert stream.tell() == 8 + length  # left at the first tensor's bytes
    assert length == int.from_bytes(path.read_bytes()[:8], "little")
    assert header == {
        "__metadata__": {"format": "pt"},
        "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
    }
    for name, data in {
        "empty": b"",
        "zero length": (0).to_bytes(8, "little"),
        "too long": (100_000_001).to_bytes(8, "little"),
        "not JSON": (4).to_bytes(8, "little") + b"{no}",
        "a JSON list": (2).to_bytes(8, "little") + b"[]",
    }.items():
        (tmp_path / name).write_bytes(data)
        with open(tmp_path / name, "rb") as stream:
            assert read_header(stream) is None, name
