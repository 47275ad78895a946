"""Which episodes a run keeps, and the compact files they are kept in.

Why: a run plays far more episodes than anyone opens. The 600-step quickstart plays ~156k;
keeping every one in memory and as a line of JSON cost ~82 MB a run and grew without bound,
while what a person looks at is a failure, a truncation, or a few typical episodes of some step.

Which episodes are kept (`RecordPolicy`, `Selection`), `Session.train(record=...)`:

- "sample" (the default): every failed or truncated episode, plus a uniform sample of
  `per_step` (default 8) of the others from each step's pool. The pool is every episode that
  finished between two metrics rows, i.e. one (policy, step); reservoir sampling picks the
  sample without holding the pool (seeded, so a rerun keeps the same ones).
- "all": every episode.
- "none": only failed and truncated episodes.

Whatever the mode, the last `recent` episodes played stay in memory (`run.recent_episodes`)
and every episode is still announced to observers as it finishes.

How the kept episodes are stored, in the run's folder:

- `episodes.jsonl.zst`: independent zstd frames (content checksums on). A frame holds the
  JSON lines (`Episode.to_json()`) of the episodes kept since the frame before, in completion
  order: one frame per metrics row, one when the run closes, and in "all" and "none" modes one
  whenever `recent` episodes are waiting (a sample is only known when its pool closes, so
  "sample" holds a pool's failed and truncated episodes until its row). Concatenated zstd
  frames are one valid zstd stream, so `zstdcat episodes.jsonl.zst` prints plain JSON lines.
- `episodes.index`: the 8 bytes `ABEPIX1\\n`, then one 16-byte little-endian entry per frame:
  byte offset (u64), compressed length (u32), number of episodes (u32). Reading episode i
  bisects the running counts, seeks, and decompresses that one frame (`FrameTable`,
  `FrameReader`).
- A crash loses the pool not yet written (as metrics.jsonl loses the row not yet written) and
  at most the frame being written. A frame is written and flushed before its
  index entry; a reader trusts the entries that lie inside the data file, then scans the bytes
  after the last one for whole frames (a crash between the two writes loses nothing), and
  stops at the first torn or damaged frame. A damaged frame in the middle fails only the
  episodes in it (`DamagedRecord`).

This module knows bytes and JSON only; `recorder.EpisodeLog` turns lines into Episodes.
"""

from __future__ import annotations

import bisect
import json
import random
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol, TypeVar

import zstandard

from ..errors import AstranbError
from .folder import (
    EPISODES_DISCARDED_FILE,
    EPISODES_FILE,
    EPISODES_INDEX_FILE,
    append_synced,
    atomic_write_bytes,
)

__all__ = [
    "MODES", "DamagedRecord", "Frame", "FrameReader", "FrameTable", "FrameWriter",
    "RecordPolicy", "Selection", "load_frames", "reservoir_slot", "set_aside_episodes",
]

MODES = ("sample", "all", "none")
LEVEL = 9  # small frames compress in well under a millisecond even at this level
_MAGIC = b"ABEPIX1\n"
_ENTRY = struct.Struct("<QII")
_SCAN_CHUNK = 1 << 16


class DamagedRecord(AstranbError, ValueError):
    """A frame of an episode record cannot be read (torn or overwritten bytes)."""


# -- which episodes are kept -----------------------------------------------------------------------
@dataclass(frozen=True)
class RecordPolicy:
    """What a run keeps of its episodes (see the module docstring); validated on creation."""

    mode: str = "sample"
    per_step: int = 8
    """"sample": episodes kept per step besides the failed and truncated ones."""
    recent: int = 256
    """Episodes kept in memory: the last ones played, and the last ones kept."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(
                f"record={self.mode!r} is not a record mode; use \"sample\" (failed and "
                f"truncated episodes plus record_per_step a step, the default), \"all\" (every "
                f"episode) or \"none\" (failed and truncated episodes only)")
        if isinstance(self.per_step, bool) or not isinstance(self.per_step, int) \
                or self.per_step < 1:
            raise ValueError(f"record_per_step={self.per_step!r}: keep at least 1 episode a step "
                             "(record=\"none\" keeps only failed and truncated ones)")
        if isinstance(self.recent, bool) or not isinstance(self.recent, int) or self.recent < 1:
            raise ValueError(f"recent={self.recent!r}: keep at least 1 episode in memory")

    def describe(self) -> str:
        return {"sample": f"record='sample': failed and truncated episodes, {self.per_step} "
                          "others a step",
                "all": "record='all': every episode",
                "none": "record='none': failed and truncated episodes"}[self.mode]


class Recordable(Protocol):
    @property
    def index(self) -> int: ...
    @property
    def error(self) -> str | None: ...
    @property
    def truncated(self) -> str | None: ...


T = TypeVar("T", bound=Recordable)


def always_kept(item: Recordable) -> bool:
    """Failed and truncated episodes are kept in every mode: they are what gets debugged."""
    return item.error is not None or item.truncated is not None


def reservoir_slot(seen: int, k: int, rng: random.Random) -> int | None:
    """Where the `seen`-th item (1-based) of a stream goes in a uniform sample of k (Algorithm
    R): slot seen-1 while the sample fills, then slot j with probability k/seen, else None."""
    if seen <= k:
        return seen - 1
    j = rng.randrange(seen)
    return j if j < k else None


class Selection:
    """The kept episodes of the current pool: `offer` each one as it finishes, `take` them (in
    completion order) when the pool closes (a metrics row, or the run's end)."""

    def __init__(self, policy: RecordPolicy, seed: int = 0):
        self.policy = policy
        self._rng = random.Random(seed)
        self._kept: list[Any] = []
        self._sample: list[Any] = []
        self._seen = 0

    def offer(self, item: T) -> None:
        if self.policy.mode == "all" or always_kept(item):
            self._kept.append(item)
            return
        if self.policy.mode == "none":
            return
        self._seen += 1
        slot = reservoir_slot(self._seen, self.policy.per_step, self._rng)
        if slot == len(self._sample):
            self._sample.append(item)
        elif slot is not None:
            self._sample[slot] = item

    @property
    def pending(self) -> int:
        return len(self._kept) + len(self._sample)

    def take(self) -> list[Any]:
        """The pool's kept items in completion order; the next pool starts empty."""
        items = sorted(self._kept + self._sample, key=lambda item: item.index)
        self._kept, self._sample, self._seen = [], [], 0
        return items


# -- frames ----------------------------------------------------------------------------------------
class Frame(NamedTuple):
    offset: int
    length: int
    episodes: int

    @property
    def end(self) -> int:
        return self.offset + self.length


def encode_frame(lines: Sequence[bytes], level: int = LEVEL) -> bytes:
    """One zstd frame of JSON lines (each ending in a newline), with a content checksum."""
    compressor = zstandard.ZstdCompressor(level=level, write_checksum=True)
    return compressor.compress(b"".join(lines))


def decode_frame(data: bytes) -> list[bytes]:
    """The JSON lines of one frame (raises zstandard.ZstdError on damaged bytes)."""
    return zstandard.ZstdDecompressor().decompress(data).splitlines()


def parse_index(data: bytes) -> list[Frame]:
    """The frames an index file lists (a torn last entry is left out; an unknown file: none)."""
    if not data.startswith(_MAGIC):
        return []
    body = data[len(_MAGIC):]
    whole = len(body) - len(body) % _ENTRY.size
    return [Frame(*entry) for entry in _ENTRY.iter_unpack(body[:whole])]


def trusted(frames: Sequence[Frame], size: int) -> list[Frame]:
    """The leading frames that follow each other and lie inside a data file of `size` bytes."""
    out: list[Frame] = []
    end = 0
    for frame in frames:
        if frame.offset < end or frame.end > size or frame.episodes < 1:
            break
        out.append(frame)
        end = frame.end
    return out


def scan_frames(path: Path, start: int, size: int) -> list[Frame]:
    """Whole zstd frames from byte `start` on, found without an index; stops at the first torn
    or damaged one (what a writer killed mid-frame leaves behind)."""
    frames: list[Frame] = []
    with open(path, "rb") as f:
        offset = start
        while offset < size:
            f.seek(offset)
            frame = _scan_one(f, offset)
            if frame is None:
                break
            frames.append(frame)
            offset = frame.end
    return frames


def _scan_one(f: Any, offset: int) -> Frame | None:
    decoder = zstandard.ZstdDecompressor().decompressobj()
    read = lines = 0
    try:
        while not decoder.eof:
            chunk = f.read(_SCAN_CHUNK)
            if not chunk:
                return None  # torn: the file ends inside the frame
            lines += decoder.decompress(chunk).count(b"\n")
            read += len(chunk)
    except zstandard.ZstdError:
        return None
    length = read - len(decoder.unused_data)
    return Frame(offset, length, lines) if lines else None


def load_frames(directory: Path) -> list[Frame]:
    """Every readable frame of a folder's record: the trusted index entries, then whole frames
    found after them."""
    data, index = directory / EPISODES_FILE, directory / EPISODES_INDEX_FILE
    if not data.exists():
        return []
    size = data.stat().st_size
    frames = trusted(parse_index(index.read_bytes()) if index.exists() else [], size)
    return frames + scan_frames(data, frames[-1].end if frames else 0, size)


class FrameTable:
    """Frames and where each starts in the list of kept episodes; append-only, so a reader can
    locate any position below a total it saw while frames are added."""

    def __init__(self, frames: Sequence[Frame] = ()):
        self.frames: list[Frame] = []
        self.starts: list[int] = []
        self.total = 0
        for frame in frames:
            self.add(frame)

    def add(self, frame: Frame) -> None:
        self.frames.append(frame)
        self.starts.append(self.total)
        self.total += frame.episodes

    def locate(self, position: int) -> tuple[int, int]:
        """(frame number, line within it) of a kept position, 0 <= position < total."""
        i = bisect.bisect_right(self.starts, position) - 1
        return i, position - self.starts[i]


class FrameReader:
    """Reads frames of one data file on demand, keeping the last few decoded (a loop over
    episodes decodes each frame once)."""

    def __init__(self, path: Path, keep: int = 2):
        self.path = path
        self._keep = keep
        self._cache: OrderedDict[int, list[bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def lines(self, frame: Frame) -> list[bytes]:
        with self._lock:
            if frame.offset in self._cache:
                self._cache.move_to_end(frame.offset)
                return self._cache[frame.offset]
        with open(self.path, "rb") as f:
            f.seek(frame.offset)
            data = f.read(frame.length)
        try:
            lines = decode_frame(data) if len(data) == frame.length else None
        except zstandard.ZstdError:
            lines = None
        if lines is None or len(lines) != frame.episodes:
            raise DamagedRecord(
                f"{self.path}: the frame at byte {frame.offset} ({frame.episodes} episodes) is "
                "damaged or cut short; the other frames are still readable")
        with self._lock:
            self._cache[frame.offset] = lines
            while len(self._cache) > self._keep:
                self._cache.popitem(last=False)
        return lines


class FrameWriter:
    """Appends frames and their index entries to a folder's record. An existing record (a run
    folder written to again) is continued after its last readable frame, and its index is
    rewritten first if it lacks frames a crash left unindexed."""

    def __init__(self, directory: Path, level: int = LEVEL):
        self.data_path = directory / EPISODES_FILE
        self.index_path = directory / EPISODES_INDEX_FILE
        self.level = level
        frames = load_frames(directory)
        self.table = FrameTable(frames)
        index = self.index_path.read_bytes() if self.index_path.exists() else b""
        if index != _MAGIC + b"".join(_ENTRY.pack(*f) for f in frames):
            atomic_write_bytes(self.index_path, _MAGIC + b"".join(_ENTRY.pack(*f) for f in frames))
        self._data = open(self.data_path, "ab")
        self._index = open(self.index_path, "ab")
        self._end = self.data_path.stat().st_size

    def write(self, lines: Sequence[bytes]) -> Frame:
        """Write one frame of JSON lines; data first, then the index entry, both flushed."""
        blob = encode_frame(lines, self.level)
        frame = Frame(self._end, len(blob), len(lines))
        self._data.write(blob)
        self._data.flush()
        self._index.write(_ENTRY.pack(*frame))
        self._index.flush()
        self._end = frame.end
        self.table.add(frame)
        return frame

    def close(self) -> None:
        for f in (self._data, self._index):
            if not f.closed:
                f.close()

    @property
    def closed(self) -> bool:
        return self._data.closed


def set_aside_episodes(directory: Path, keep: Callable[[dict[str, Any]], bool]) -> int:
    """Move the recorded episodes that `keep` refuses out of a folder's record, into
    `episodes.discarded.jsonl.zst` (zstd frames of the same JSON lines, appended); returns how
    many moved. What a resumed run does with the episodes of steps it trains again.

    The record is rewritten whole (frames before the first change byte for byte) into a
    temporary file renamed over it; the index is removed first and written last, so a crash
    leaves a record that `load_frames` scans. A damaged frame stops the work: nothing is moved.
    """
    frames = load_frames(directory)
    if not frames:
        return 0
    reader = FrameReader(directory / EPISODES_FILE)
    blobs: list[tuple[bytes, int]] = []  # the new record's frames and their episode counts
    moved: list[bytes] = []
    changed = False
    with open(directory / EPISODES_FILE, "rb") as record:
        for frame in frames:
            lines = reader.lines(frame)
            kept: list[bytes] = []
            for line in lines:  # each line parsed once: the record may hold many episodes
                (kept if keep(json.loads(line)) else moved).append(line)
            changed = changed or len(kept) != len(lines)
            if kept and not changed:
                record.seek(frame.offset)
                blobs.append((record.read(frame.length), len(kept)))
            elif kept:
                blobs.append((encode_frame([line + b"\n" for line in kept]), len(kept)))
    if not moved:
        return 0
    append_synced(directory / EPISODES_DISCARDED_FILE,
                  encode_frame([line + b"\n" for line in moved]))
    (directory / EPISODES_INDEX_FILE).unlink(missing_ok=True)
    atomic_write_bytes(directory / EPISODES_FILE, b"".join(blob for blob, _ in blobs))
    index, offset = [], 0
    for blob, episodes in blobs:
        index.append(_ENTRY.pack(offset, len(blob), episodes))
        offset += len(blob)
    atomic_write_bytes(directory / EPISODES_INDEX_FILE, _MAGIC + b"".join(index))
    return len(moved)
