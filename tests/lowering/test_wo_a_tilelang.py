"""dsv41::wo_a, the TileLang provider: its configs and defaults, the stream-K schedule, the kernels built for sm_90a
with nvcc (no GPU) and, on a GPU (``-m gpu``), every tuner candidate against the reference and the one-loop kernel's
bits."""

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from wo_a_cases import GPU_M, ROOT, TP_SHAPES, assert_bf16_gemm_close, float64_oracle, make, normwise_error, run_op

import dsv41_passes  # noqa: F401  (registers torch.ops.dsv41.*)
from dsv41_passes.lowering.registry import tilelang_available


def test_tilelang_pdl_is_the_sum_kernels():
    """``pdl`` in a TileLang config launches the split-K sum by PDL; the GEMM kernel (and its cache key) is the
    same with or without it; the tuner has it for the decode splits."""
    from dsv41_passes.lowering.tilelang import wo_a as tw

    assert tw._tile_args(dict(tw._DECODE, BN=64, SPLIT=4, pdl=True)) == tw._tile_args(dict(tw._DECODE, BN=64, SPLIT=4))
    pdl = [c for c in tw.CANDIDATES[tw.TACTIC_OP] if c.get("pdl")]
    assert pdl and all(c.get("one_loop") and c.get("SPLIT", 1) > 1 and not c.get("cluster") for c in pdl)


def test_tilelang_launch_config():
    """From M = 2048 the written-out pipeline (rope chunks de-rotated into the wgmma's A registers up to 32768);
    where the tails pass cannot tile the heads, the one-loop kernel with the same bits; BN / BK clipped to the
    shape either way."""
    from dsv41_passes.lowering.tilelang import wo_a as tw

    assert tw.default_config(2047) == tw.BATCH_INVARIANT_CONFIG
    sk = dict(stream_k=tw.STREAM_K_SHARE)  # a partial wave of at most a quarter of the CTAs shared out
    with pytest.raises(ValueError, match="stream_k needs a persistent specialized config"):
        tw.launch_config(dict(tw.BATCH_INVARIANT_CONFIG, **sk), 16, 512, 1024, 64)
    with pytest.raises(ValueError, match="stream_k needs a persistent specialized config"):
        tw.launch_config(dict(tw.SPECIALIZED_CONFIG, persistent=False, **sk), 16, 512, 1024, 64)
    assert tw.default_config(2048) == tw.default_config(32768) == dict(tw.SPECIALIZED_REGISTERS_CONFIG, **sk)
    assert tw.default_config(32769) == dict(tw.SPECIALIZED_CONFIG, **sk)
    # above 32768 the register-A kernel for TP4's 2048 columns, the rope pass for TP1's 8192
    assert tw.default_config(32769, 2048, 8) == tw.default_config(65536, 2048, 8) == tw.default_config(32768, 2048, 8)
    assert tw.default_config(65536, 8192, 8) == dict(tw.SPECIALIZED_CONFIG, **sk)
    assert tw.launch_config(tw.SPECIALIZED_CONFIG, 16, 512, 1024, 64) == dict(tw.SPECIALIZED_CONFIG, BN=256, BK=64)
    assert tw.launch_config(tw.SPECIALIZED_CONFIG, 16, 512, 1024, 0) == dict(tw.SPECIALIZED_CONFIG, BN=256, BK=64)
    assert tw.launch_config(tw.SPECIALIZED_CONFIG, 12, 512, 96, 64) == dict(tw.BATCH_INVARIANT_CONFIG, BN=32, BK=64)
    assert tw.launch_config(tw.SPECIALIZED_CONFIG, 12, 512, 1024, 0)["specialized"]  # no RoPE: no tails pass
    # the consumers de-rotate 16-byte pieces of half a row: rope dims that do not split so go to the tails pass
    cons = dict(tw.SPECIALIZED_CONFIG, rope="consumers")
    assert tw.launch_config(cons, 16, 512, 1024, 64)["rope"] == "consumers"
    assert tw.launch_config(cons, 16, 512, 1024, 24)["rope"] == "tails"
    assert tw.derotates_beforehand(tw.launch_config(cons, 16, 512, 1024, 24), 24)
    assert not tw.derotates_beforehand(tw.launch_config(cons, 16, 512, 1024, 64), 64)
    # registers: any even rope_dim up to 64 (its cos/sin held by each consumer thread), more through the tails pass
    regs = tw.SPECIALIZED_REGISTERS_CONFIG
    assert tw.launch_config(regs, 16, 512, 1024, 24)["rope"] == "registers"
    assert tw.launch_config(regs, 16, 512, 1024, 128)["rope"] == "tails"
    assert not tw.derotates_beforehand(tw.launch_config(regs, 16, 512, 1024, 64), 64)
    # a rank below the tile: BN clipped to it, and the tile's store buffer with it (one part)
    assert tw.launch_config(regs, 16, 512, 64, 64) == dict(regs, BN=64, BK=64, z_cols=64)


@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="tilelang is not installed")
@pytest.mark.parametrize("r", [32, 64])
def test_tilelang_defaults_build_for_narrow_ranks(r):
    """The tiny model's geometry (2 heads of 64 a group, rope 16) with ranks under the tiles: every default builds,
    decode to prefill sizes, 2 or 64 groups (the store buffer once kept its 128 or 64 columns and the builder refused
    it)."""
    from dsv41_passes.lowering.tilelang import wo_a as tw

    for m, g in ((1, 2), (300, 64), (1024, 64), (4096, 2), (65536, 2)):
        cfg = tw.launch_config(tw.default_config(m, g * r, 2), 2 * g, 64, r, 16)
        assert cfg["BN"] <= r and cfg.get("z_cols", 0) <= cfg["BN"], (m, g, cfg)
        assert "wgmma" in tw.lower_source(g, r, 2, 64, 16, cfg), (m, g, cfg)


def test_tilelang_decode_split_fills_one_wave():
    """M <= 128: 64-column tiles, K split over whole heads into the most parts (a power of two, <= 8) whose grid
    stays within one wave; without the geometry, the per-bucket table."""
    from dsv41_passes.lowering.tilelang import wo_a as tw

    assert tw.default_config(128, 2048, 8) == dict(tw._DECODE, BN=64, SPLIT=4, stages=8)  # TP4: 32 x 4 CTAs, 132 SMs
    assert tw.default_config(1, 2048, 8)["SPLIT"] == 4
    assert tw.default_config(128, 8192, 8)["SPLIT"] == 1  # TP1: 128 column tiles fill the SMs already
    assert tw.decode_config(100, 1024, 8, 132)["SPLIT"] == 8  # 16 x 8
    assert tw.decode_config(100, 1024, 2, 132)["SPLIT"] == 2  # no more parts than heads
    assert tw.decode_config(100, 2048, 8, 64)["SPLIT"] == 2  # a smaller GPU
    assert tw.decode_config(5, 32, 8, 132)["SPLIT"] == 8 and tw.decode_config(5, 32, 8, 4)["SPLIT"] == 4  # N < 64
    assert tw.default_config(129, 2048, 8) == tw.default_config(129) == dict(tw._DECODE, SPLIT=4)
    assert tw.default_config(128) == dict(tw._DECODE, SPLIT=8)


def test_tilelang_mid_config_by_tiles():
    """128 < M < 2048 with the geometry: the register-A kernel with the widest tile whose grid reaches half a wave,
    else the one-loop kernel split into the most parts that stay within one wave."""
    from dsv41_passes.lowering.tilelang import wo_a as tw

    regs256 = dict(tw.SPECIALIZED_REGISTERS_CONFIG, stream_k=tw.STREAM_K_SHARE)
    # TP4: N 2048, 8 heads a group
    for m in (129, 256):  # 64-column tiles: 64 of them, under half a wave
        assert tw.mid_config(m, 2048, 8, 132) == dict(tw._DECODE, SPLIT=4), m
    assert tw.mid_config(384, 2048, 8, 132) == tw.mid_config(512, 2048, 8, 132) == tw.REGISTERS_64  # 96 / 128 tiles
    assert tw.mid_config(1024, 2048, 8, 132) == tw.REGISTERS_128  # 16 x 8 tiles
    assert tw.mid_config(2047, 2048, 8, 132) == regs256 == tw.default_config(2048, 2048, 8)  # 8 x 16 tiles
    # TP1: N 8192
    assert tw.mid_config(129, 8192, 8, 132) == tw.mid_config(256, 8192, 8, 132) == tw.REGISTERS_128  # 64 x 2 tiles
    assert tw.mid_config(512, 8192, 8, 132) == regs256  # 32 x 4 tiles
    assert tw.mid_config(512, 8192, 8, 1024) == tw.REGISTERS_64  # a larger GPU
    # the split: the most parts that keep 128 x 128 tiles within one wave, no more than the heads
    assert tw.split_config(256, 2048, 8, 132) == dict(tw._DECODE, SPLIT=4)  # 16 x 2 tiles
    assert tw.split_config(512, 2048, 8, 132) == dict(tw._DECODE, SPLIT=2)
    assert tw.split_config(256, 8192, 8, 132) == tw._DECODE
    assert tw.split_config(256, 2048, 2, 132) == dict(tw._DECODE, SPLIT=2)
    # with this device's SMs; without the geometry, the per-bucket table
    assert tw.default_config(1000, 2048, 8) == tw.mid_config(1000, 2048, 8, tw.sm_count())
    assert tw.default_config(2047) == tw.BATCH_INVARIANT_CONFIG
    assert tw.default_config(1025, 8192, 8) != tw.default_config(1025)


def test_tilelang_untuned_config_is_its_buckets():
    """Without a tuned tactic a call at any M runs the config of its tuning bucket, which warm-up compiled: the
    tile-count rules never pick a config within a bucket that its top M does not (TP4, TP1, the tiny model, an odd
    geometry, a smaller GPU)."""
    from dsv41_passes.lowering.tilelang import wo_a as tw
    from dsv41_passes.tuning import bucket, buckets

    ms = list(range(1, 2100)) + [4095, 4097, 30000, 32768, 32769, 65535, 65536, 70000]
    for n, hpg in ((2048, 8), (8192, 8), (64, 2), (1536, 6)):
        warm = [tw.untuned_config(b, n, hpg) for b in buckets()]
        for m in ms:
            cfg = tw.untuned_config(m, n, hpg)
            assert cfg == tw.untuned_config(bucket(m), n, hpg) and cfg in warm, (n, hpg, m)
    # the bucket's top decides: TP4 M = 257 (three row blocks, 96 tiles of 64 columns) runs M = 512's config
    assert tw.untuned_config(257, 2048, 8) == tw.default_config(512, 2048, 8) == tw.REGISTERS_64


@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="tilelang is not installed")
@pytest.mark.parametrize("share", [1.0, 0.5])
@pytest.mark.parametrize("tiles", [1, 100, 128, 131, 132, 133, 165, 166, 200, 256, 264, 1000, 1024, 4096])
def test_stream_k_schedule_covers_each_chunk_once(tiles, share):
    """The stream_k schedule (the kernel's integer math, in Python): every chunk of every tile once; a cut tile's
    head is the last item of a CTA and its other parts the first shared-out items of the next CTAs, at most
    ``stream_k_partners`` of them; the chunk counts differ by at most one when a partial wave is shared out."""
    from dsv41_passes.lowering.tilelang.wo_a_specialized import stream_k_partners, stream_k_schedule

    ctas, total = 132, 64
    sched = stream_k_schedule(tiles, ctas, total, share)
    seen: dict[int, list[tuple[int, int, int]]] = {}
    whole = tiles // ctas - (1 if 4 * (tiles % ctas) <= ctas else 0)  # round-robin waves (wide / narrow)
    for b, items in enumerate(sched):
        for i, (tile, lo, hi) in enumerate(items):
            assert 0 <= lo < hi <= total
            seen.setdefault(tile, []).append((lo, hi, b))
            if lo > 0:  # a CTA's first item after its whole tiles
                assert i == whole, (b, items)
            if hi < total:  # the last item
                assert i == len(items) - 1, (b, items)
    assert sorted(seen) == list(range(tiles))
    for tile, parts in seen.items():
        parts.sort()
        assert parts[0][0] == 0 and parts[-1][1] == total and len(parts) <= 1 + stream_k_partners(total), (tile, parts)
        for (_, h, b0), (lo, _, b1) in zip(parts, parts[1:]):
            assert h == lo and b1 == b0 + 1, (tile, parts)
    work = [sum(hi - lo for _, lo, hi in items) for items in sched]
    if tiles > ctas and 0 < tiles % ctas <= share * ctas:
        assert max(work) - min(work) <= 1, work
    else:  # whole tiles, round-robin
        assert all(lo == 0 and hi == total for items in sched for _, lo, hi in items)


def test_tilelang_specialized_checks_its_register_split():
    """setmaxnreg moves registers between warpgroups within what the launch holds; a split past it would
    make the consumers' ``setmaxnreg.inc`` wait forever (a hang, run 99), so the builder refuses it."""
    from dsv41_passes.lowering.tilelang.wo_a_specialized import build_specialized

    assert build_specialized(2, 1024, 8, 512, 64, 128, 256, 64, 3) is not None  # 24 + 2 x 240 at 384 threads
    with pytest.raises(ValueError, match="setmaxnreg"):
        build_specialized(2, 1024, 8, 512, 64, 192, 256, 64, 3)  # 3 consumers at 512 threads: 128 each
    with pytest.raises(ValueError, match="rope"):
        build_specialized(2, 1024, 8, 512, 24, 128, 256, 64, 3, rope="consumers")


_TILELANG_BUILD = """
import json, sys
from dsv41_passes.lowering.tilelang import wo_a as tw
g, r, hpg, d, rd = 2, 1024, 8, 512, 64  # DeepSeek-V4.1-Flash per rank at TP4
out = {}
bn, bk = tw._tiles(tw.BATCH_INVARIANT_CONFIG, d, r, rd)
kernel = tw.compile_kernel(g, r, hpg, d, rd, dict(tw.BATCH_INVARIANT_CONFIG, BN=bn, BK=bk))  # nvcc, sm_90a
out["batch_invariant"] = kernel.get_kernel_source()
bn, bk = tw._tiles(tw.default_config(1), d, r, rd)
out["decode"] = tw.lower_source(g, r, hpg, d, rd, tw.launch_config(tw.default_config(1, g * r, hpg), hpg * g, d, r, rd))
one_loop = [c for c in tw.CANDIDATES[tw.TACTIC_OP] if c.get("one_loop")]
big = max(one_loop, key=lambda c: (c["BM"] * c["BN"], c["stages"]))
out["one_loop"] = tw.compile_kernel(g, r, hpg, d, rd, big).get_kernel_source()  # nvcc, sm_90a
bn, bk = tw._tiles(tw.default_config(2047), d, r, rd)
out["prefill_default"] = tw.compile_kernel(g, r, hpg, d, rd, dict(tw.default_config(2047), BN=bn, BK=bk)
                                           ).get_kernel_source()  # nvcc, sm_90a
for rope in (rd, 0):  # the default above M = 32768 (without stream-K), with and without the inverse RoPE
    bn, bk = tw._tiles(tw.SPECIALIZED_CONFIG, d, r, rope)
    out[f"specialized_rd{rope}"] = tw.compile_kernel(g, r, hpg, d, rope, dict(tw.SPECIALIZED_CONFIG, BN=bn, BK=bk)
                                                     ).get_kernel_source()  # nvcc, sm_90a
cons = tw.launch_config(tw.SPECIALIZED_CONSUMERS_CONFIG, hpg * g, d, r, rd)  # a tuner candidate
out["specialized_consumers"] = tw.compile_kernel(g, r, hpg, d, rd, cons).get_kernel_source()  # nvcc, sm_90a
regs = tw.launch_config(tw.SPECIALIZED_REGISTERS_CONFIG, hpg * g, d, r, rd)  # the default, 2048 to 32768 (no stream-K)
out["specialized_registers"] = tw.compile_kernel(g, r, hpg, d, rd, regs).get_kernel_source()  # nvcc, sm_90a
out["specialized_stream_k"] = tw.compile_kernel(g, r, hpg, d, rd, tw.launch_config(tw.default_config(16384), hpg * g,
                                                                                   d, r, rd)).get_kernel_source()
out["specialized_wg_store"] = tw.lower_source(g, r, hpg, d, rd, dict(regs, wg_store=True))
out["specialized_registers_rd24"] = tw.lower_source(g, r, hpg, d, 24, tw.launch_config(regs, hpg * g, d, r, 24))
out["specialized_one_pass"] = tw.lower_source(g, r, hpg, d, rd, dict(cons, persistent=False))
regs = max((c for c in one_loop if c.get("rope_regs")), key=lambda c: (c["BM"] * c["BN"], c["stages"]))
out["one_loop_rope_regs"] = tw.compile_kernel(g, r, hpg, d, rd, regs).get_kernel_source()  # nvcc, sm_90a
for m in (512, 1024):  # the defaults at TP4 M = 512 and 1024: the register-A kernel, 64 / 128 columns, a CTA a tile
    out[f"mid_{m}"] = tw.lower_source(g, r, hpg, d, rd, tw.launch_config(tw.default_config(m, g * r, hpg), hpg * g, d,
                                                                         r, rd))
clu = [c for c in one_loop if c.get("cluster") and c["BN"] == 64][0]  # split-K summed by the cluster
out["decode_cluster"] = tw.compile_kernel(g, r, hpg, d, rd, tw.launch_config(clu, hpg * g, d, r, rd)
                                          ).get_kernel_source()  # nvcc, sm_90a
json.dump(out, sys.stdout)
"""


def _tilelang_missing() -> str | None:
    try:
        import tilelang  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the install
        return f"tilelang is not importable ({type(e).__name__}: {e})"
    if shutil.which("nvcc") is None:
        return "nvcc is not on PATH (TileLang compiles CUDA sources with it)"
    return None


@pytest.mark.skipif(_tilelang_missing() is not None, reason=str(_tilelang_missing()))
def test_tilelang_compiles_for_sm90a(tmp_path):
    import json

    env = dict(os.environ, TILELANG_CACHE_DIR=str(tmp_path / "tilelang"),
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(_TILELANG_BUILD)], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    sources = json.loads(r.stdout.strip().splitlines()[-1])
    for name, src in sources.items():
        assert "wgmma" in src, f"{name}: no tensor-core wgmma in the sm_90a source"
        assert "int M" in src, f"{name}: the token count is not a runtime argument"
    assert "tma_load" in sources["batch_invariant"]
    # batch-invariant = prefill default: the bf16 tile leaves through shared memory by TMA (epi_smem)
    assert "tma_store" in sources["batch_invariant"] and "tma_store" in sources["prefill_default"]
    # decode default: split-K, the part index is the third grid axis and the partials are fp32
    assert "blockIdx.z" in sources["decode"] and "float* __restrict__ Z" in sources["decode"]
    assert "blockIdx.z" not in sources["prefill_default"]
    # one K loop: warpgroups split the 128 x 256 tile by rows (wgmma m64n256), rope chunks in place
    one = sources["one_loop"]
    assert "tma_load" in one and "64, 256, 16, false" in one and "x1 * c" in one
    # the in-place de-rotation reads every pair, then writes them back: no barrier inside the read loop
    # (a single read-modify-write loop made TileLang put one between the loads and stores of each pair)
    for src in (one, sources["prefill_default"]):
        head = src[: src.index("x0 * c")]
        assert "__sync_thread_partial" not in head[head.rindex("for (int"):]
    # the prefill default loads each thread's cos/sin once, before the K loop (CS is read nowhere else)
    pre = sources["prefill_default"]
    assert pre.rindex("CS[") < pre.index("for (int t_1") and "c_f[" in pre
    # rope chunks de-rotated into registers: a register-A wgmma next to the shared-A one
    regs = sources["one_loop_rope_regs"]
    assert "wgmma_rs" in regs and "wgmma_ss" in regs and "x * c" in regs
    assert "wgmma_rs" not in one
    # the pipeline written out: producer / consumer register split, one TMA issue of A a chunk (from o, or
    # for a head's last chunk from the de-rotated tails), no CTA-wide barrier after the set-up, no
    # de-rotation in the kernel, the tile stored by TMA after a proxy fence
    for rope in (64, 0):
        src = sources[f"specialized_rd{rope}"]
        assert "warpgroup_reg_dealloc<24>" in src and "warpgroup_reg_alloc<240>" in src
        assert src.count("tl::tma_load(O_desc") == 1 and src.count("tl::tma_load(W_desc") == 1
        assert src.count("tl::tma_load(CS_desc") == (1 if rope else 0)
        assert src.count("__syncthreads()") == 1 and "x1 * c" not in src and "x0 * c" not in src
        assert "fence_proxy_async" in src and "tma_store" in src and "64, 256, 16, false" in src
        # persistent: one CTA an SM (an H200's 132 here) walks the tiles, so the stage ring's count runs on
        # across tiles, the last stage of a tile is released, and z_s is free again before it is rewritten
        assert "/ 132)" in src and "(it_1 * 64) + t_1" in src and src.count("__sync_thread_partial(1, 256)") == 2
    # rope chunks de-rotated by the consumers: each thread's cos/sin once a tile (16-byte loads), its pairs in
    # 16-byte pieces of the stage, a proxy fence and its own warpgroup's barrier before the wgmma; no tails
    for name in ("specialized_consumers", "specialized_one_pass"):
        src = sources[name]
        assert "CS_desc" not in src and "float* __restrict__ CS" in src and "*(float4*)(CS" in src
        assert src.count("*(uint4*)(x_r + 0) = *(uint4*)(((bfloat16_t*)a_s)") == 1
        assert "(x0 * c0) + (x1 * s0)" in src and "(x1 * c0) - (x0 * s0)" in src
        head = src[src.index("(x1 * c0) - (x0 * s0)"):src.index("wgmma_ss")]
        assert "fence_proxy_async" in head and "__sync_thread_partial(((((int)threadIdx.x) >> 7) + 1), 128)" in head
    assert "/ 132)" in sources["specialized_consumers"] and "/ 132)" not in sources["specialized_one_pass"]
    # 128 < M < 2048: the register-A kernel with 64 / 128-column tiles, one CTA a tile (not persistent)
    for m, bn in ((512, 64), (1024, 128)):
        src = sources[f"mid_{m}"]
        assert f"64, {bn}, 16, false" in src and "wgmma_rs" in src and "tma_store" in src and "/ 132)" not in src
    # rope chunk de-rotated into registers: cos / +-sin loaded once a tile before the K loop, the chunk read from
    # the stage into the A fragment of a register-A wgmma; no shared-memory write, fence or barrier in the loop
    # until the tile's store
    for name in ("specialized_registers", "specialized_registers_rd24"):
        src = sources[name]
        loop = src[src.index("for (int t_1"):src.index("tl::wait_wgmma<0>()")]
        assert "CS_desc" not in src and "float* __restrict__ CS" in src and "CS[" not in loop, name
        assert "wgmma_rs" in loop and "wgmma_ss" in loop and "c_f[" in loop and "s_f[" in loop, name
        assert "fence_proxy_async" not in loop and "__sync_thread_partial" not in loop, name
        assert "((bfloat16_t*)a_s)[" in loop and "= ((bfloat16_t)" in loop, name
    # split-K summed by the tile's cluster: each CTA's fp32 partial stays in its shared memory, a cluster barrier,
    # then four columns a call read from every CTA (mapa + ld.shared::cluster) in part order, the bf16 z stored
    # (no fp32 partial tensor), and a second cluster barrier before any CTA leaves
    src = sources["decode_cluster"]
    assert "blockIdx.z" in src and "bfloat16_t* __restrict__ Z" in src and "float* __restrict__ Z" not in src
    assert "mapa.shared::cluster.u32" in src and "ld.shared::cluster.v4.f32" in src
    body = src[src.index("__launch_bounds__"):]
    sync1 = body.index("tl::cluster_sync()")
    assert body.count("tl::cluster_sync()") == 2 and sync1 < body.index("dsv41_cluster_sum4(") < body.rindex(
        "tl::cluster_sync()")
    # stream_k: a cut tile's tail partial is stored to WS[block], each thread fences, the consumers meet, then one
    # thread publishes the flag (release); the head's CTA takes the next CTAs' flags (acquire), the consumers meet,
    # then add their WS in CTA order; only an item that starts at chunk 0 stores z
    src = sources["specialized_stream_k"]
    assert "st.release.gpu.global.b32" in src and "ld.acquire.gpu.global.b32" in src
    assert "% 132)) < 33)" in src  # the default shares out a partial wave of at most 33 of 132 tiles
    body = src[src.index("__launch_bounds__"):]
    tail = body[body.index("if (0 < lo"):body.index("dsv41_flag_set(")]
    assert tail.index("*(float4*)(WS + ") < tail.index("dsv41_fence();") < tail.index("__sync_thread_partial(1, 256)")
    # partials thread-major in 16-byte pieces (``ws_index``): a warp stores and loads 512 contiguous bytes
    assert "(i_3 * 1024)) + (((int)threadIdx.x) * 4))" in tail and "float2*)(WS" not in body
    head = body[body.index("dsv41_flag_take("):]
    assert head.index("__sync_thread_partial(1, 256)") < head.index("*(float4*)(WS + ") < head.index("tma_store(Z_desc")
    # the parts of up to 4 next CTAs (a narrow phase gives each at least a quarter of the tile's 64 chunks)
    assert "for (int q = 0; q < 4; ++q)" in body and "FL[((((int)blockIdx.x) + q) + 1)]" in body
    assert "dsv41_flag" not in sources["specialized_registers"]
    # wg_store: each consumer warpgroup (threads 128-255, 256-383) writes its 64 rows into a buffer of its own, meets
    # on a barrier of its own (2, 3) and its leader stores them; a store's read is waited for only before the
    # buffer is written again and before the CTA leaves; no barrier of all the consumers
    src = sources["specialized_wg_store"]
    body = src[src.index("__launch_bounds__"):]
    assert body.count("tl::tl_shuffle_elect<128>()") == 2 and body.count("__sync_thread_partial(1, 256)") == 0
    assert body.count("__sync_thread_partial(((((int)threadIdx.x) >> 7) + 1), 128)") == 4
    assert body.count("tl::tma_store_wait<0, true>();") == 3 and body.rstrip().endswith("}")
    part = body[body.index("tl::tma_store_wait<0, true>();"):]
    wait, sync = part.index("__sync_thread_partial(((((int)"), part.index("fence_proxy_async")
    assert wait < sync < part.index("tma_store(Z_desc")
    # with 4 stages of 48 KiB: the tile leaves in two 128-column halves through one 32 KiB buffer
    src = sources["specialized_registers"]
    assert "/ 132)" in src and "buf_dyn_shmem + 196608)" in src and "(t_1 + 3) & 3" in src
    assert src.count("tl::tma_store(Z_desc") == 2 and src.count("tl::tma_store_wait<0, true>()") == 2


def _tilelang_candidates(tp, seed, pick, ms=GPU_M):
    """``(cfg, o, w, cos, sin)`` for every TileLang tuner candidate ``pick`` accepts, every M of ``ms``, with and
    without the inverse RoPE (cos = sin = None)."""
    if tilelang_available(torch.empty(0, device="cuda")):
        pytest.skip(tilelang_available(torch.empty(0, device="cuda")))
    from dsv41_passes.lowering.tilelang import wo_a as tw

    h, d, g, r, rd = TP_SHAPES[tp]
    o_all, w, _, cos_all, sin_all = make(max(ms), h, d, g, r, rd, seed=seed, device="cuda")
    for cfg in [c for c in tw.CANDIDATES[tw.TACTIC_OP] if pick(c)]:
        for m in ms:
            for c, s in ((cos_all[:m], sin_all[:m]), (None, None)):
                yield cfg, o_all[:m], w, c, s


@pytest.mark.gpu
@pytest.mark.parametrize("tp", sorted(TP_SHAPES))
def test_gpu_tilelang_one_loop_configs(tp):
    """Every tuner candidate of the one-loop TileLang kernel, with and without the inverse RoPE."""
    from dsv41_passes.lowering.tilelang import wo_a as tw

    _, _, g, _, rd = TP_SHAPES[tp]
    for cfg, o, w, c, s in _tilelang_candidates(tp, 5, lambda c: c.get("one_loop")):
        out = tw.wo_a(o, w, c, s, rd, batch_invariant=False, config=cfg)
        assert_bf16_gemm_close(out, run_op("reference", o, w, c, s, rd))
        assert normwise_error(out, float64_oracle(o, w, c, s, rd, g)) <= 4e-3, (cfg, o.shape[0], c is not None)


@pytest.mark.gpu
@pytest.mark.parametrize("tp", sorted(TP_SHAPES))
def test_gpu_tilelang_pdl_sum_gives_the_same_bits(tp):
    """The split-K sum launched by PDL waits for the GEMM's parts: the bits of the same split launched plainly, on a
    stream and replayed in a CUDA graph right after other work."""
    from dsv41_passes.lowering.tilelang import wo_a as tw

    _, _, _, _, rd = TP_SHAPES[tp]
    for cfg, o, w, c, s in _tilelang_candidates(tp, 11, lambda c: c.get("pdl"), (1, 7, 130, 300, 1000)):
        base = tw.wo_a(o, w, c, s, rd, batch_invariant=False, config=dict(cfg, pdl=False))
        out = tw.wo_a(o, w, c, s, rd, batch_invariant=False, config=cfg)
        assert torch.equal(out.view(torch.int16), base.view(torch.int16)), (cfg, o.shape[0], c is not None)
        graph, noise = torch.cuda.CUDAGraph(), torch.empty(1 << 22, device="cuda")
        with torch.cuda.graph(graph):
            noise.normal_()
            got = tw.wo_a(o, w, c, s, rd, batch_invariant=False, config=cfg)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got.view(torch.int16), base.view(torch.int16)), (cfg, o.shape[0], "graph")


@pytest.mark.gpu
@pytest.mark.parametrize("tp", sorted(TP_SHAPES))
def test_gpu_tilelang_specialized_gives_the_one_loop_bits(tp):
    """The written-out pipeline, its rope chunks de-rotated beforehand or by its consumers, persistent or not: the
    128 x 256 one-loop kernel's bits, every M."""
    from dsv41_passes.lowering.tilelang import wo_a as tw

    _, _, g, _, rd = TP_SHAPES[tp]
    for cfg, o, w, c, s in _tilelang_candidates(tp, 7, lambda c: c.get("specialized") and not c.get("stream_k")):
        out = tw.wo_a(o, w, c, s, rd, batch_invariant=False, config=cfg)
        base = tw.wo_a(o, w, c, s, rd, batch_invariant=False, config=tw.BATCH_INVARIANT_CONFIG)
        assert torch.equal(out.view(torch.int16), base.view(torch.int16)), (cfg, o.shape[0], c is not None)
    assert normwise_error(out, float64_oracle(o, w, None, None, rd, g)) <= 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("tp", sorted(TP_SHAPES))
def test_gpu_tilelang_stream_k_cuts_only_its_schedule_tiles(tp):
    """stream_k: the tiles its schedule leaves whole have the one-loop kernel's bits; the cut ones (head + the next
    CTAs' partials, summed once) are within bf16 GEMM tolerance; batch-invariant mode runs the uncut kernel. Besides
    GPU_M (narrow phases at 4096 and at TP1 1000-4096), one M with a wide phase a geometry (a partial wave of 12 and
    of 28 tiles)."""
    from dsv41_passes.lowering.tilelang import wo_a as tw
    from dsv41_passes.lowering.tilelang.wo_a_specialized import stream_k_schedule

    _, d, g, r, rd = TP_SHAPES[tp]
    cut_somewhere = False
    wide = {"tp4": 2304, "tp1": 640}[tp]
    for cfg, o, w, c, s in _tilelang_candidates(tp, 9, lambda c: c.get("stream_k"), GPU_M + (wide,)):
        m = o.shape[0]
        out = tw.wo_a(o, w, c, s, rd, batch_invariant=False, config=cfg)
        base = tw.wo_a(o, w, c, s, rd, batch_invariant=False, config=tw.BATCH_INVARIANT_CONFIG)
        bm, bn = cfg["BM"], cfg["BN"]
        col_tiles = g * r // bn
        total = (o.shape[1] // g) * d // cfg["BK"]  # K chunks a tile
        sched = stream_k_schedule(col_tiles * -(-m // bm), tw.sm_count(), total, cfg["stream_k"])
        cut = {tile for items in sched for tile, lo, hi in items if hi - lo < total}
        same = torch.ones_like(out, dtype=torch.bool)
        for tile in cut:
            by, bx = divmod(tile, col_tiles)
            same[by * bm:(by + 1) * bm, bx * bn:(bx + 1) * bn] = False
        cut_somewhere |= bool(cut)
        assert torch.equal(out.view(torch.int16)[same], base.view(torch.int16)[same]), (cfg, m, c is not None)
        assert_bf16_gemm_close(out, base)
        assert normwise_error(out, float64_oracle(o, w, c, s, rd, g)) <= 4e-3, (cfg, m, c is not None)
        again = tw.wo_a(o, w, c, s, rd, batch_invariant=False, config=cfg)  # the flags were all taken
        assert torch.equal(again.view(torch.int16), out.view(torch.int16)), (cfg, m)
        inv = tw.wo_a(o, w, c, s, rd, batch_invariant=True, config=cfg)
        assert torch.equal(inv.view(torch.int16), base.view(torch.int16)), (cfg, m)
    assert cut_somewhere


@pytest.mark.gpu
@pytest.mark.parametrize("tp", sorted(TP_SHAPES))
def test_gpu_tilelang_wg_store_gives_the_one_loop_bits(tp):
    """Each consumer warpgroup storing its own rows of the tile (``wg_store``; rows past M clipped by its TMA
    store): the one-loop kernel's bits at every M, with and without the inverse RoPE, twice in a row."""
    from dsv41_passes.lowering.tilelang import wo_a as tw

    h, d, g, r, rd = TP_SHAPES[tp]
    if tilelang_available(torch.empty(0, device="cuda")):
        pytest.skip(tilelang_available(torch.empty(0, device="cuda")))
    o_all, w, _, cos_all, sin_all = make(max(GPU_M), h, d, g, r, rd, seed=13, device="cuda")
    for cfg in (dict(tw.SPECIALIZED_REGISTERS_CONFIG, wg_store=True), dict(tw.SPECIALIZED_CONFIG, wg_store=True)):
        for m in GPU_M:
            for c, s in ((cos_all[:m], sin_all[:m]), (None, None)):
                o = o_all[:m]
                base = tw.wo_a(o, w, c, s, rd, batch_invariant=False, config=tw.BATCH_INVARIANT_CONFIG)
                for _ in range(2):
                    out = tw.wo_a(o, w, c, s, rd, batch_invariant=False, config=cfg)
                    assert torch.equal(out.view(torch.int16), base.view(torch.int16)), (cfg, m, c is not None)
