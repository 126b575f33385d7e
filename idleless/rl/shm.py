"""Named tensors handed to another process through one shared-memory file (the HTTP path of
``/update_weights_from_tensor`` on CPU): the weights never travel over the socket, only a JSON
handle (the file's path and each tensor's name, dtype, shape and byte offset).

Trainer side: ``SharedTensors.create(named_tensors)`` writes the tensors into a new file under
``/dev/shm`` (the OS's temporary directory where there is none) and ``payload()`` is the JSON handle;
``write`` rewrites them in place for the next push (no fresh pages to fault in), ``close()`` removes
the file once the engine has answered. Engine side: ``open_shared(path, specs)``
maps the file (copy-on-write, nothing is read until used) and returns views of it, which the weight
loader copies into the parameters. Nothing is unpickled: a handle is plain data, checked before use.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass
from typing import Iterable

import torch

PREFIX = "idleless-shm-"
ALIGN = 64  # byte alignment of every tensor in the file (any dtype's view is aligned)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def shm_dir() -> str:
    """Where shared tensor files go: /dev/shm (RAM-backed) where it exists, else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; ValueError for a dtype the weight paths do not carry."""
    name = str(dtype).replace("torch.", "")
    if name not in DTYPES:
        raise ValueError(f"dtype {name} is not a weight dtype ({', '.join(DTYPES)})")
    return name


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> torch.bfloat16; ValueError for anything else."""
    key = str(name).replace("torch.", "")
    if key not in DTYPES:
        raise ValueError(f"unknown weight dtype {name!r} (one of {', '.join(DTYPES)})")
    return DTYPES[key]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor in a shared file: HF name, dtype name, shape, byte offset from the file's start."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype].itemsize
        for d in self.shape:
            n *= d
        return n


class SharedTensors:
    """Tensors written once into a shared-memory file (trainer side). Use as a context manager or call
    ``close()`` (removes the file; engines that mapped it keep their mapping until they drop it)."""

    def __init__(self, path: str, specs: list[TensorSpec], buf: torch.Tensor):
        self.path = path
        self.specs = specs
        self.buf = buf  # uint8 [file size], mapped shared: writes land in the file

    def matches(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> bool:
        """Whether the tensors have this file's names, dtypes and shapes, in order (``write`` fits)."""
        items = list(named_tensors)
        return len(items) == len(self.specs) and all(
            n == s.name and str(t.dtype).replace("torch.", "") == s.dtype and tuple(t.shape) == s.shape
            for (n, t), s in zip(items, self.specs))

    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Overwrite the file's tensors in place (same names, dtypes and shapes, in order: ``matches``;
        ValueError otherwise). Reusing one file saves the first-touch cost of fresh shared pages."""
        items = [(n, t.detach()) for n, t in named_tensors]
        if not self.matches(items):
            raise ValueError("the tensors differ from the shared file's names, dtypes or shapes")
        for spec, (_, t) in zip(self.specs, items):
            self.buf[spec.offset:spec.offset + spec.nbytes].view(t.dtype).view(spec.shape).copy_(t)

    @classmethod
    def create(cls, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> "SharedTensors":
        """Write (name, tensor) pairs (floating point, any device, contiguous or not) into a new file.
        Raises ValueError for a dtype outside ``DTYPES``."""
        items = [(n, t.detach()) for n, t in named_tensors]
        specs, offset = [], 0
        for name, t in items:
            spec = TensorSpec(name, dtype_name(t.dtype), tuple(int(d) for d in t.shape), offset)
            specs.append(spec)
            offset += -(-spec.nbytes // ALIGN) * ALIGN
        path = os.path.join(shm_dir(), f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
        shared = cls(path, specs, torch.from_file(path, shared=True, size=max(offset, 1), dtype=torch.uint8))
        shared.write(items)
        return shared

    def payload(self) -> dict:
        """The JSON handle: ``{"shm_path": ..., "tensors": [{"name", "dtype", "shape", "offset"}]}``."""
        return {"shm_path": self.path,
                "tensors": [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape), "offset": s.offset}
                            for s in self.specs]}

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "SharedTensors":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_shared(path: str, specs: Iterable[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    """Map a shared tensor file (engine side) and return (name, tensor view) pairs.

    Only files named like ``SharedTensors``' in ``shm_dir()`` are opened. Raises ValueError for
    another path, a missing file, an unknown dtype, a misaligned offset or a tensor past the file's end."""
    real = os.path.realpath(path)
    if os.path.dirname(real) != os.path.realpath(shm_dir()) or not os.path.basename(real).startswith(PREFIX):
        raise ValueError(f"shm_path must be a {PREFIX}* file in {shm_dir()}, got {path!r}")
    if not os.path.isfile(real):
        raise ValueError(f"no shared tensor file at {path!r}")
    size = os.path.getsize(real)
    specs = list(specs)
    for s in specs:
        parse_dtype(s.dtype)
        if s.offset < 0 or s.offset % ALIGN or any(d < 0 for d in s.shape) or s.offset + s.nbytes > size:
            raise ValueError(f"tensor {s.name!r} (offset {s.offset}, {s.nbytes} bytes) does not fit the "
                             f"{size}-byte file {path!r} at a {ALIGN}-byte aligned offset")
    buf = torch.from_file(real, shared=False, size=size, dtype=torch.uint8)
    return [(s.name, buf[s.offset:s.offset + s.nbytes].view(parse_dtype(s.dtype)).view(s.shape)) for s in specs]
