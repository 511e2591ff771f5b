"""Read safetensors files tensor by tensor with plain reads, reporting progress.

Reads rather than a memory map: a mapping keeps every page it touched resident (and counted in the process's
memory) until it is closed, so converting a checkpoint tensor by tensor through one would still peak at the whole
file. Each tensor here is read into its own buffer, converted, and freed."""
from __future__ import annotations

import ctypes
import json
import logging
import platform
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

logger = logging.getLogger(__name__)
TRIM_EVERY_BYTES = 64 << 20


def release_freed_memory() -> None:
    """Hand glibc's free pages back to the kernel. Loading interleaves kept weights with freed read buffers and
    conversion temporaries, and (above all once the engine raised glibc's thresholds, engine/cpu_malloc.py) the
    holes they leave otherwise stay resident: measured 2 GB beyond 2 GB of int8 weights."""
    if sys.platform == "linux" and platform.libc_ver()[0] == "glibc":
        ctypes.CDLL(None).malloc_trim(0)

# safetensors dtype names -> torch dtypes
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


def read_header(file: Path) -> list[TensorEntry]:
    """The tensors of one safetensors file, in file order; a malformed header names the file and the tensor."""
    with open(file, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        (header_len,) = struct.unpack("<Q", f.read(8)) if size >= 8 else (size,)
        if size < 8 or header_len > size - 8:
            raise ValueError(f"{file} is not a safetensors file (header length {header_len}, file size {size})")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{file}: malformed safetensors header: {e}") from None
    data_start = 8 + header_len
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"{file}: tensor {name!r} has dtype {info.get('dtype')!r}; known: {sorted(DTYPES)}")
        shape = tuple(info["shape"])
        begin, end = info["data_offsets"]
        numel = 1
        for dim in shape:
            numel *= dim
        if end - begin != numel * dtype.itemsize or data_start + end > size:
            raise ValueError(f"{file}: tensor {name!r} has data offsets {[begin, end]} that do not fit {shape}")
        entries.append(TensorEntry(name, dtype, shape, data_start + begin, end - begin))
    return sorted(entries, key=lambda e: e.offset)


class LoadProgress:
    """Shards and bytes read: a tqdm bar on a terminal, a log line per shard and per tenth of the bytes otherwise."""

    def __init__(self, total_bytes: int, num_files: int) -> None:
        self.total, self.done, self.num_files = total_bytes, 0, num_files
        self.next_log = total_bytes / 10
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="loading weights", leave=False)

    def start_file(self, index: int, file: Path) -> None:
        text = f"shard {index + 1}/{self.num_files}: {file.name}"
        if self.bar is not None:
            self.bar.set_description(text)
        else:
            logger.info("loading %s", text)

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
        elif self.done >= self.next_log:
            logger.info("loaded %.2f of %.2f GB (%d%%)", self.done / 1e9, self.total / 1e9,
                        100 * self.done // max(self.total, 1))
            self.next_log += self.total / 10

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def read_tensors(files: list[Path], wanted: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every `wanted` tensor of `files`, in file order, each in its own CPU buffer."""
    entries = [[e for e in read_header(file) if wanted(e.name)] for file in files]
    progress = LoadProgress(sum(e.nbytes for file_entries in entries for e in file_entries), len(files))
    since_trim = 0
    try:
        for index, (file, file_entries) in enumerate(zip(files, entries)):
            progress.start_file(index, file)
            with open(file, "rb", buffering=0) as f:
                for entry in file_entries:
                    yield entry.name, _read(f, entry, file)  # the consumer converts it before asking for the next
                    progress.advance(entry.nbytes)
                    since_trim += entry.nbytes
                    if since_trim >= TRIM_EVERY_BYTES:
                        release_freed_memory()
                        since_trim = 0
    finally:
        progress.close()
        release_freed_memory()


def _read(f, entry: TensorEntry, file: Path) -> torch.Tensor:
    buffer = torch.empty(entry.nbytes, dtype=torch.uint8)
    f.seek(entry.offset)
    view, done = memoryview(buffer.numpy()), 0
    while done < entry.nbytes:  # a raw read may return fewer bytes than asked
        n = f.readinto(view[done:])
        if not n:
            raise ValueError(f"{file}: tensor {entry.name!r} is cut short ({done} of {entry.nbytes} bytes)")
        done += n
    return buffer.view(entry.dtype).view(entry.shape)
