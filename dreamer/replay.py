"""Replay: one stream per environment in a ReplayBufferEnsemble, and the latent write-back.

Each env's records go to its own member (a round-robin writer that tracks slot generations), so a
slice of `batch_length + 1` records is always consecutive in time for one env; slices may span an
episode end, where `is_init` resets the RSSM. After an update, the learner's refreshed posterior of
record t becomes the stored context (state, belief) of record t+1 — but only if that slot still
holds the record it held at sampling time (its generation is unchanged).

Online sampling (`online=True`, the reference's): every `batch_length` records a stream receives make a
fresh window (the last `batch_length + 1` of them), queued when written; a batch takes the queued fresh
windows first, each once, and fills the rest uniformly. Each window of new experience is then trained
on soon after it arrives, whatever the replay's size; the uniform part draws each stream in proportion
to its windows. Fresh windows are not saved in checkpoints: after a resume, fresh ones start with the
first new records.

A sample carries the stored context of each sequence's first record only (the learner starts its
recurrence there and reads no other): each record's context is 5,120 floats at size50m, nearly two thirds
of a Minecraft record's bytes. In the batch, `state` and `belief` are that first context seen along the
whole sequence (an expanded view, no copies).

All streams' records live in one table [streams, capacity] (each member's storage is a row of it), so
a batch is one row gather per key; each stream keeps its own context column beside it. For a CUDA
learner the batch is gathered straight into pinned staging buffers, reused once their copy to the
device has ended.

Ordering of samples and write-backs. The records of a sample are prepared ahead (in the replay's
sampling thread) without their context; the context of each sequence's first record is read when `sample()`
hands the batch out, after every write-back submitted before that batch was prepared has been
applied. A write-back touches contexts only, so it never waits for a prepared sample, and a sample's
preparation never waits for a write-back: only the short context read does. torchrl's
`submit_update_if_present` orders both ways (an update waits for the samples already queued, a
queued sample for the updates before it), which chained the host work of the two threads: measured
on the GPU machine at the Minecraft shapes, an update with replay took 246 ms against 130 ms on a
resident batch (BENCHMARKS.md).
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import (
    ConditionalUpdateResult,
    LazyTensorStorage,
    ReplayBufferEnsemble,
    SliceSampler,
    TensorDictReplayBuffer,
    TensorDictRoundRobinWriter,
)
from torchrl.data.replay_buffers.writers.round_robin import _SLOT_GENERATIONS_ATTR

STREAM_KEY = "stream"
HANDLE_KEYS = ("index", "index_generation")
CONTEXT_KEYS = ("state", "belief")
# The latent context is kept in bf16: half the bytes of float32 (at size200m it is most of a record),
# and the learner computes in bf16 on a GPU anyway.
CONTEXT_DTYPE = torch.bfloat16
# Besides its fields, each record costs its slot generation and its stream id (int64 each).
RECORD_OVERHEAD = 16


def record_bytes(example: TensorDictBase) -> int:
    """Bytes one replay record takes, from an example record without batch dimensions (the layout of
    `dreamer.inference.request_spec`): its fields, the context in CONTEXT_DTYPE, and the bookkeeping."""
    total = RECORD_OVERHEAD
    for key, value in example.items(include_nested=True, leaves_only=True):
        size = CONTEXT_DTYPE.itemsize if key in CONTEXT_KEYS else value.element_size()
        total += value.numel() * size
    return total


def available_memory() -> int:
    """Host memory the kernel says can be had now without swapping (MemAvailable), in bytes."""
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _allocator(directory: Path | None):
    """Empty tensors in memory, or (replay.storage=disk) in memory-mapped files under `directory`.

    A file is unlinked as soon as it is mapped: the mapping keeps its pages, and the space is released
    when the process ends, however it ends, so no replay file outlives a run.
    """
    if directory is None:
        return lambda shape, dtype: torch.empty(shape, dtype=dtype)
    directory.mkdir(parents=True, exist_ok=True)

    def empty(shape, dtype) -> torch.Tensor:
        handle, path = tempfile.mkstemp(dir=directory, prefix="replay-", suffix=".bin")
        os.close(handle)
        try:
            return torch.from_file(path, shared=True, size=math.prod(shape), dtype=dtype).view(shape)
        finally:
            os.unlink(path)

    return empty


def _empty_like(record: TensorDictBase, batch: tuple[int, ...], allocate, dtype=None) -> TensorDictBase:
    return TensorDict({key: allocate((*batch, *value.shape), dtype or value.dtype)
                       for key, value in record.items(include_nested=True, leaves_only=True)}, list(batch))


class _StreamWindows(SliceSampler):
    """Windows of `slice_len` consecutive records of one env stream, uniformly, never across the write
    cursor, with the stored flags untouched.

    torchrl's SliceSampler finds windows by scanning the stream's trajectory column at every sample (and
    at every `sampleable` count the ensemble asks for), gathers each window's whole records once more to
    read its flags, and by default marks every window start `is_init`, which would make the learner drop
    the stored context it starts from. A member holds one stream, so the window starts are simply the
    offsets 0 .. len - slice_len from the oldest record.
    """

    def _sampleable_count(self, storage, batch_size: int) -> int:
        return max(0, len(storage) - self.slice_len + 1)

    def sample(self, storage, batch_size: int):
        windows, count = self._sampleable_count(storage, batch_size), batch_size // self.slice_len
        if not windows or not count:
            raise RuntimeError(f"a replay stream with {len(storage)} records has no window of {self.slice_len}")
        newest = storage._last_cursor_index
        oldest = (newest + 1) % storage.max_size if len(storage) == storage.max_size else 0
        starts = torch.randint(windows, (count, 1), generator=self._rng)
        index = (oldest + starts + torch.arange(self.slice_len)) % storage.max_size
        return (index.reshape(-1),), {}


class _Table:
    """Every stream's records in one table [streams, capacity]: each stream's storage is a row of it, so
    a batch drawn across streams is one gather per key (torch releases the interpreter lock while it
    runs), not one tensordict indexing per stream and a stack of their results.

    The latent context is not in the table: it is read one record per sequence, and each stream keeps
    its own. At the Minecraft preset's sizes a context column of the whole replay would be one
    allocation of tens of GB, which the host's memory accounting can refuse where the stream-sized
    pieces are granted.
    """

    def __init__(self, streams: int, capacity: int, directory: Path | None = None,
                 context_dtype: torch.dtype = CONTEXT_DTYPE):
        self.streams, self.capacity, self.context_dtype = streams, capacity, context_dtype
        self.allocate = _allocator(directory)
        self.records: TensorDictBase | None = None  # [streams, capacity], the context left out
        # Each stream writer's slot generations are a row of this (the writers bump them in place), so
        # the generations of a batch are one gather, not one writer call per stream.
        self.generations = torch.full((streams, capacity), -1, dtype=torch.long)
        self.contexts: dict[int, TensorDictBase] = {}  # stream -> [capacity]
        self._lock = threading.Lock()

    def row(self, stream: int, example: TensorDictBase) -> TensorDictBase:
        record = example[0] if example.batch_dims else example
        with self._lock:
            if self.records is None:  # laid out like the first records any stream receives
                self.records = _empty_like(record.exclude(*CONTEXT_KEYS), (self.streams, self.capacity),
                                           self.allocate)
            row = self.records[stream]
        self.contexts[stream] = _empty_like(record.select(*CONTEXT_KEYS), (self.capacity,), self.allocate,
                                            self.context_dtype)
        return row.update(self.contexts[stream])

    def contexts_at(self, streams: list[int], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(state, belief) of each (stream, slot) pair, stacked (copies)."""
        pairs = [(self.contexts[stream], slot) for stream, slot in zip(streams, slots)]
        return tuple(torch.stack([context.get(key)[slot] for context, slot in pairs]) for key in CONTEXT_KEYS)


class _StreamStorage(LazyTensorStorage):
    """One env stream's records (a row of the replay's table); reads for sampling leave out the latent
    context (see the module doc)."""

    def __init__(self, max_size: int, table: _Table | None = None, stream: int = 0):
        super().__init__(max_size)
        self._table, self._stream = table, stream
        if table is not None:  # where torchrl's round-robin writer keeps the slot generations it tracks
            setattr(self, _SLOT_GENERATIONS_ATTR, table.generations[stream])

    def _init_standard(self, data) -> None:
        if self._table is None:
            return super()._init_standard(data)
        self._storage = self._table.row(self._stream, data)
        self.initialized = True

    def get(self, index):
        if not self.initialized:
            return super().get(index)
        stored = self._storage.exclude(*CONTEXT_KEYS)
        if not self._is_full:
            stored = stored[: self._len_along_dim0]
        return stored[index]


def last_write_wins(coordinates: torch.Tensor) -> torch.Tensor:
    """Positions of the last row of each distinct coordinate row, ordered by coordinate.

    `coordinates` is [N, C] of non-negative integers (here: member id, slot). Rows are ordered with one
    stable sort of a packed int64 key, so equal rows keep their submission order and the last of each
    run is the newest write. When the packed key could overflow int64, the columns are sorted one at a
    time instead (stable sorts from the last column to the first give the same lexicographic order).
    """
    if coordinates.ndim != 2:
        raise ValueError(f"coordinates must be [N, C], got shape {tuple(coordinates.shape)}")
    coordinates = coordinates.long()
    rows, columns = coordinates.shape
    if rows == 0:
        return torch.empty(0, dtype=torch.long, device=coordinates.device)
    if bool((coordinates < 0).any()):
        raise ValueError("coordinates must be non-negative")
    spans = [int(v) + 1 for v in coordinates.amax(0).tolist()]
    if math.prod(spans) <= 2**63 - 1:
        strides = [math.prod(spans[c + 1 :]) for c in range(columns)]
        key = (coordinates * torch.tensor(strides, device=coordinates.device)).sum(1)
        order = torch.sort(key, stable=True).indices
        ordered = key[order]
        boundary = ordered[1:] != ordered[:-1]
    else:
        order = torch.arange(rows, device=coordinates.device)
        for column in reversed(range(columns)):
            order = order[torch.sort(coordinates[order, column], stable=True).indices]
        ordered = coordinates[order]
        boundary = (ordered[1:] != ordered[:-1]).any(1)
    last = torch.cat([boundary, boundary.new_ones(1)])
    return order[last]


def _to_device(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host index to `device` without a synchronizing pageable copy."""
    if index.device == device:
        return index
    if device.type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)


def _on_host(records: TensorDictBase, context_dtype: torch.dtype) -> TensorDictBase:
    """A shallow copy of `records` whose device is the host, as the storage's is, its context in
    `context_dtype`.

    A record whose device differs from the storage's is moved with tensordict's `.to("cpu")` on the
    way in, and that move waits for the calling thread's CUDA stream (the default stream, where the
    learner's updates queue): each insert then waited for the learner's queued update while holding
    the replay's locks, so sampling and write-backs waited too. Host tensors (a worker's chunk) are
    relabelled without that wait; device tensors are copied, and that copy does wait for them.
    """
    if records.device is not None and records.device.type == "cpu":
        records = records.clone(False)
    elif all(leaf.device.type == "cpu" for leaf in records.values(include_nested=True, leaves_only=True)):
        records = records.to("cpu", non_blocking=True)  # nothing to copy: no wait
    else:
        records = records.to("cpu")
    for key in CONTEXT_KEYS:  # the storage keeps the context in its own dtype
        if key in records.keys() and records.get(key).dtype != context_dtype:
            records.set(key, records.get(key).to(context_dtype))
    return records


class Replay:
    """The replay ensemble: `add` a record per env, `sample` [batch, length + 1], `write_back` contexts."""

    def __init__(
        self,
        streams: int,
        size: int,
        batch_size: int,
        batch_length: int,
        device: torch.device,
        seed: int = 0,
        prefetch: int | None = None,
        directory: Path | None = None,
        context_dtype: torch.dtype = CONTEXT_DTYPE,
        online: bool = False,
    ):
        """online: fresh windows first, each once, uniform otherwise (the module's docstring).
        prefetch: samples prepared ahead in a thread (default: 1 for a CUDA learner, none on CPU).
        directory: keep the records in memory-mapped files there (replay.storage=disk), for a replay
        larger than the host's memory. context_dtype: how the latent context is stored (tests of exact
        values use float32)."""
        self.streams = streams
        self.sequence = batch_length + 1
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.capacity = size // streams
        if self.capacity < self.sequence:
            raise ValueError(
                f"replay.size={size} split over {streams} env streams holds {self.capacity} steps per stream, "
                f"less than one sequence of batch_length + 1 = {self.sequence}"
            )
        self.context_dtype = context_dtype
        self.table = _Table(streams, self.capacity, None if directory is None else Path(directory), context_dtype)
        members = [self._member(stream) for stream in range(streams)]
        self._check_members(members)
        self.generator = torch.Generator().manual_seed(seed)
        self.buffer = ReplayBufferEnsemble(
            *members,
            p="sampleable",
            num_buffer_sampled=batch_size,
            routing_dim=0,
            batch_size=batch_size * self.sequence,
            generator=self.generator,
            pin_memory=self.device.type == "cuda",
            prefetch=self._ensemble_prefetch(prefetch),
        )
        self.prefetch = (1 if self.device.type == "cuda" else 0) if prefetch is None else prefetch
        self._sampler = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="dreamer-sample")
                         if self.prefetch else None)
        self._ahead: deque[tuple[Future, list[Future]]] = deque()  # prepared batches, with what each observes
        # CUDA learner: pinned staging buffers the batches are gathered into, reused in turn (see _staging).
        self._ring = [(torch.cuda.Event(), {}) for _ in range(self.prefetch + 2)] if self.device.type == "cuda" else []
        self._ring_next = 0
        # Write-backs are applied in this thread, in submission order (see the module's docstring).
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dreamer-write-back")
        self._writes: deque[Future] = deque()  # submitted, maybe not yet applied
        self._stream_ids = torch.arange(streams)
        # Copies between host and learner on streams of their own (see `_upload` and `write_back`).
        self._uploads: dict[torch.device, torch.cuda.Stream] = {}
        self._downloads: dict[torch.device, torch.cuda.Stream] = {}
        self.added = 0
        # Records each stream has received since the run began (restored on resume): the positions
        # that checkpoints name records by. Changed under the stream's lock, with the insert.
        self.appended = [0] * streams
        self.lost_contexts = 0  # sampled sequences whose first record was overwritten before its context was read
        self.online = online
        # Fresh windows (stream, end position: the window is positions [end - sequence, end)), queued as the
        # records arrive; each stream's next window ends batch_length after the last one queued.
        self._fresh: deque[tuple[int, int]] = deque()
        self._fresh_end = [1] * streams  # the first window ends at position batch_length + 1
        self.online_sampled = 0  # fresh windows handed to batches

    def _member(self, stream: int) -> TensorDictReplayBuffer:
        """Stream `stream`'s buffer: a view of its columns of the table, sampled in whole windows."""
        return TensorDictReplayBuffer(
            storage=_StreamStorage(self.capacity, self.table, stream),
            # One trajectory per stream: slices run through episode ends but never across the write
            # cursor of the circular storage. No window start is marked as an episode start.
            sampler=_StreamWindows(slice_len=self.sequence, traj_key=STREAM_KEY, strict_length=True, init_key=None),
            writer=TensorDictRoundRobinWriter(track_generations=True),
        )

    def _check_members(self, members: list) -> None:
        if any(member.writer._generation is None
               or member.writer._generation.data_ptr() != self.table.generations[i].data_ptr()
               for i, member in enumerate(members)):
            raise RuntimeError("torchrl's round-robin writer no longer keeps slot generations on its storage, where "
                               "the replay shares them: install torchrl 0.14.1 (pyproject.toml pins it)")

    def _ensemble_prefetch(self, prefetch: int | None) -> int | None:
        return None  # the replay prepares its own batches ahead (`sample`)

    def add(self, records: TensorDictBase) -> None:
        """Appends one record per stream (records has batch size [streams])."""
        records = _on_host(records, self.context_dtype)
        records.set(STREAM_KEY, self._stream_ids)
        # Every stream's lock, taken in stream order after the ensemble's (the order of every other
        # path): a checkpoint reading a stream sees its records and its count change together.
        with self.buffer._replay_lock, contextlib.ExitStack() as held:
            for member in self.buffer._rbs:
                held.enter_context(member._replay_lock)
            self.buffer.extend(records)
            for stream in range(self.streams):
                self.appended[stream] += 1
                self._queue_fresh(stream)
        self.added += records.shape[0]

    def add_chunk(self, stream: int, records: TensorDictBase) -> None:
        """Appends consecutive records [k] of one env stream (a worker's chunk) to that stream's member."""
        records = _on_host(records, self.context_dtype)
        records.set(STREAM_KEY, torch.full((records.shape[0],), stream, dtype=torch.long))
        # The ensemble's own extend routes with one mask per member; a chunk belongs to one member.
        member = self.buffer._rbs[stream]
        with self.buffer._replay_lock, self.buffer._write_lock, member._replay_lock:
            member.extend(records)
            self.appended[stream] += records.shape[0]
            self._queue_fresh(stream)
        self.added += records.shape[0]

    def _queue_fresh(self, stream: int) -> None:
        """Queues the fresh windows of `stream` that its new records completed (under its insert's locks)."""
        if not self.online:
            return
        step = self.sequence - 1
        while self._fresh_end[stream] + step <= self.appended[stream]:
            self._fresh_end[stream] += step
            self._fresh.append((stream, self._fresh_end[stream]))

    def _take_fresh(self, count: int) -> tuple[list[int], list[int]]:
        """(streams, first slots) of up to `count` queued fresh windows still held, oldest first (under the
        ensemble's lock); a window already overwritten is dropped."""
        streams, starts = [], []
        while self._fresh and len(streams) < count:
            stream, end = self._fresh.popleft()
            member = self.buffer._rbs[stream]
            start = end - self.sequence
            if start < self.appended[stream] - len(member):
                continue  # evicted before any batch took it
            newest = (member.writer._cursor - 1) % self.capacity
            streams.append(stream)
            starts.append((newest - (self.appended[stream] - 1 - start)) % self.capacity)
        self.online_sampled += len(streams)
        return streams, starts

    def snapshot(self, stream: int, since: int, piece: int = 2048) -> tuple[int, int, TensorDictBase | None]:
        """(count, first, records): copies of the records of `stream` from position `since` (or the oldest
        it still holds) up to `count`, the number it had received when the call began, context included;
        records is None when there are none.

        The copy is made `piece` records at a time under the stream's lock (its inserts and write-backs
        wait only that long; sampling and the other streams not at all). A record evicted by an insert
        between two pieces is no longer in replay and is left out, so `first` can move forward: what is
        returned is always a run of consecutive positions that replay held.
        """
        member = self.buffer._rbs[stream]
        with member._replay_lock:
            count = self.appended[stream]
            first = max(since, count - len(member))
        pieces, start = [], first
        while start < count:
            with member._replay_lock:
                oldest = self.appended[stream] - self.capacity  # positions before it were evicted meanwhile
                if start < oldest:  # eviction runs oldest first: the pieces copied so far are gone too
                    pieces, start = [], oldest
                if not pieces:
                    first = start
                end = min(count, start + piece)
                if start >= end:
                    break
                newest = (member.writer._cursor - 1) % self.capacity
                positions = torch.arange(start, end)
                slots = (newest - (self.appended[stream] - 1 - positions)) % self.capacity
                pieces.append(member.storage._storage[slots].exclude(STREAM_KEY))
            start = end
        if not pieces:
            return count, count, None
        return count, first, torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def restore(self, stream: int, records: TensorDictBase, count: int) -> None:
        """Appends saved records [k] of `stream` (its oldest first); `count`: the position after the
        last of them, which the stream's next record takes."""
        if records.shape[0]:
            self.add_chunk(stream, records)
        member = self.buffer._rbs[stream]
        with self.buffer._replay_lock, member._replay_lock:
            self.appended[stream] = count
            self._fresh_end[stream] = count  # saved records are not fresh
            self._fresh = deque(window for window in self._fresh if window[0] != stream)

    def end_stream(self, stream: int) -> bool:
        """Marks the newest record of `stream` as an episode end (truncated): its producer died.

        The restarted producer's first record has is_init set; the done flag makes the stored episode
        end where the data ends. Applied through the slot's generation, like a write-back, so it never
        touches a record written after this call. False when the stream is empty.
        """
        member = self.buffer._rbs[stream]
        if not len(member):
            return False
        slot = torch.tensor([(member.writer._cursor - 1) % self.capacity])
        generation = member.writer.generations_of(slot)
        done = member.storage[slot].get(("next", "done")).clone().fill_(True)
        member.update_if_present(index=slot, generation=generation, patch={("next", "done"): done})
        return True

    def stored(self, stream: int) -> TensorDictBase:
        """Every record of `stream` as stored, context included, in slot order (a copy)."""
        member = self.buffer._rbs[stream]
        with member._replay_lock:
            return member.storage._storage[: len(member)].clone()

    def ready(self, every: bool = False) -> bool:
        """True once some stream holds a full sequence (`every`: once every stream does).

        Sampling draws streams in proportion to their windows, so a stream without one yet (its worker's
        env still starting: MineRL's take a minute or more, and some retry) is never drawn, and training
        does not wait for the slowest worker.
        """
        check = all if every else any
        return check(len(member) >= self.sequence for member in self.buffer._rbs)

    def sample(self) -> tuple[TensorDictBase, TensorDictBase]:
        """A batch [batch_size, batch_length + 1] on the learner device, and its host-side handles."""
        if self._ahead:
            prepared, observe = self._ahead.popleft()
            data, staging = prepared.result()
        else:
            observe, (data, staging) = self._pending_writes(), self._prepare()
        while len(self._ahead) < self.prefetch:
            # A batch prepared ahead observes the write-backs submitted before its preparation began.
            # (Its staging buffer is not the one of the batch in hand: the ring holds prefetch + 2.)
            self._ahead.append((self._sampler.submit(self._prepare), self._pending_writes()))
        for write in observe:
            write.result()
        handles = data.select(*HANDLE_KEYS)
        batch = data.exclude(*HANDLE_KEYS)
        state, belief, lost = self._first_contexts(handles)
        if lost.any():  # start those sequences afresh, as at an episode start
            is_init = batch.get("is_init").clone()
            is_init[:, 0] |= lost.reshape(-1, *[1] * (is_init.ndim - 2))
            batch.set("is_init", is_init)
        batch, state, belief = self._upload(batch, state, belief)
        if staging is not None:  # the staging buffer is free again once the copies have ended
            staging[0].record(self._copy_stream(self._uploads, self.device))
        shape = (self.batch_size, self.sequence)
        for key, first in (("state", state), ("belief", belief)):  # stored in bf16; the learner takes float32
            batch.set(key, first.float().unsqueeze(1).expand(*shape, first.shape[-1]))
        return batch, handles

    def _prepare(self) -> tuple[TensorDictBase, tuple | None]:
        """Draws a batch and gathers its records without their context, with its handles; for a CUDA
        learner into a pinned staging buffer, returned with it. Online, the queued fresh windows come
        first; the rest draw each stream in proportion to its windows of `sequence` records (a stream
        without one never), and a window uniformly among them; windows never cross the write cursor."""
        members = self.buffer._rbs
        buffer = self._staging() if self.device.type == "cuda" else None
        with self.buffer._replay_lock:  # inserts hold it too: no torn record (write-backs touch no field read here)
            lengths = torch.tensor([len(member) for member in members])
            newest = torch.tensor([member.storage._last_cursor_index if len(member) else 0 for member in members])
            windows = (lengths - self.sequence + 1).clamp(min=0)
            if not bool(windows.any()):
                raise RuntimeError(f"no replay stream holds a sequence of {self.sequence} records yet")
            fresh, first = self._take_fresh(self.batch_size) if self.online else ([], [])
            uniform = self.batch_size - len(fresh)
            drawn = (torch.multinomial(windows.double(), uniform, replacement=True, generator=self.generator)
                     if uniform else torch.zeros(0, dtype=torch.long))
            starts = (torch.rand(uniform, dtype=torch.float64, generator=self.generator)
                      * windows[drawn]).long().clamp(max=windows[drawn] - 1)
            oldest = torch.where(lengths == self.capacity, (newest + 1) % self.capacity, 0)
            drawn = torch.cat([torch.tensor(fresh, dtype=torch.long), drawn])
            starts = torch.cat([torch.tensor(first, dtype=torch.long), (oldest[drawn[len(fresh):]] + starts)])
            slots = (starts[:, None] + torch.arange(self.sequence)) % self.capacity
            rows = (drawn[:, None] * self.capacity + slots).reshape(-1)
            shape = slots.shape

            def gather(key, stored: torch.Tensor) -> torch.Tensor:  # one row gather per key
                flat = stored.flatten(0, 1)
                if buffer is None:
                    return flat.index_select(0, rows).unflatten(0, shape)
                out = buffer[1].setdefault(key, torch.empty((rows.numel(), *flat.shape[1:]), dtype=flat.dtype,
                                                            pin_memory=True))
                return torch.index_select(flat, 0, rows, out=out).unflatten(0, shape)

            stored = self.table.records.exclude(*CONTEXT_KEYS, STREAM_KEY)
            records = TensorDict({key: gather(key, stored.get(key)) for key in stored.keys(True, True)}, shape)
            generations = self._generations(drawn, slots)
        records.set("index", TensorDict({"buffer_ids": drawn[:, None].expand_as(slots), "index": slots}, shape))
        records.set("index_generation", generations)
        return records, buffer

    def _staging(self) -> tuple[torch.cuda.Event, dict]:
        """The next pinned staging buffer of the ring, once the copy of its last batch to the learner
        has ended. Gathered straight into memory already pinned (and already paged in), a batch needs
        no second copy to pin it."""
        event, buffer = self._ring[self._ring_next]
        self._ring_next = (self._ring_next + 1) % len(self._ring)
        event.synchronize()  # an event never recorded has nothing to wait for
        return event, buffer

    def _generations(self, members: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The current generation of each (member, slot) pair: members [n], slots [n, ...]."""
        return self.table.generations[members.reshape(-1, *[1] * (slots.ndim - 1)), slots]

    def _upload(self, *host: TensorDictBase | torch.Tensor) -> tuple:
        """The sample's pieces (pinned) on the learner device, copied on a stream of their own.

        The learner's stream only waits for the copies' end: enqueued while the previous update still
        runs, they overlap it instead of queuing behind it (about 100 MB at the Minecraft shapes).
        """
        if self.device.type != "cuda":
            return tuple(piece.to(self.device) for piece in host)
        learner = torch.cuda.current_stream(self.device)
        upload = self._copy_stream(self._uploads, self.device)
        with torch.cuda.stream(upload):
            moved = tuple(piece.to(self.device, non_blocking=True) for piece in host)
        learner.wait_stream(upload)
        for piece in moved:  # allocated on the copies' stream, read on the learner's
            is_td = isinstance(piece, TensorDictBase)
            for leaf in piece.values(include_nested=True, leaves_only=True) if is_td else [piece]:
                leaf.record_stream(learner)
        return moved

    @staticmethod
    def _copy_stream(streams: dict, device: torch.device) -> torch.cuda.Stream:
        if device not in streams:
            streams[device] = torch.cuda.Stream(device)
        return streams[device]

    def _first_contexts(self, handles: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stored (state, belief) of each sampled sequence's first record, read now, and a mask of
        the sequences whose first slot was rewritten since sampling (their context is zero).

        The read holds the locks of the streams it reads (each stream's inserts and write-backs take its
        lock too) and checks each slot's generation against the sampled one: a context is never torn, nor
        another record's.
        """
        members = handles.get(("index", "buffer_ids"))[:, 0]
        slots = handles.get(("index", "index"))[:, 0]
        with contextlib.ExitStack() as held:
            for stream in members.unique().tolist():  # in order: no two readers deadlock
                held.enter_context(self.buffer._rbs[stream]._replay_lock)  # its inserts and write-backs hold it
            lost = self._generations(members, slots) != handles.get("index_generation")[:, 0]
            state, belief = self.table.contexts_at(members.tolist(), slots.tolist())
        state[lost], belief[lost] = 0.0, 0.0
        self.lost_contexts += int(lost.sum())
        if self.device.type == "cuda":
            state, belief = state.pin_memory(), belief.pin_memory()
        return state, belief, lost

    def write_back(self, handles: TensorDictBase, state: torch.Tensor, belief: torch.Tensor,
                   wait: bool | None = None) -> Future:
        """Submits the refreshed posterior of records [:, :-1] as the context of records [:, 1:].

        Overlapping slices address some slots more than once: the last write wins. From a CUDA learner
        the copy to the host is enqueued now, after the work that produced the values (on a copy stream
        that waits for the producing stream), behind a CUDA event; the write-back thread waits for that
        event, never for the learner's later work, and applies the patch member by member (`_apply`:
        the generation check of torchrl's `update_if_present`, without its copies), into slots whose
        generation is unchanged since sampling. `wait` (default: on a CPU learner only) returns after
        it has been applied.
        """
        index = handles.get("index")[:, 1:].reshape(-1)
        generation = handles.get("index_generation")[:, 1:].reshape(-1)
        coordinates = torch.stack([index.get("buffer_ids"), index.get("index")], -1)
        keep = last_write_wins(coordinates)
        on_device = _to_device(keep, state.device)
        rows = (on_device // state.shape[1], on_device % state.shape[1])  # one gather, even from a strided view
        patch = {key: value.detach()[rows].to(self.context_dtype)
                 for key, value in (("state", state), ("belief", belief))}
        landed = None
        if state.is_cuda:
            # The patch is gathered on the producing stream (it reads the update's outputs, which the
            # next update overwrites); its copies to pinned host memory run on a stream of their own, so
            # the learner's next update does not queue behind them (168 MB at the Minecraft shapes).
            producer = torch.cuda.current_stream(state.device)
            download = self._copy_stream(self._downloads, state.device)
            download.wait_stream(producer)
            with torch.cuda.stream(download):
                for value in patch.values():
                    value.record_stream(download)
                patch = {key: value.to("cpu", non_blocking=True) for key, value in patch.items()}
                landed = torch.cuda.Event()
                landed.record(download)
        index, generation = index[keep], generation[keep]

        def apply():
            if landed is not None:
                landed.synchronize()
            return self._apply_patch(index, generation, patch)

        future = self._writer.submit(apply)
        self._pending_writes()  # raises the error of a failed earlier write-back, here
        self._writes.append(future)
        if wait or (wait is None and self.device.type == "cpu"):
            # A CPU learner gains nothing from overlapping the update: the thread would compete with
            # the next learner step for the same cores (measured: slower on 2 cores).
            future.result()
        return future

    def _apply_patch(self, index: TensorDictBase, generation: torch.Tensor, patch: dict[str, torch.Tensor]):
        return self._apply(index.get("buffer_ids"), index.get("index"), generation, patch)

    def _apply(self, members: torch.Tensor, slots: torch.Tensor, generation: torch.Tensor,
               patch: dict[str, torch.Tensor]) -> ConditionalUpdateResult:
        """Writes the patch rows into the context columns of the slots whose generation is unchanged.

        The rows come ordered by (member, slot) (`last_write_wins`), so each member's rows are one
        contiguous range of the patch: one bincount finds the ranges, and each is copied straight into
        the stream's column (no per-member gather of the patch first, as the ensemble's
        `update_if_present` does, and no lock over the whole replay: only the member's own, which its
        inserts take too, so sampling's gathers run meanwhile).
        """
        counts = torch.bincount(members, minlength=self.streams).tolist()
        updated = torch.zeros(members.shape[0], dtype=torch.bool)
        start = 0
        for stream, count in enumerate(counts):
            if not count:
                continue
            rows, start = slice(start, start + count), start + count
            member, context = self.buffer._rbs[stream], self.table.contexts[stream]
            with member._replay_lock:
                current = self.table.generations[stream, slots[rows]]
                live = (current >= 0) & (current == generation[rows])
                every = bool(live.all())
                target = slots[rows] if every else slots[rows][live]
                for key, value in patch.items():
                    context.get(key).index_copy_(0, target, value[rows] if every else value[rows][live])
            updated[rows] = live
        return ConditionalUpdateResult(updated=updated, version_rejected=None, batch_size=updated.shape)

    def _pending_writes(self) -> list[Future]:
        """The write-backs not yet applied; a failed one raises its error."""
        while self._writes and self._writes[0].done():
            self._writes.popleft().result()
        return list(self._writes)

    def __len__(self) -> int:
        return sum(len(member) for member in self.buffer._rbs)

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        self.buffer.shutdown()
