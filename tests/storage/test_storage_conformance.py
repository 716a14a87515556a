"""One storage contract, checked on every backend (fsspec's tests/abstract style).

``StorageConformance`` holds the tests; each ``Test<Backend>`` class only says how to open
a fresh, empty checkpoint root on its backend (``storage``) and a second, independent
handle on the same root (``reopen``).
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
import numpy as np
import pytest
import torch

from checkflow.storage import Storage, StorageError


def _payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


class StorageConformance:
    """The contract of :class:`checkflow.storage.Storage`, backend-independent."""

    @pytest.fixture
    def storage(self) -> Storage:
        raise NotImplementedError("each backend class overrides this fixture")

    def reopen(self, storage: Storage) -> Storage:
        """A second Storage on the same root that shares no cache with ``storage``."""
        return Storage(storage.uri, backoff_s=0)

    # -- put / read ----------------------------------------------------------------------
    def test_put_then_read_returns_all_parts_back_to_back(self, storage: Storage) -> None:
        weights = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        parts = [
            b"header",
            bytearray(b"\x00\x01\x02"),
            memoryview(np.arange(5, dtype=np.int64)),
            memoryview(weights.numpy()),  # 2-D float32: written as its raw bytes
            memoryview(b"trailer")[2:5],
        ]
        expected = b"".join(memoryview(p).tobytes() for p in parts)

        written = storage.put("step-000000001/rank-00000.chunks", parts)

        assert written == len(expected) == 6 + 3 + 40 + 48 + 3
        assert bytes(storage.read("step-000000001/rank-00000.chunks")) == expected
        back = np.frombuffer(storage.read("step-000000001/rank-00000.chunks", 49, 97), "<f4")
        assert torch.equal(torch.from_numpy(back.copy()).reshape(3, 4), weights)

    def test_put_of_no_parts_writes_an_empty_object(self, storage: Storage) -> None:
        assert storage.put("empty", []) == 0
        assert storage.exists("empty")
        assert storage.size("empty") == 0
        assert storage.read("empty") == bytearray()

    def test_put_rejects_a_non_contiguous_buffer_before_writing(self, storage: Storage) -> None:
        strided = np.arange(16, dtype=np.int32)[::2]
        with pytest.raises(ValueError, match="part 1 is not a contiguous buffer"):
            storage.put("x.bin", [b"ok", memoryview(strided)])
        assert not storage.exists("x.bin")

    @pytest.mark.parametrize(
        ("start", "end"),
        [(0, 1), (0, 4096), (1000, 1001), (100, 3000), (4095, 4096), (0, None), (2500, None)],
    )
    def test_ranged_read_returns_exactly_the_requested_bytes(
        self, storage: Storage, start: int, end: int | None
    ) -> None:
        data = _payload(4096)
        storage.put("blob", [data])
        got = storage.read("blob", start, end)
        assert isinstance(got, bytearray)
        assert bytes(got) == data[start:end]

    def test_empty_ranges_read_as_empty(self, storage: Storage) -> None:
        storage.put("blob", [b"0123456789"])
        assert storage.read("blob", 0, 0) == bytearray()
        assert storage.read("blob", 7, 7) == bytearray()
        assert storage.read("blob", 10) == bytearray()  # from the end, to the end

    @pytest.mark.parametrize(("start", "end"), [(0, 11), (8, 20), (30, 40), (11, None)])
    def test_read_past_the_end_raises_storage_error_naming_the_object_without_retrying(
        self,
        storage: Storage,
        start: int,
        end: int | None,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        storage.put("step-000000007/rank-00001.chunks", [b"0123456789"])
        with (
            caplog.at_level(logging.WARNING, logger="checkflow.storage"),
            pytest.raises(StorageError, match=r"rank-00001\.chunks is truncated.*byte 10"),
        ):
            storage.read("step-000000007/rank-00001.chunks", start, end)
        assert caplog.records == []  # a short object is a fact, not a transient error

    def test_read_of_a_missing_object_raises_file_not_found(self, storage: Storage) -> None:
        with pytest.raises(FileNotFoundError):
            storage.read("nope/rank-00000.json")
        with pytest.raises(FileNotFoundError):
            storage.size("nope/rank-00000.json")

    def test_bad_byte_range_is_rejected(self, storage: Storage) -> None:
        storage.put("blob", [b"0123456789"])
        with pytest.raises(ValueError, match="bad byte range 5..2"):
            storage.read("blob", 5, 2)
        with pytest.raises(ValueError, match="bad byte range -1"):
            storage.read("blob", -1, 2)

    # -- overwrite -----------------------------------------------------------------------
    def test_overwrite_replaces_the_whole_object(self, storage: Storage) -> None:
        storage.put("MANIFEST.json", [_payload(100_000, seed=1)])
        storage.put("MANIFEST.json", [b'{"step": 2}'])
        assert storage.size("MANIFEST.json") == 11
        assert storage.read("MANIFEST.json") == bytearray(b'{"step": 2}')

    def test_a_reader_never_sees_a_partial_object_while_it_is_overwritten(
        self, storage: Storage
    ) -> None:
        versions = [b"a" * 200_000, b"b" * 300_000, b"c" * 1000]
        storage.put("obj", [versions[0]])
        reader = self.reopen(storage)
        seen: list[bytes] = []
        done = threading.Event()

        def read_until_done() -> None:
            while not done.is_set():
                seen.append(bytes(reader.read("obj")))

        thread = threading.Thread(target=read_until_done)
        thread.start()
        try:
            for i in range(30):
                # Two parts per object: a torn write would show as a mix of versions.
                half = len(versions[i % 3]) // 2
                storage.put("obj", [versions[i % 3][:half], versions[i % 3][half:]])
        finally:
            done.set()
            thread.join()
        assert seen, "the reader never ran"
        torn = [(len(s), s[:1], s[-1:]) for s in seen if s not in versions]
        assert torn == []

    # -- listing, exists, size -----------------------------------------------------------
    def test_listdir_gives_sorted_names_of_files_and_folders(self, storage: Storage) -> None:
        for rel in ["d/rank-00001.json", "d/rank-00000.json", "d/sub/x.bin", "d/MANIFEST.json"]:
            storage.put(rel, [b"{}"])
        assert storage.listdir("d") == [
            "MANIFEST.json",
            "rank-00000.json",
            "rank-00001.json",
            "sub",
        ]
        assert storage.listdir("d/sub") == ["x.bin"]
        assert storage.listdir() == ["d"]

    def test_listdir_of_an_empty_or_missing_folder_is_empty(self, storage: Storage) -> None:
        assert storage.listdir() == []
        assert storage.listdir("step-000000001") == []

    def test_exists_and_size_follow_writes_and_deletes(self, storage: Storage) -> None:
        assert not storage.exists("f/a.bin")
        assert not storage.exists("f")
        storage.put("f/a.bin", [b"12345"])
        assert storage.exists("f/a.bin")
        assert storage.exists("f")
        assert storage.size("f/a.bin") == 5
        storage.delete("f/a.bin")
        assert not storage.exists("f/a.bin")

    def test_another_handle_sees_new_writes_after_it_listed(self, storage: Storage) -> None:
        # Other ranks and processes write the same prefix; no listing may go stale.
        other = self.reopen(storage)
        storage.put("step-000000001/rank-00000.json", [b"{}"])
        assert other.listdir() == ["step-000000001"]
        assert not other.exists("step-000000001/MANIFEST.json")
        storage.put("step-000000001/MANIFEST.json", [b"{}"])
        storage.put("step-000000002/rank-00000.json", [b"{}"])
        assert other.listdir() == ["step-000000001", "step-000000002"]
        assert other.exists("step-000000001/MANIFEST.json")
        assert other.size("step-000000001/MANIFEST.json") == 2
        storage.delete("step-000000001")
        assert other.listdir() == ["step-000000002"]
        assert not other.exists("step-000000001/MANIFEST.json")

    # -- delete --------------------------------------------------------------------------
    def test_delete_removes_a_folder_and_everything_under_it(self, storage: Storage) -> None:
        for rel in ["step-1/a.bin", "step-1/deep/er/b.bin", "step-2/a.bin"]:
            storage.put(rel, [b"x"])
        storage.delete("step-1")
        assert storage.listdir() == ["step-2"]
        assert not storage.exists("step-1/deep/er/b.bin")
        assert storage.read("step-2/a.bin") == bytearray(b"x")

    def test_delete_of_a_single_file_keeps_its_siblings(self, storage: Storage) -> None:
        storage.put("s/a", [b"1"])
        storage.put("s/b", [b"2"])
        storage.delete("s/a")
        assert storage.listdir("s") == ["b"]

    def test_delete_of_a_missing_path_is_not_an_error(self, storage: Storage) -> None:
        storage.delete("never/written")
        storage.put("once", [b"1"])
        storage.delete("once")
        storage.delete("once")
        assert storage.listdir() == []

    @pytest.mark.parametrize("relpath", ["", ".", "./", "step-1/.."])
    def test_delete_refuses_the_root(self, storage: Storage, relpath: str) -> None:
        storage.put("step-1/a.bin", [b"x"])
        with pytest.raises(ValueError, match="refusing to delete the checkpoint root"):
            storage.delete(relpath)
        assert storage.read("step-1/a.bin") == bytearray(b"x")

    @pytest.mark.parametrize("relpath", ["../outside", "a/../../outside", "/etc/passwd"])
    def test_paths_outside_the_root_are_rejected(self, storage: Storage, relpath: str) -> None:
        with pytest.raises(ValueError, match="not a path inside the checkpoint root"):
            storage.put(relpath, [b"x"])
        with pytest.raises(ValueError, match="not a path inside the checkpoint root"):
            storage.read(relpath)
        with pytest.raises(ValueError, match="not a path inside the checkpoint root"):
            storage.delete(relpath)


class LocalConformance(StorageConformance):
    """What only local disks promise: temp-file + rename, nothing left behind."""

    def _all_files(self, storage: Storage) -> list[str]:
        return sorted(
            os.path.relpath(os.path.join(d, f), storage.root)
            for d, _, files in os.walk(storage.root)
            for f in files
        )

    def test_successful_writes_leave_no_temp_files(self, storage: Storage) -> None:
        storage.put("step-1/rank-00000.chunks", [b"a", b"b"])
        storage.put("step-1/rank-00000.chunks", [b"c"])
        storage.put("step-1/MANIFEST.json", [b"{}"])
        assert self._all_files(storage) == ["step-1/MANIFEST.json", "step-1/rank-00000.chunks"]

    def test_a_failed_write_leaves_no_temp_file_and_keeps_what_was_there(
        self, storage: Storage
    ) -> None:
        # The rename over an existing, non-empty folder fails after the temp file is
        # fully written: the worst moment to leave litter behind.
        storage.put("step-1/keep.bin", [b"kept"])
        with pytest.raises(IsADirectoryError):
            storage.put("step-1", [b"x" * 10_000])
        assert self._all_files(storage) == ["step-1/keep.bin"]
        assert storage.read("step-1/keep.bin") == bytearray(b"kept")


class TestLocalPath(LocalConformance):
    @pytest.fixture
    def storage(self, tmp_path: Any) -> Storage:
        return Storage(str(tmp_path / "ckpt"), backoff_s=0)

    def test_a_relative_path_is_made_absolute(
        self, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.chdir(tmp_path)
        storage = Storage("runs/r1", backoff_s=0)
        storage.put("a", [b"1"])
        assert storage.root == str(tmp_path / "runs" / "r1")
        assert (tmp_path / "runs" / "r1" / "a").read_bytes() == b"1"


class TestFileURL(LocalConformance):
    @pytest.fixture
    def storage(self, tmp_path: Any) -> Storage:
        return Storage(f"file://{tmp_path}/ckpt", backoff_s=0)


class TestMemory(StorageConformance):
    @pytest.fixture
    def storage(self) -> Iterator[Storage]:
        # memory:// is one store for the whole process: give each test its own prefix.
        uri = f"memory://checkflow-tests/{uuid.uuid4().hex}"
        yield Storage(uri, backoff_s=0)
        fs = fsspec.filesystem("memory")
        if fs.exists(uri):
            fs.rm(uri, recursive=True)


@pytest.mark.s3
class TestS3(StorageConformance):
    @pytest.fixture
    def storage(self, s3_uri: Any) -> Storage:
        uri, options = s3_uri
        return Storage(uri, storage_options=options, backoff_s=0)

    def reopen(self, storage: Storage) -> Storage:
        # skip_instance_cache: a separate s3fs instance with its own listing cache, as in
        # another process.
        options = {**storage.fs.storage_options, "skip_instance_cache": True}
        return Storage(storage.uri, storage_options=options, backoff_s=0)


class TestURIs:
    @pytest.mark.parametrize("uri", ["foo://bucket/run", "nosuchproto://x"])
    def test_an_unknown_protocol_raises_storage_error_naming_the_uri(self, uri: str) -> None:
        with pytest.raises(StorageError, match=rf"cannot open checkpoint URI '{uri}'.*known"):
            Storage(uri)

    @pytest.mark.parametrize("uri", ["", "   "])
    def test_an_empty_uri_raises_storage_error(self, uri: str) -> None:
        with pytest.raises(StorageError, match="checkpoint URI is empty"):
            Storage(uri)

    def test_fewer_than_one_attempt_is_rejected(self, tmp_path: Any) -> None:
        with pytest.raises(ValueError, match="retries must be >= 1"):
            Storage(str(tmp_path), retries=0)
