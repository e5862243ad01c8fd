"""Archive segments: the Parquet files and the ``manifest.json`` of an archive directory (``tracker archive``).

A segment holds whole sessions, one row per event, in typed columns (``SEGMENT_SCHEMA``: the
event's ``data`` is its canonical JSON text, ``tracker.store.chain.canonical_json``), zstd
compressed. ``manifest.json`` lists every segment (``sha256``, ``events``, ``sessions``, the
position range) and every archived session (its segment, final version, event count, position
range, chain head and the digest of its folded state).

Every file is written durably: to a temporary name in the same directory, flushed and fsynced,
renamed over its final name, and the directory fsynced; so a reader (or a run after a kill -9)
sees either the old file or the new one, never a torn one. Writers of one directory take its
``.lock`` (an advisory ``flock``) around a manifest's read-modify-write.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tracker.errors import InvalidInput

__all__ = [
    "MANIFEST",
    "SEGMENT_SCHEMA",
    "Segment",
    "directory_lock",
    "file_sha256",
    "read_manifest",
    "read_segment",
    "write_manifest",
    "write_segment",
]

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1

#: one row per event
SEGMENT_SCHEMA = pa.schema(
    [
        pa.field("session_id", pa.string(), nullable=False),
        pa.field("version", pa.int32(), nullable=False),
        pa.field("position", pa.int64(), nullable=False),
        pa.field("type", pa.string(), nullable=False),
        pa.field("data", pa.string(), nullable=False),  # canonical JSON text
        pa.field("recorded_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("idempotency_key", pa.string()),
        pa.field("batch_size", pa.int32()),
        pa.field("hash", pa.binary()),  # None: an unchained row
    ]
)
COLUMNS = tuple(SEGMENT_SCHEMA.names)


@dataclass
class Segment:
    """The columns of a segment, as Python lists (built column-wise, in (session, version) order)."""

    session_id: list[str]
    version: list[int]
    position: list[int]
    type: list[str]
    data: list[str]
    recorded_at: list[datetime]
    idempotency_key: list[str | None]
    batch_size: list[int | None]
    hash: list[bytes | None]

    @classmethod
    def empty(cls) -> Segment:
        return cls([], [], [], [], [], [], [], [], [])

    def __len__(self) -> int:
        return len(self.version)

    def table(self) -> pa.Table:
        return pa.Table.from_arrays(
            [pa.array(getattr(self, n), SEGMENT_SCHEMA.field(n).type) for n in COLUMNS], schema=SEGMENT_SCHEMA
        )


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _durable_replace(tmp: Path, final: Path) -> None:
    with tmp.open("rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def write_segment(directory: Path, name: str, segment: Segment) -> Path:
    """``segment`` written durably as ``directory/name`` (zstd)."""
    final = directory / name
    tmp = directory / f".{name}.tmp"
    pq.write_table(segment.table(), tmp, compression="zstd", row_group_size=256 * 1024)
    _durable_replace(tmp, final)
    return final


def read_segment(path: Path) -> pa.Table:
    """The segment's table, its columns checked against ``SEGMENT_SCHEMA``."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise InvalidInput("segment", f"cannot read {path.name}: {exc}") from None
    if table.schema.names != list(COLUMNS):
        raise InvalidInput("segment", f"{path.name} has columns {table.schema.names}, not {list(COLUMNS)}")
    return table


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(directory: Path) -> dict[str, Any]:
    """The directory's manifest (an empty one when there is none yet)."""
    path = directory / MANIFEST
    if not path.exists():
        return {"format": MANIFEST_FORMAT, "segments": {}, "sessions": {}}
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidInput("archive", f"cannot read {path}: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise InvalidInput("archive", f"{path} is not a format-{MANIFEST_FORMAT} archive manifest")
    return manifest


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """``manifest`` written durably as ``directory/manifest.json``."""
    tmp = directory / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8")
    _durable_replace(tmp, directory / MANIFEST)


@contextlib.contextmanager
def directory_lock(directory: Path) -> Iterator[None]:
    """The archive directory's writer lock (an advisory ``flock`` on ``directory/.lock``)."""
    with (directory / ".lock").open("a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
