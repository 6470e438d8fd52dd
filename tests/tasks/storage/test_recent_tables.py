"""Tables kept in memory after a write or a verified read: served only while the file is unchanged."""

import os
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ppoflow.tasks.storage import recent_tables
from ppoflow.tasks.storage.tables import ArtifactCorrupt, read_table, write_table

REL = "iter=000001/rewards/part-00000.parquet"
TICK_S = 0.05
"""Longer than a file timestamp's granularity (one clock tick, up to 10 ms, on kernels before 6.13):
a rewrite in place within one tick of the write would keep the file's identity."""


@pytest.fixture(autouse=True)
def empty():
    recent_tables.forget_all()
    yield
    recent_tables.forget_all()


def scores(value: float) -> pa.Table:
    return pa.table({"score": [value] * 64})


def test_a_table_written_here_is_read_back_from_memory(tmp_path):
    table = scores(0.5)
    ref = write_table(table, tmp_path, REL)
    first = read_table(tmp_path, ref)
    assert first.equals(table)
    assert read_table(tmp_path, ref) is first  # no file read, no parse


def test_a_file_changed_after_the_write_is_verified_again_even_at_the_same_size(tmp_path):
    ref = write_table(scores(0.5), tmp_path, REL)
    path = tmp_path / REL
    other = tmp_path / "other.parquet"
    pq.write_table(scores(0.25), other, compression="none")  # as write_table writes a small table
    assert other.stat().st_size == path.stat().st_size  # the same size, other bytes
    os.replace(other, path)
    with pytest.raises(ArtifactCorrupt):
        read_table(tmp_path, ref)


def test_a_file_rewritten_in_place_is_verified_again(tmp_path):
    ref = write_table(scores(0.5), tmp_path, REL)
    path = tmp_path / REL
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    time.sleep(TICK_S)
    path.write_bytes(bytes(data))  # the same inode and size
    with pytest.raises(ArtifactCorrupt):
        read_table(tmp_path, ref)


def test_past_the_memory_limit_the_oldest_tables_are_read_from_disk(tmp_path, monkeypatch):
    first = write_table(scores(1.0), tmp_path, "a/part-00000.parquet")
    monkeypatch.setattr(recent_tables, "LIMIT_BYTES", int(scores(1.0).nbytes * 1.5))
    second = write_table(scores(2.0), tmp_path, "b/part-00000.parquet")  # the first is dropped
    assert recent_tables.recall(tmp_path / "a/part-00000.parquet", first.digest) is None
    assert recent_tables.recall(tmp_path / "b/part-00000.parquet", second.digest) is not None
    assert read_table(tmp_path, first).column("score").to_pylist() == [1.0] * 64


def test_a_verified_read_is_kept_for_the_next_one(tmp_path):
    ref = write_table(scores(0.5), tmp_path, REL)
    recent_tables.forget_all()  # as in another process
    first = read_table(tmp_path, ref)
    assert read_table(tmp_path, ref) is first


def test_an_in_place_rewrite_with_its_modification_time_set_back_is_verified_again(tmp_path):
    ref = write_table(scores(0.5), tmp_path, REL)
    path = tmp_path / REL
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    time.sleep(TICK_S)
    path.write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # the status-change time still moves
    with pytest.raises(ArtifactCorrupt):
        read_table(tmp_path, ref)


def test_a_file_larger_than_the_memory_limit_is_hashed_in_chunks_and_never_held_whole(tmp_path, monkeypatch):
    from ppoflow.tasks.storage import tables

    ref = write_table(scores(0.5), tmp_path, REL)
    recent_tables.forget_all()
    monkeypatch.setattr(tables, "LIMIT_BYTES", 16)
    assert read_table(tmp_path, ref).column("score").to_pylist() == [0.5] * 64
    assert recent_tables.recall(tmp_path / REL, ref.digest) is None  # not kept either
    with open(tmp_path / REL, "r+b") as f:  # grown past the limit: a sparse 64 MiB file
        f.truncate(64 << 20)
    with pytest.raises(ArtifactCorrupt):
        read_table(tmp_path, ref)
