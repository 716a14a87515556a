"""Reading one checkpoint root: manifests, checksummed bytes, delta chains, objects.

A step is readable only once its ``MANIFEST.json`` exists. Each chunk read is checked against
its checksum before it is decoded: ``CorruptCheckpointError`` names step, rank, tensor, file.

Reading never runs code from the checkpoint unless the caller passes ``trust=True``: the
objects are a JSON tree (``checkflow.objects``), and the two things that are pickles (an
object saved with ``allow_pickle=True``, and every object of a checkpoint written before
objects were stored as data) raise ``UntrustedCheckpointError`` without it.
"""

from __future__ import annotations

import io
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import xxhash

from checkflow import knobs, objects, validate
from checkflow import manifest as mf
from checkflow.catalog import LineageFolders, read_global, read_manifest_bytes
from checkflow.codec import get_codec
from checkflow.codec.base import CodecError, dtype_from_name
from checkflow.read.assemble import assemble
from checkflow.read.errors import (
    HOW_TO_TRUST,
    RESTORE_ERRORS,
    CorruptCheckpointError,
    NoCheckpointError,
    UntrustedCheckpointError,
)
from checkflow.read.plan import Part, ReadItem, plan_box
from checkflow.state import iter_refs, unflatten
from checkflow.storage import Storage, StorageError
from checkflow.storage.direct import ReadBuffers
from checkflow.types import Buffer

log = logging.getLogger(__name__)

Progress = Callable[[int], None]
"""Called with the number of bytes just read."""


class CheckpointReader:
    """Reads one checkpoint root; caches manifests; follows delta chains.

    Args:
        storage: the checkpoint root.
        progress: called with the bytes of each read.
        trust: unpickle objects stored as pickles (runs code from the checkpoint).
        direct: read local chunks past the page cache into reused buffers, not mapped
            (``Storage.read``): for a restore whose tensors go on to a device.
        complete: each step holds every rank's chunks, which must cover each tensor
            (storage); False for a RAM copy, which holds this rank's shards only. Chunks
            never overlap either way (``validate.check_layout``).
    """

    def __init__(
        self,
        storage: Storage,
        progress: Progress | None = None,
        *,
        trust: bool = False,
        direct: bool = False,
        complete: bool = True,
    ) -> None:
        self.storage = storage
        self.complete = complete
        self.progress = progress
        self.trust = trust
        self.buffers = ReadBuffers() if direct else None
        self._globals: dict[int, mf.GlobalManifest] = {}
        self._ranks: dict[tuple[int, int], mf.RankManifest] = {}
        self._boxes: dict[tuple[int, int], dict[tuple[str, tuple[int, ...]], mf.ChunkEntry]] = {}
        self._laid_out: set[int] = set()
        """Steps whose chunks passed ``validate.check_layout``."""
        self.folder = LineageFolders(storage)  # a step's (and a base's) folder: its timeline's
        # Chunks decode on several threads; each follows its delta chain through the caches.
        self._lock = threading.Lock()

    # -- manifests -------------------------------------------------------------------------
    def manifest(self, step: int) -> mf.GlobalManifest:
        """The validated commit of ``step`` (``catalog.read_global``)."""
        if step not in self._globals:
            try:
                self._globals[step] = read_global(self.storage, step, folder=self.folder(step))
            except FileNotFoundError:
                raise NoCheckpointError(
                    f"no committed checkpoint at step {step} in {self.storage.uri}"
                ) from None
        return self._globals[step]

    def rank_manifest(self, step: int, rank: int) -> mf.RankManifest:
        key = (step, rank)
        if key not in self._ranks:
            world = self.manifest(step).world_size
            if not 0 <= rank < world:
                raise KeyError(f"step {step} was saved by {world} ranks; there is no rank {rank}")
            path = f"{self.folder(step)}/{mf.rank_manifest_name(rank)}"
            try:
                data = read_manifest_bytes(self.storage, path)
            except FileNotFoundError:
                raise CorruptCheckpointError(
                    step, rank, "*", mf.rank_manifest_name(rank), "rank manifest is missing"
                ) from None
            rm = mf.RankManifest.from_json(data, where=self.storage.url(path))
            validate.check_rank(rm, self.manifest(step), step, rank)
            self._ranks[key] = rm
        return self._ranks[key]

    def rank_manifests(self, step: int) -> list[mf.RankManifest]:
        """Every rank's manifest of ``step``, their chunks checked together once: no two
        overlap and (``complete``) they cover each tensor."""
        ranks = [self.rank_manifest(step, r) for r in range(self.manifest(step).world_size)]
        if step not in self._laid_out:
            parts = ((rm.rank, c) for rm in ranks for c in rm.chunks)
            validate.check_layout(step, parts, complete=self.complete)
            # Every commit its delta chains reach, before any tensor is read: a restore
            # that fails half-way has already copied tensors into the live state.
            validate.walk_bases(step, self.manifest)
            self._laid_out.add(step)
        return ranks

    # -- bytes -----------------------------------------------------------------------------
    def _read_checked(
        self, step: int, rank: int, fqn: str, file: str, offset: int, nbytes: int, digest: str
    ) -> Buffer:
        path = f"{self.folder(step)}/{file}"
        try:
            data = self.storage.read(path, offset, offset + nbytes, buffers=self.buffers)
        except FileNotFoundError:
            raise CorruptCheckpointError(step, rank, fqn, file, "data file is missing") from None
        except StorageError as e:
            raise CorruptCheckpointError(step, rank, fqn, file, str(e)) from e
        if xxhash.xxh3_64_hexdigest(data) != digest:
            raise CorruptCheckpointError(
                step, rank, fqn, file, f"checksum mismatch in bytes {offset}..{offset + nbytes}"
            )
        if self.progress is not None:
            self.progress(nbytes)
        return data

    def chunk(
        self, step: int, rank: int, entry: mf.ChunkEntry, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Decode one chunk, following its delta chain to the base: into ``into`` when
        given (a contiguous tensor of the chunk's dtype and shape, which is returned),
        else into new memory or a view of the bytes read.

        The chain is walked iteratively, then decoded from its full base up, holding one
        base at a time: a chain's length costs neither stack nor memory."""
        chain = self._chain(step, rank, entry)
        base: torch.Tensor | None = None
        for s, e in reversed(chain):
            data = self._read_checked(s, rank, e.fqn, e.file, e.byte_offset, e.nbytes, e.checksum)
            base = self._decode(s, rank, e, data, base, into if e is entry else None)
        assert base is not None
        return base

    def _chain(self, step: int, rank: int, entry: mf.ChunkEntry) -> list[tuple[int, mf.ChunkEntry]]:
        """``entry`` and the chunks of its delta chain, newest first, down to a full one."""
        chain = [(step, entry)]
        while (base := chain[-1][1].base_step) is not None:
            s, e = chain[-1]
            if not base < s or len(chain) > validate.MAX_DELTA_CHAIN:
                raise CorruptCheckpointError(
                    s, rank, e.fqn, e.file, f"delta chain from step {step} cycles or is too long"
                )
            chain.append((base, self._base_entry(e, rank)))
        return chain

    def _decode(
        self,
        step: int,
        rank: int,
        entry: mf.ChunkEntry,
        data: Buffer,
        base: torch.Tensor | None,
        into: torch.Tensor | None,
    ) -> torch.Tensor:
        try:
            codec = get_codec(entry.codec)
            dtype, shape = dtype_from_name(entry.dtype), tuple(entry.shape)
            if into is None:
                return codec.decode(data, entry.params, dtype=dtype, shape=shape, base=base)
            if into.dtype != dtype or tuple(into.shape) != shape:
                raise CodecError(
                    f"cannot decode a {shape} {dtype} chunk into {tuple(into.shape)} {into.dtype}"
                )
            return codec.decode_into(data, entry.params, into, base)
        except (CodecError, ValueError, RuntimeError) as e:
            raise CorruptCheckpointError(
                step, rank, entry.fqn, entry.file, f"cannot decode: {e}"
            ) from e

    def _base_entry(self, entry: mf.ChunkEntry, rank: int) -> mf.ChunkEntry:
        assert entry.base_step is not None
        try:
            base = self.rank_manifest(entry.base_step, rank)
        except NoCheckpointError:
            raise CorruptCheckpointError(
                entry.base_step,
                rank,
                entry.fqn,
                mf.MANIFEST,
                "the base of a delta is not committed (was it deleted?)",
            ) from None
        found = self._chunk_by_box(entry.base_step, rank, base).get(
            (entry.fqn, tuple(entry.offset))
        )
        if found is not None and (found.shape, found.dtype) == (entry.shape, entry.dtype):
            return found
        raise CorruptCheckpointError(
            entry.base_step,
            rank,
            entry.fqn,
            mf.rank_manifest_name(rank),
            "the base of a delta has no matching chunk",
        )

    def _chunk_by_box(
        self, step: int, rank: int, rm: mf.RankManifest
    ) -> dict[tuple[str, tuple[int, ...]], mf.ChunkEntry]:
        """``rm``'s chunks by (tensor, offset), built once per manifest: every chunk of a
        delta looks up its base here (a scan per chunk is quadratic in the chunks)."""
        key = (step, rank)
        if key not in self._boxes:
            with self._lock:
                if key not in self._boxes:
                    self._boxes[key] = {(c.fqn, tuple(c.offset)): c for c in rm.chunks}
        return self._boxes[key]

    def skeleton(self, step: int, rank: int = 0, *, opaque: bool = False) -> Any:
        """``rank``'s ``{name: state_dict}`` with ``TensorRef`` leaves.

        Args:
            opaque: without ``trust``, show pickled objects as ``objects.OpaqueObject``
                (a checkpoint written before objects were data: the whole skeleton)
                instead of raising; for tools that describe a checkpoint.

        Raises:
            UntrustedCheckpointError: an object is a pickle, and neither trust nor opaque.
            CorruptCheckpointError: the objects fail their checksum or do not decode.
        """
        rm = self.rank_manifest(step, rank)
        obj = next((o for o in rm.objects if o.fqn == "skeleton"), None)
        if obj is None:
            raise CorruptCheckpointError(
                step, rank, "skeleton", mf.rank_manifest_name(rank), "missing"
            )
        data = self._read_checked(
            step, rank, obj.fqn, obj.file, obj.byte_offset, obj.nbytes, obj.checksum
        )
        return self._decode_objects(step, rank, obj, data, trust=self.trust, opaque=opaque)

    def _decode_objects(
        self, step: int, rank: int, obj: mf.ObjectEntry, data: Buffer, *, trust: bool, opaque: bool
    ) -> Any:
        where = f"step {step} in {self.storage.uri}, rank {rank}"
        if obj.encoding == mf.OBJECTS_TREE:
            try:
                return objects.decode(data, trust=trust, opaque=opaque)
            except objects.PickleRefusedError as e:
                raise UntrustedCheckpointError(
                    f"{where}: object {e.path!r} ({e.type_name}) was saved as a pickle "
                    f"(allow_pickle=True); {HOW_TO_TRUST}"
                ) from None
            except objects.ObjectFormatError as e:
                raise CorruptCheckpointError(step, rank, obj.fqn, obj.file, str(e)) from e
        if obj.encoding != mf.OBJECTS_TORCH_PICKLE:
            raise mf.ManifestError(
                f"{where}: objects have encoding {obj.encoding!r:.40}, unknown to this "
                "checkflow; upgrade checkflow to read them"
            )
        if trust:
            return _unpickle(data, step, rank, obj)
        if opaque:
            return objects.OpaqueObject("all objects (older checkflow)", len(data))
        raise UntrustedCheckpointError(
            f"{where} was written by a checkflow that stored the non-tensor state (RNG, "
            f"step, optimizer settings) as a pickle; {HOW_TO_TRUST}. Checkpoints saved "
            "after that restore store it as data"
        )

    # -- tensors ---------------------------------------------------------------------------
    def chunk_index(self, step: int, fqns: Iterable[str] | None = None) -> dict[str, list[Part]]:
        """Every stored chunk of ``step`` (of the tensors ``fqns``, all when None), by tensor
        name: ``{fqn: [(rank, chunk), ...]}``.

        Raises:
            KeyError: ``step`` has no tensor named in ``fqns``.
        """
        wanted = set(fqns) if fqns is not None else None
        index: dict[str, list[Part]] = {}
        for rm in self.rank_manifests(step):
            for c in rm.chunks:
                if wanted is None or c.fqn in wanted:
                    index.setdefault(c.fqn, []).append((rm.rank, c))
        if wanted is not None and (missing := wanted - index.keys()):
            raise KeyError(f"step {step} has no tensor {sorted(missing)[0]!r}")
        return index

    def tensors(self, step: int, fqns: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Full tensors assembled from every rank's chunks (all of them when ``fqns`` is None)."""
        plans = {fqn: plan_box(step, parts) for fqn, parts in self.chunk_index(step, fqns).items()}
        jobs = [(item.rank, item.chunk) for plan in plans.values() for item in plan.items]
        decoded = self._prefetch(step, jobs)
        return {fqn: assemble(plan, decoded) for fqn, plan in plans.items()}

    def decode_parts(
        self,
        step: int,
        items: Iterable[ReadItem],
        into: Iterable[torch.Tensor | None] | None = None,
    ) -> Iterator[torch.Tensor]:
        """The decoded chunk of each read item, in order, several decoded at once; an item
        with a tensor in ``into`` (same order) is decoded into it (``chunk``)."""
        jobs = [(item.rank, item.chunk) for item in items]
        return self._prefetch(step, jobs, list(into) if into is not None else None)

    def _prefetch(
        self,
        step: int,
        jobs: list[tuple[int, mf.ChunkEntry]],
        into: list[torch.Tensor | None] | None = None,
    ) -> Iterator[torch.Tensor]:
        """Decoded chunks in ``jobs`` order, read ahead on threads so that reads, checksums
        and decoding overlap (file reads, hashing and decoders release the GIL).

        A job that decodes into new memory holds it until it is taken, so at most
        ``threads + 1`` of those are ahead; one that decodes into its target holds nothing
        once done and does not count: a restore into live tensors queues all of its chunks
        at once, and no thread waits for the caller to take the one in front (up to a
        fifth of a restore's time with a window of 3 chunks). Jobs not yet started are
        cancelled when the caller stops early or a chunk fails."""
        dest = into if into is not None else [None] * len(jobs)
        threads = knobs.read_threads()
        if threads <= 1 or len(jobs) <= 1:
            yield from (self.chunk(step, r, c, t) for (r, c), t in zip(jobs, dest, strict=True))
            return
        with ThreadPoolExecutor(threads, thread_name_prefix="checkflow-read") as pool:
            ahead: deque[tuple[Future[torch.Tensor], bool]] = deque()
            fresh = 0  # jobs in ``ahead`` that decode into new memory
            try:
                for (rank, c), target in zip(jobs, dest, strict=True):
                    ahead.append((pool.submit(self.chunk, step, rank, c, target), target is None))
                    fresh += target is None
                    while fresh > threads:
                        done, new = ahead.popleft()
                        fresh -= new
                        yield done.result()
                while ahead:
                    yield ahead.popleft()[0].result()
            finally:
                for waiting, _ in ahead:
                    waiting.cancel()

    def state_dicts(self, step: int, rank: int = 0) -> dict[str, Any]:
        """``{name: state_dict}`` of ``rank``'s objects with full tensors."""
        skeleton = self.skeleton(step, rank)
        return unflatten(skeleton, self.tensors(step, set(iter_refs(skeleton))))

    # -- verification ----------------------------------------------------------------------
    def verify(self, step: int) -> list[str]:
        """Read and decode every chunk of ``step``; return the problems found (empty = good)."""
        problems: list[str] = []
        try:
            ranks = self.rank_manifests(step)
        except RESTORE_ERRORS as e:
            return [f"step {step}: {e}"]
        for rm in ranks:
            for o in rm.objects:
                try:
                    data = self._read_checked(
                        step, rm.rank, o.fqn, o.file, o.byte_offset, o.nbytes, o.checksum
                    )
                    # Decoded as a description: verify never unpickles, even a trusting reader.
                    self._decode_objects(step, rm.rank, o, data, trust=False, opaque=True)
                except RESTORE_ERRORS as e:
                    problems.append(str(e))
            for c in rm.chunks:
                try:
                    self.chunk(step, rm.rank, c)
                except RESTORE_ERRORS as e:  # what makes a restore fall back, as it does
                    problems.append(str(e))
        return problems


def _unpickle(data: Buffer, step: int, rank: int, obj: mf.ObjectEntry) -> Any:
    try:
        # Only with the caller's trust: this runs whatever code the pickle names.
        return torch.load(io.BytesIO(data), weights_only=False)
    except Exception as e:  # unpickling raises anything; the location matters more
        raise CorruptCheckpointError(step, rank, obj.fqn, obj.file, f"cannot unpickle: {e}") from e
