"""Reading a published checkpoint: the index, integrity checks, and boxes of full tensors.

`CheckpointReader(path)` reads the manifest and metadata (metadata checked against its
sha256 in the manifest, its format version against the one this code reads). Before anything is loaded, `verify_box(kind, name, full_box)`
checks that the files holding the stored boxes overlapping `full_box` exist with the
manifest's size, and that the CRC32 of each of those stored boxes matches the index: every
byte that gets loaded was checked, and a rank reads (and checks) only the boxes it needs.
`verify_files()` is the whole-file sha256 check, for tools. `read_into(kind, name, full_box,
out)` fills `out` from every stored box that overlaps `full_box`; `check_covered` proves
beforehand that the stored boxes cover it exactly (each element is stored once, so counting
elements is enough).

Shard files are memory-mapped: a reader touches only the pages of the boxes it needs.
"""
from __future__ import annotations

import json
import zlib
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from megalite.checkpoint.boxes import Box, box_numel, box_shape, box_slices, intersect, relative
from megalite.checkpoint.storage import (DTYPES, FORMAT_VERSION, MANIFEST, METADATA, CheckpointCorruptError,
                                         CheckpointMismatchError, file_sha256)


def _check_format_version(path: Path, metadata: dict) -> None:
    """Refuse a checkpoint written in a newer format than this code reads (before parsing it)."""
    version = metadata.get("format_version") if isinstance(metadata, dict) else None
    if not isinstance(version, int):
        raise CheckpointCorruptError(f"{path / METADATA}: no format_version (not a megalite checkpoint index)")
    if version > FORMAT_VERSION:
        writer = (metadata.get("versions") or {}).get("megalite", "a newer megalite")
        raise CheckpointMismatchError(f"checkpoint {path} has format version {version}, newer than the {FORMAT_VERSION} "
                                      f"this megalite reads; upgrade megalite (it was written by {writer}) or "
                                      f"load an older checkpoint (--load-step)")


class CheckpointReader:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._sized: set[str] = set()  # files whose existence and size were checked
        self._verified_items: set[tuple[str, int]] = set()  # (file, byte offset) whose CRC32 matched
        self._maps: dict[str, np.memmap] = {}
        try:
            self.manifest = json.loads((self.path / MANIFEST).read_text())["files"]
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointCorruptError(f"{self.path / MANIFEST}: unreadable manifest ({exc})") from None
        self.verify_files([METADATA])
        # (kind, name) -> [(box, dtype, file, byte offset, crc32)]
        self.items: dict[tuple[str, str], list] = defaultdict(list)
        try:
            self.metadata = json.loads((self.path / METADATA).read_text())
        except ValueError as exc:
            raise CheckpointCorruptError(f"{self.path / METADATA}: not JSON ({exc})") from None
        _check_format_version(self.path, self.metadata)  # a newer format is refused before it is parsed
        try:
            for kind, name, box, dtype, file, offset, crc in self.metadata["items"]:
                self.items[(kind, name)].append((tuple(tuple(b) for b in box), DTYPES[dtype], file, offset, crc))
        except (ValueError, KeyError, TypeError) as exc:  # checksum fine, content not ours
            raise CheckpointCorruptError(f"{self.path / METADATA}: not a megalite checkpoint index "
                                         f"({type(exc).__name__}: {exc})") from None

    def has(self, kind: str, name: str) -> bool:
        return (kind, name) in self.items

    # ------------------------------------------------------------------ integrity

    def _check_size(self, file: str) -> None:
        if file in self._sized:
            return
        path, expected = self.path / file, self.manifest.get(file)
        if expected is None:
            raise CheckpointCorruptError(f"{path}: not listed in the manifest")
        if not path.exists():
            raise CheckpointCorruptError(f"{path}: file is missing")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointCorruptError(f"{path}: {size} bytes, the manifest says {expected['bytes']} "
                                         f"(truncated or overwritten)")
        self._sized.add(file)

    def verify_files(self, files) -> None:
        """Whole-file check: size and sha256 of each file against the manifest."""
        for file in sorted(set(files)):
            self._check_size(file)
            if file_sha256(self.path / file) != self.manifest[file]["sha256"]:
                raise CheckpointCorruptError(f"{self.path / file}: sha256 mismatch (the file is damaged)")

    def _raw(self, file: str, offset: int, nbytes: int) -> np.ndarray:
        if file not in self._maps:
            self._maps[file] = np.memmap(self.path / file, dtype=np.uint8, mode="c")  # copy-on-write: writable
        return self._maps[file][offset:offset + nbytes]

    def verify_box(self, kind: str, name: str, full_box: Box) -> None:
        """Check the file sizes and the CRC32 of every stored box overlapping `full_box`."""
        for box, dtype, file, offset, crc in self.items.get((kind, name), []):
            if (file, offset) in self._verified_items or intersect(box, full_box) is None:
                continue
            self._check_size(file)
            nbytes = box_numel(box) * torch.empty((), dtype=dtype).element_size()
            if zlib.crc32(self._raw(file, offset, nbytes)) != crc:
                raise CheckpointCorruptError(f"{self.path / file}: checksum mismatch in bytes [{offset}, "
                                             f"{offset + nbytes}) ({kind} of {name!r}); the file is damaged")
            self._verified_items.add((file, offset))

    def check_covered(self, kind: str, name: str, full_box: Box) -> None:
        """Raise CheckpointCorruptError unless stored boxes cover `full_box` exactly (no data read)."""
        covered = sum(box_numel(common) for box, *_ in self.items.get((kind, name), [])
                      if (common := intersect(box, full_box)) is not None)
        if covered != box_numel(full_box):
            raise CheckpointCorruptError(f"{self.path}: {kind} of {name!r} covers {covered} of the "
                                         f"{box_numel(full_box)} elements of box {list(full_box)} (incomplete index)")

    # ------------------------------------------------------------------ reading

    def read_into(self, kind: str, name: str, full_box: Box, out: torch.Tensor) -> None:
        """Copy the box `full_box` of the full tensor (kind, name) into `out` (shape of the box)."""
        for box, dtype, file, offset, _ in self.items.get((kind, name), []):
            common = intersect(box, full_box)
            if common is None:
                continue
            if (file, offset) not in self._verified_items:
                raise RuntimeError(f"{self.path / file} [{offset}...] read before verify_box(); verify first")
            nbytes = box_numel(box) * torch.empty((), dtype=dtype).element_size()
            stored = torch.from_numpy(self._raw(file, offset, nbytes)).view(dtype).view(box_shape(box))
            out[box_slices(relative(common, full_box))].copy_(stored[box_slices(relative(common, box))])

    def read_full(self, kind: str, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole full tensor, verified."""
        whole = tuple((0, n) for n in shape)
        self.check_covered(kind, name, whole)
        self.verify_box(kind, name, whole)
        if dtype is None:
            dtype = self.items[(kind, name)][0][1]
        out = torch.empty(shape, dtype=dtype)
        self.read_into(kind, name, whole, out)
        return out

    def close(self) -> None:
        self._maps.clear()
