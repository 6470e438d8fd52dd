"""safetensors files written, or hashed, chunk by chunk from the tensors' own memory.

`write_safetensors` writes the header and then each tensor's bytes, in the order and with the header
`safetensors.torch.save_file` uses when all tensors share a dtype (name order; the data offsets of
that order), so the two files are equal byte for byte (tests/tasks/storage/test_safetensors_files.py).
`save_file` (0.8) writes from the tensors' memory too; what this adds: the same bytes can be hashed
without writing them (`safetensors_chunks`: how pretrained_files.py checks a first save), a header
with every level's keys sorted is written at once (the optimizer state's; `save_file`'s is rewritten
afterwards), and less set-up per call (the tiny model's 1.8 MB of weights: 1.87 ms against 2.06 ms).
Tensors of several dtypes, which `save_file` orders by dtype first, are left to `save_file`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import torch

DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
"""The dtypes written here, by their safetensors names."""


def streamable(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bool:
    """Whether `write_safetensors` writes these as `save_file` would: ASCII names and metadata without
    DEL (Python's JSON escapes that and non-ASCII text, safetensors' does not), one dtype of
    DTYPE_NAMES, every tensor on the CPU, dense, and none sharing memory with another."""
    texts = [*tensors, *(metadata or {}).keys(), *(metadata or {}).values()]
    if not all(isinstance(text, str) and text.isascii() and "\x7f" not in text for text in texts):
        return False
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPE_NAMES:
        return False
    if not all(t.device.type == "cpu" and t.layout == torch.strided for t in tensors.values()):
        return False
    pointers = [t.untyped_storage().data_ptr() for t in tensors.values() if t.numel()]
    return len(set(pointers)) == len(pointers)


def safetensors_header(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None, *, sort_keys: bool = False
) -> bytes:
    """The header `save_file` writes for `tensors` (one dtype, in name order): its length as 8 bytes
    little-endian, then the JSON padded with spaces to a multiple of 8. The metadata's keys are in
    sorted order (`save_file` writes several in an order that varies from one process to the next);
    with `sort_keys`, every level's keys are (the length, and so the padding, is the same)."""
    header: dict = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":"), sort_keys=sort_keys).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


MAX_HEADER_BYTES = 100_000_000
"""safetensors' own limit on a header's length (its loader refuses a longer one)."""


def read_header(stream: BinaryIO) -> tuple[int, dict] | None:
    """(length, JSON object) of the safetensors header at the start of `stream`, which is left just
    after it; None when the file does not start with one (a length out of range, text that is not a
    JSON object)."""
    length = int.from_bytes(stream.read(8), "little")
    if not 0 < length <= MAX_HEADER_BYTES:
        return None
    try:
        header = json.loads(stream.read(length))
    except ValueError:
        return None
    return (length, header) if isinstance(header, dict) else None


def safetensors_chunks(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None, *, sort_keys: bool = False
) -> Iterator[bytes | memoryview]:
    """The bytes of the file `save_file` writes for `tensors` (see `streamable`; checked before the
    first chunk is asked for), in order: the header, then each tensor's bytes as a view of its own
    memory."""
    if not streamable(tensors, metadata):
        raise ValueError(
            "safetensors files are streamed from CPU tensors of one dtype that share no memory, "
            "with ASCII names and metadata"
        )
    return _chunks(tensors, metadata, sort_keys)


def _chunks(tensors, metadata, sort_keys: bool) -> Iterator[bytes | memoryview]:
    yield safetensors_header(tensors, metadata, sort_keys=sort_keys)
    for name in sorted(tensors):
        tensor = tensors[name].detach()
        if tensor.numel():
            yield memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def write_safetensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None, *, sort_keys: bool = False
) -> None:
    """Write `tensors` (see `streamable`) to `path` as `save_file` would, each from its own memory. A
    failed write (a full disk) names the file."""
    chunks = safetensors_chunks(tensors, metadata, sort_keys=sort_keys)
    try:
        with open(path, "wb") as stream:
            for chunk in chunks:
                stream.write(chunk)
    except OSError as error:
        if error.errno is None or error.filename is not None:
            raise
        raise type(error)(error.errno, error.strerror, str(path)) from error
