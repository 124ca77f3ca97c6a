"""Read a metrics file (JSON lines from MetricsWriter) that its run may still be appending to.

Pure Python (no torch), so the drill and plotting tools can read a live run's file. A reader that
races the writer can see the first bytes of a line and not yet the rest (on Linux a write to a
regular file becomes visible page by page, and a short copy shows part of a line), so only lines
that end in a newline count; a complete line that is not JSON is a wrong file, and says so.

A writer killed inside a write whose line crosses a page boundary can leave part of a line for
good; the next attempt's writer drops it (`drop_torn_tail`) before appending, so its first record
does not run on from the fragment.
"""
from __future__ import annotations

import json
import os
from pathlib import Path


def read_records(path: str | Path) -> list[dict]:
    """Every complete record in file order; [] when the file does not exist yet."""
    path = Path(path)
    if not path.exists():
        return []
    complete = path.read_text().split("\n")[:-1]  # the last piece is "" or a line still being written
    records = []
    for number, line in enumerate(complete, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{number} is not a JSON object; is this a megalite metrics file?") from None
    return records


def drop_torn_tail(path: str | Path, chunk: int = 1 << 16) -> None:
    """Cut an existing file back to just after its last newline (what follows is a dead writer's
    partial line); a file that ends in a newline, or does not exist, is left alone."""
    if not os.path.exists(path):
        return
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        cut = end
        while cut > 0:  # walk back a chunk at a time to the last newline
            start = max(0, cut - chunk)
            f.seek(start)
            newline = f.read(cut - start).rfind(b"\n")
            if newline >= 0:
                cut = start + newline + 1
                break
            cut = start
        if cut < end:
            f.truncate(cut)
