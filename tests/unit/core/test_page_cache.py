"""Weight files in the page cache (core/weights/page_cache.py): measured with mincore, dropped and read
through on a real file of this machine's disk."""

import os

from hive_apps.core.weights import page_cache


def test_a_dropped_weight_file_leaves_the_cache_and_a_read_through_brings_all_of_it_back(tmp_path):
    weights = tmp_path / "model-00001-of-00001.safetensors"
    with open(weights, "wb") as f:
        f.write(os.urandom(24 * 2**20 + 123))  # not a whole number of pages
        f.flush()
        os.fsync(f.fileno())  # clean pages: DONTNEED evicts only those
    (tmp_path / "config.json").write_text("{}")  # not a weight file: neither counted nor read
    size = weights.stat().st_size
    assert page_cache.weight_files(tmp_path) == [weights]
    assert page_cache.drop(tmp_path) == size
    cached, total = page_cache.cached_bytes(tmp_path)
    assert total == size and cached < 2**20, cached
    assert page_cache.read_through(tmp_path) == size
    assert page_cache.cached_bytes(tmp_path) == (size, size)


def test_a_folder_without_weights_reads_nothing(tmp_path):
    assert page_cache.read_through(tmp_path) == 0 and page_cache.cached_bytes(tmp_path) == (0, 0)
