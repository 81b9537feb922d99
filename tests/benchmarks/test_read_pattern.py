"""benchmarks/probe_read_pattern.py: each read order visits every column of a row block's streams once (so its
bytes are the residual's), and the probe kernel builds for sm_90a with TMA loads, their eviction policy and the
threads' or TMA stores of x as asked."""

import shutil

import pytest

from benchmarks import probe_read_pattern as rp


@pytest.mark.parametrize("order", ["slices", "interleaved", "rows"])
@pytest.mark.parametrize("box", [32, 64])
def test_orders_cover_each_column_once(order, box):
    d = 5120
    ctas = rp.SLICES if order != "rows" else 1  # (rows: one CTA walks the whole row block)
    steps = d // rp.SLICES // box if order != "rows" else d // box
    cols = [rp.column(order, d, box, s, u) + c for s in range(ctas) for u in range(steps) for c in range(box)]
    assert sorted(cols) == list(range(d))


def test_probe_builds_for_sm90a(tmp_path, monkeypatch):
    pytest.importorskip("tilelang")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed: TileLang cannot build the sm_90a cubin")
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    plain = rp.compile_read("slices", 4096, 5120, 64, 32, 4, False).get_kernel_source()
    assert plain.count("tl::tma_load(h_desc") == 4 and "EVICT_FIRST" not in plain and "x[" not in plain
    first = rp.compile_read("slices", 4096, 5120, 64, 32, 4, True, "st", "evict_first").get_kernel_source()
    assert first.count("tma_load<tl::CacheHintSm90::EVICT_FIRST>(h_desc") == 4 and "tma_store" not in first
    tma = rp.compile_read("slices", 4096, 5120, 64, 32, 4, True, "tma").get_kernel_source()
    assert tma.count("tl::tma_store(x_desc") == 1
