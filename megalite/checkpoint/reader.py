"""Reading a published checkpoint: the index, checksums, and boxes of full tensors.

`CheckpointReader(path)` reads the manifest and metadata (metadata checked against its
sha256 in the manifest). `verify(files)` streams the named shard files through sha256 and
compares sizes and digests with the manifest: call it on the files a rank is about to read
(`files_for`), so every byte that gets loaded was checked, and a reader at tp=1 never hashes
nothing it does not read. `read_into(kind, name, full_box, out)` fills `out` from every stored
box that overlaps `full_box` and raises CheckpointCorruptError unless the stored boxes cover
it exactly (each element is stored once, so counting elements proves coverage).

Shard files are memory-mapped: a reader touches only the pages of the boxes it copies.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from megalite.checkpoint.boxes import Box, box_numel, box_shape, box_slices, intersect, relative
from megalite.checkpoint.storage import DTYPES, MANIFEST, METADATA, CheckpointCorruptError, file_sha256


class CheckpointReader:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._verified: set[str] = set()
        self._maps: dict[str, np.memmap] = {}
        try:
            self.manifest = json.loads((self.path / MANIFEST).read_text())["files"]
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointCorruptError(f"{self.path / MANIFEST}: unreadable manifest ({exc})") from None
        self.verify([METADATA])
        # (kind, name) -> [(box, dtype, file, byte offset)]
        self.items: dict[tuple[str, str], list] = defaultdict(list)
        try:
            self.metadata = json.loads((self.path / METADATA).read_text())
            for kind, name, box, dtype, file, offset in self.metadata["items"]:
                self.items[(kind, name)].append((tuple(tuple(b) for b in box), DTYPES[dtype], file, offset))
        except (ValueError, KeyError, TypeError) as exc:  # checksum fine, content not ours
            raise CheckpointCorruptError(f"{self.path / METADATA}: not a megalite checkpoint index "
                                         f"({type(exc).__name__}: {exc})") from None

    def has(self, kind: str, name: str) -> bool:
        return (kind, name) in self.items

    def files_for(self, kind: str, name: str, full_box: Box) -> set[str]:
        return {file for box, _, file, _ in self.items.get((kind, name), []) if intersect(box, full_box) is not None}

    def verify(self, files) -> None:
        """Check size and sha256 of each file against the manifest (once per file per reader)."""
        for file in sorted(set(files) - self._verified):
            path = self.path / file
            expected = self.manifest.get(file)
            if expected is None:
                raise CheckpointCorruptError(f"{path}: not listed in the manifest")
            if not path.exists():
                raise CheckpointCorruptError(f"{path}: file is missing")
            size = path.stat().st_size
            if size != expected["bytes"]:
                raise CheckpointCorruptError(f"{path}: {size} bytes, the manifest says {expected['bytes']} "
                                             f"(truncated or overwritten)")
            if file_sha256(path) != expected["sha256"]:
                raise CheckpointCorruptError(f"{path}: sha256 mismatch (the file is damaged)")
            self._verified.add(file)

    def _stored(self, file: str, dtype: torch.dtype, offset: int, box: Box) -> torch.Tensor:
        if file not in self._verified:
            raise RuntimeError(f"{self.path / file} was not verified before reading; call verify() first")
        if file not in self._maps:
            self._maps[file] = np.memmap(self.path / file, dtype=np.uint8, mode="c")  # copy-on-write: writable
        nbytes = box_numel(box) * torch.empty((), dtype=dtype).element_size()
        raw = torch.from_numpy(self._maps[file][offset:offset + nbytes])
        return raw.view(dtype).view(box_shape(box))

    def check_covered(self, kind: str, name: str, full_box: Box) -> None:
        """Raise CheckpointCorruptError unless stored boxes cover `full_box` exactly (no data read)."""
        covered = sum(box_numel(common) for box, *_ in self.items.get((kind, name), [])
                      if (common := intersect(box, full_box)) is not None)
        if covered != box_numel(full_box):
            raise CheckpointCorruptError(f"{self.path}: {kind} of {name!r} covers {covered} of the "
                                         f"{box_numel(full_box)} elements of box {list(full_box)} (incomplete index)")

    def read_into(self, kind: str, name: str, full_box: Box, out: torch.Tensor) -> None:
        """Copy the box `full_box` of the full tensor (kind, name) into `out` (shape of the box)."""
        covered = 0
        for box, dtype, file, offset in self.items.get((kind, name), []):
            common = intersect(box, full_box)
            if common is None:
                continue
            source = self._stored(file, dtype, offset, box)[box_slices(relative(common, box))]
            out[box_slices(relative(common, full_box))].copy_(source)
            covered += box_numel(common)
        if covered != box_numel(full_box):
            raise CheckpointCorruptError(f"{self.path}: {kind} of {name!r} covers {covered} of the "
                                         f"{box_numel(full_box)} elements of box {list(full_box)} (incomplete index)")

    def read_full(self, kind: str, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole full tensor (verifies the files it needs)."""
        whole = tuple((0, n) for n in shape)
        self.verify(self.files_for(kind, name, whole))
        if dtype is None:
            dtype = self.items[(kind, name)][0][1] if self.has(kind, name) else torch.float32
        out = torch.empty(shape, dtype=dtype)
        self.read_into(kind, name, whole, out)
        return out

    def close(self) -> None:
        self._maps.clear()
