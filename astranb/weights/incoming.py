"""Work on a weight payload while it is still arriving: its hash, and its zstd sections inflated.

Decoding a delta is two kinds of work: inflating the zstd sections (bitmaps, value planes) into
scratch memory, and walking the positions to write the values into the weights. The first kind
touches no weight, so it can run while the rest of the payload is still on the wire; the second
waits for the payload's hash, which covers every byte. `Incoming` does the first kind, and the
hash, on a thread of its own as the receiver reports bytes in:

    receiving thread           the body buffer: [prefix|header|s0|s1|s2 ... |hash]
      open(buffer)                                bytes land in order ──►
      arrived(n) ──notify──► worker:  hash bytes [hashed, n) into an xxh3 state
      arrived(n)    ...               the header is in: the table of zstd sections
                                      inflate each section whose bytes are all in
                                      (within a scratch budget; the rest is left to apply)
      finish(buffer) ──► the caller hashes what is left; inflating under way ends; sections
                         not begun are left to apply (it inflates each beside the walk that
                         reads it, in cache) ──► Prepared(digest, {body offset: Inflated})
                         ──► WeightUpdate.prepared ──► Mirror.apply

So the read-ahead only uses time the transfer leaves idle: on a fast link it does little, on a
slow one it hides the inflating (bench/RESULTS.md). A payload under 1 MiB starts no thread.

Threading contract: `open`, `arrived` and `abandon` come from the receiving thread (an event
loop: they take a lock and notify, nothing more); `finish` from any one thread once every byte
is in. Nothing read here is trusted. A header that does not parse means nothing is inflated; a
hostile one can make us allocate at most `budget` bytes. codec.apply compares the payload's hash
with `digest` before it writes anything, and uses an inflated section only where it asks for the
same output limit; any other section it inflates itself, as it always did.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import xxhash
import zstandard

from ._sections import Inflated, _section_spans, _unzstd, _zstd_sections
from .codec import _PREFIX, _TRAILER, _read_header, _read_prefix
from .errors import CorruptPayload

__all__ = ["Incoming", "Prepared"]

_BUDGET = 512 << 20  # bytes of inflated sections held at once, at most
# a smaller payload arrives in about the time a thread takes to start: no worker is started for
# it, and finish() just hashes it (bench/services.py --quick showed the worker cost more)
_MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class Prepared:
    """What `Incoming` did for one payload: its hash and the sections it inflated."""

    payload: Any  # the buffer it watched: Mirror.apply uses this only for that very object
    digest: int | None  # xxh3 of the bytes before the trailer (None: not all were hashed)
    ready: dict[int, Inflated] = field(default_factory=dict)  # by offset in the payload's body


@dataclass
class _Job:
    body_offset: int
    start: int  # in the buffer
    end: int
    skip: int
    limit: int


class Incoming:
    """Hashes and inflates a payload's sections as its bytes land in one buffer (see the module)."""

    def __init__(self, *, budget: int = _BUDGET, threads: int = 1,
                 min_bytes: int = _MIN_BYTES) -> None:
        self._cond = threading.Condition()
        self._budget = budget
        self._threads = threads
        self._min_bytes = min_bytes
        self._workers: list[threading.Thread] = []
        self._buffer: Any = None
        self._view = memoryview(b"")
        self._got = 0
        self._complete = False  # every byte is in (finish)
        self._stopped = False  # abandoned, or finished and drained
        self._hasher = xxhash.xxh3_64()
        self._hashed = 0
        self._hash_end = 0  # bytes before the trailer
        self._hashing = False
        self._table: deque[_Job] | None = None  # None: the header is not read yet
        self._reading = False
        self._busy = 0  # jobs being inflated
        self._ready: dict[int, Inflated] = {}

    # -- the receiving thread ----------------------------------------------------------------
    def open(self, buffer: bytearray) -> None:
        """The buffer the body will land in, front to back (its length is the body's)."""
        with self._cond:
            self._buffer, self._view = buffer, memoryview(buffer)
            self._hash_end = max(0, len(buffer) - _TRAILER.size)
            for _ in range(self._threads if len(buffer) >= self._min_bytes else 0):
                worker = threading.Thread(target=self._work, name="astranb-incoming",
                                          daemon=True)
                self._workers.append(worker)
                worker.start()

    def arrived(self, got: int) -> None:
        """The first `got` bytes of the buffer are in."""
        with self._cond:
            self._got = got
            self._cond.notify_all()

    def abandon(self) -> None:
        """Stop: the payload will not be used (failed, cancelled, refused)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._ready.clear()

    # -- the caller's thread -------------------------------------------------------------------
    def finish(self, payload: Any) -> Prepared | None:
        """Every byte of `payload` (the buffer given to `open`) is in: hash what is left (on
        this thread too), let the inflating under way end, and hand the work over. Sections not
        begun are left to apply, which inflates each one beside the walk that reads it, while
        it is still in cache: inflating them here first was slower (bench/RESULTS.md). None
        when `payload` is not that buffer."""
        if payload is not self._buffer:
            self.abandon()
            return None
        with self._cond:
            self._got, self._complete = len(self._view), True
            self._table = deque()  # the sections not begun (or a header not read) are apply's
            self._cond.notify_all()
        self._work()
        for worker in self._workers:
            worker.join()
        with self._cond:
            if self._stopped:  # abandoned meanwhile (or a worker failed): nothing is handed over
                return Prepared(payload, None, {})
            self._stopped = True
            digest = self._hasher.intdigest() if self._hashed == self._hash_end else None
            return Prepared(payload, digest, dict(self._ready))

    def wait_idle(self, timeout: float) -> bool:
        """Wait until everything that can be done with the bytes in so far is done (the tests
        use it to pin what `finish` will find); False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._stopped or self._idle(), timeout)

    def __enter__(self) -> Incoming:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._stopped:
            self.abandon()

    # -- the work ------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cond:
                task = self._next()
                while task is None:
                    if self._stopped or self._drained():
                        self._cond.notify_all()
                        return
                    self._cond.wait()
                    task = self._next()
            try:
                task()
            except BaseException:  # a bug or no memory: give up the read-ahead, apply does it all
                self.abandon()
                raise

    def _drained(self) -> bool:
        """Nothing is left to do, or will be (every byte is in and every job taken)."""
        return (self._complete and self._hashed == self._hash_end and not self._hashing
                and not self._reading and self._table is not None and not self._table)

    def _idle(self) -> bool:
        """Nothing under way, and nothing to begin with the bytes in so far (holding the lock)."""
        if self._hashing or self._reading or self._busy:
            return False
        if self._hashed < min(self._got, self._hash_end):
            return False
        if self._table is None:
            return not (self._complete or self._got >= self._header_end())
        return not self._table or self._table[0].end > self._got

    def _next(self) -> Any:
        """The next piece of work, claimed (called holding the lock), or None."""
        if self._stopped:
            return None
        upto = min(self._got, self._hash_end)
        if not self._hashing and self._hashed < upto:
            self._hashing = True
            start = self._hashed
            return lambda: self._hash(start, upto)
        if self._table is None:
            if not self._reading and (self._complete or self._got >= self._header_end()):
                self._reading = True
                return self._read_table
            return None
        if self._table and self._table[0].end <= self._got:
            job = self._table.popleft()
            self._busy += 1
            return lambda: self._inflate(job)
        return None

    def _hash(self, start: int, upto: int) -> None:
        self._hasher.update(self._view[start:upto])
        with self._cond:
            self._hashed, self._hashing = upto, False
            self._cond.notify_all()

    def _header_end(self) -> int:
        """Bytes up to the end of the header (the prefix's, while the prefix is not in)."""
        if self._got < _PREFIX.size:
            return _PREFIX.size
        try:
            return _PREFIX.size + _read_prefix(self._view)[1]
        except CorruptPayload:
            return 0  # not a payload: "read" the table now, and find it empty

    def _read_table(self) -> None:
        """The zstd sections, from the header; none if it is not there or does not parse."""
        jobs: deque[_Job] = deque()
        try:
            total, header_len = _read_prefix(self._view)
            body = _PREFIX.size + header_len
            if self._got >= body and total == len(self._view):
                for entry, spans in _section_spans(_read_header(self._view, header_len).tensors):
                    for index, skip, limit in _zstd_sections(entry):
                        start, end = spans[index]
                        jobs.append(_Job(start, body + start, body + end, skip, limit))
        except (CorruptPayload, ValueError, KeyError, TypeError, IndexError):
            jobs.clear()  # not a payload this side can read ahead: apply will say what is wrong
        with self._cond:
            # finish() came meanwhile: what was not begun is apply's
            self._table, self._reading = (deque() if self._complete else jobs), False
            self._cond.notify_all()

    def _inflate(self, job: _Job) -> None:
        raw = self._view[job.start : job.end]
        frame = raw[job.skip :]
        try:
            claimed = zstandard.frame_content_size(frame) if len(frame) else -1
        except zstandard.ZstdError:
            claimed = -1
        cost = job.limit if claimed < 0 else min(claimed, job.limit)
        with self._cond:
            fits = cost <= self._budget
            if fits:
                self._budget -= cost
        if fits and len(raw) > job.skip:
            try:
                got = Inflated(raw, job.skip, job.limit, _unzstd(frame, job.limit))
            except CorruptPayload as error:
                got = Inflated(raw, job.skip, job.limit, error=str(error))
            with self._cond:
                if not self._stopped:
                    self._ready[job.body_offset] = got
        with self._cond:
            self._busy -= 1
            self._cond.notify_all()
