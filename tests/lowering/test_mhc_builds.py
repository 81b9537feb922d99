"""mHC kernels built for sm_90 without a GPU: the Triton kernels as launched (one wgmma shape for every
projection candidate, no FMA contraction, no spills) and the TileLang kernels through nvcc."""

from __future__ import annotations

import re
import shutil

import pytest

tk = pytest.importorskip("dsv41_passes.lowering.triton.mhc")
from dsv41_passes.lowering.triton.mhc_finish import stats_rows as fb  # noqa: E402

ITERS, HC_EPS, NORM_EPS = 20, 1e-6, 1e-6


def _sm90_builds(d: int = 5120) -> tuple[list[str], list[dict]]:
    """(names, build specs) for tests/sm90.py: every projection candidate and each elementwise kernel
    as launched, plus the post with FMA contraction on (the control for the no-FMA check)."""
    mod = "dsv41_passes.lowering.triton.mhc"
    bf16 = ("h_ptr", "y_ptr", "new_ptr", "x_ptr", "parts_ptr", "res_ptr", "out_ptr")
    names, builds = [], []

    def add(name, kernel, pointers, floats, consts, module=mod, **options):
        types = {n: ("*bf16" if n in bf16 else "*i32" if n == "count_ptr" else "*fp32") for n in pointers}
        types |= {n: "fp32" for n in floats}
        aligned = ["stride_h", "stride_y", "stride_n", "stride_x", "stride_r", "stride_o"]
        if kernel == "_finish_kernel":  # the (row block, part) norm layout unless a build sets RX
            consts = dict(RX=0) | consts
        names.append(name)
        builds.append(dict(module=module, kernel=kernel, types=types, aligned=aligned, constexprs=consts,
                           options={**tk.LAUNCH_OPTIONS, **options}))

    proj_ptrs = ("h_ptr y_ptr post_in_ptr comb_in_ptr new_ptr pre_prev_ptr x_ptr w_ptr parts_ptr scale_ptr base_ptr "
                 "pre_ptr post_ptr comb_ptr mix_ptr ws_ptr ss_ptr xss_ptr count_ptr").split()
    floats = ("hc_eps", "norm_eps", "eps")
    bk = tk.slice_geometry(d)[1]
    variants = {(c["BLOCK_M"], c["num_warps"]) for c in tk.CANDIDATES["mhc_pre"]}
    for bm, warps in sorted(variants):
        consts = dict(D=d, BK=bk, BM=bm, XB=tk._norm_block(d, bm), BOUNDARY=False, COLLAPSE=True, NORM=True,
                      MIXES=False, FINISH=True, SPLIT=1, FB=fb(bm, 16), NP2=16, PDL=False, INTERP=False)
        add(f"pre {bm}x{warps}", "_proj_kernel", proj_ptrs, floats, consts, num_warps=warps, num_stages=3)
    cfg = tk.DEFAULTS["mhc_pre"]
    bm = cfg["BLOCK_M"]
    add("pre finish=kernel", "_proj_kernel", proj_ptrs, floats,
        dict(D=d, BK=bk, BM=bm, XB=tk._norm_block(d, bm), BOUNDARY=False, COLLAPSE=True, NORM=True, MIXES=False,
             FINISH=False, SPLIT=1, FB=fb(bm, 16), NP2=16, PDL=False, INTERP=False),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    add("pre finish=kernel split=2", "_proj_kernel", proj_ptrs, floats,
        dict(D=d, BK=bk, BM=bm, XB=tk._norm_block(d, bm), BOUNDARY=False, COLLAPSE=True, NORM=True, MIXES=False,
             FINISH=False, SPLIT=2, FB=fb(bm, 32), NP2=32, PDL=False, INTERP=False),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    # the decode configs (16-row blocks on 4 warps, split 2; mma.sync, outside batch-invariant mode)
    from dsv41_passes.lowering.triton.mhc_common import SMALL_ROWS

    sb, sw = SMALL_ROWS["BLOCK_M"], SMALL_ROWS["num_warps"]
    for what, boundary in (("pre", False), ("boundary", True)):
        add(f"decode {what} {sb}x{sw} split=2", "_proj_kernel", proj_ptrs, floats,
            dict(D=d, BK=bk, BM=sb, XB=tk._norm_block(d, sb), BOUNDARY=boundary, COLLAPSE=True, NORM=True,
                 MIXES=False, FINISH=False, SPLIT=2, FB=fb(sb, 32), NP2=32, PDL=True, INTERP=False),
            num_warps=sw, num_stages=3)
    add("decode finish kernel", "_finish_kernel",
        "x_ptr w_ptr scale_ptr base_ptr pre_ptr post_ptr comb_ptr mix_ptr ws_ptr ss_ptr xss_ptr".split(), floats,
        dict(D=d, BM=sb, XB=tk._norm_block(d, sb), NC=1, NORM=True, MIXES=False, NPART=32,
             PARTS=d // tk._norm_block(d, sb), FB=fb(sb, 32), NP2=32, PDL=True, INTERP=False),
        module="dsv41_passes.lowering.triton.mhc_finish", num_warps=4)
    xb = tk._norm_block(d, bm)
    for npart, parts in ((16, 16), (32, d // xb)):  # prefill layout; split 2 with the decode layout
        add(f"finish kernel {npart} partials", "_finish_kernel",
            "x_ptr w_ptr scale_ptr base_ptr pre_ptr post_ptr comb_ptr mix_ptr ws_ptr ss_ptr xss_ptr".split(), floats,
            dict(D=d, BM=bm, XB=xb, NC=d // xb // parts, NORM=True, MIXES=False, NPART=npart, PARTS=parts,
                 FB=fb(bm, npart), NP2=npart, PDL=False, INTERP=False),
            module="dsv41_passes.lowering.triton.mhc_finish", num_warps=4)
    from dsv41_passes.lowering.triton.mhc_finish import NORM_ROWS, norm_cols

    xw = norm_cols(d, NORM_ROWS)
    add("finish kernel row-major norm", "_finish_kernel",
        "x_ptr w_ptr scale_ptr base_ptr pre_ptr post_ptr comb_ptr mix_ptr ws_ptr ss_ptr xss_ptr".split(), floats,
        dict(D=d, BM=bm, XB=xw, NC=1, NORM=True, MIXES=False, NPART=16, PARTS=0, FB=fb(bm, 16), NP2=16,
             PDL=False, RX=NORM_ROWS, INTERP=False),
        module="dsv41_passes.lowering.triton.mhc_finish", num_warps=4)
    from dsv41_passes.lowering.triton.mhc_finish import STATS_WARPS, _maxnreg_option

    for what, pdl in (("stats kernel", False), ("stats kernel pdl", True)):
        add(what, "_stats_kernel", "ws_ptr ss_ptr scale_ptr base_ptr pre_ptr post_ptr comb_ptr mix_ptr".split(),
            floats, dict(K=4 * d, BM=64, FB=32 * STATS_WARPS, NPART=16, MIXES=False, PDL=pdl),
            module="dsv41_passes.lowering.triton.mhc_finish", num_warps=STATS_WARPS, **_maxnreg_option())
    cfg = tk.DEFAULTS["mhc_boundary"]
    add("boundary", "_proj_kernel", proj_ptrs, floats,
        dict(D=d, BK=bk, BM=cfg["BLOCK_M"], XB=tk._norm_block(d, cfg["BLOCK_M"]), BOUNDARY=True, COLLAPSE=True,
             NORM=True, MIXES=False, FINISH=True, SPLIT=1, FB=fb(cfg["BLOCK_M"], 16), NP2=16, PDL=False, INTERP=False),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    cfg = tk.DEFAULTS["mhc_collapse"]
    for norm in (False, True):
        add(f"collapse norm={norm}", "_collapse_kernel", ("h_ptr", "pre_ptr", "w_ptr", "x_ptr"), ("eps",),
            dict(D=d, BK=bk, BLOCK_R=cfg["BLOCK_R"], XB=tk._norm_block(d, cfg["BLOCK_R"]), NORM=norm, SPLIT=1,
                 INTERP=False),
            num_warps=cfg["num_warps"])
    pc = tk.DEFAULTS["mhc_boundary"]  # the GPU's post + collapse config (the post_collapse form at prefill sizes)
    for split in (1, 2):
        add(f"post collapse split={split}", "_post_collapse_kernel",
            "y_ptr res_ptr post_ptr comb_ptr pre_ptr w_ptr new_ptr x_ptr".split(), ("eps",),
            dict(D=d, BK=bk, BLOCK_R=pc["post_rows"], BLOCK_D=pc["post_cols"], NORM=True, SPLIT=split, INTERP=False),
            num_warps=pc["post_warps"])
    cfg = tk.DEFAULTS["mhc_post"]
    post = dict(D=d, BLOCK_R=cfg["BLOCK_R"], BLOCK_D=cfg["BLOCK_D"], ROW_MAJOR=cfg.get("order", "row") == "row",
                INTERP=False, POLICY="evict_first")
    post_ptrs = ("y_ptr", "res_ptr", "post_ptr", "comb_ptr", "out_ptr")
    add("post", "_post_kernel", post_ptrs, (), post, num_warps=cfg["num_warps"])
    add("post with normal loads", "_post_kernel", post_ptrs, (), dict(post, POLICY=""), num_warps=cfg["num_warps"])
    add("post with FMA contraction", "_post_kernel", post_ptrs, (), post, num_warps=cfg["num_warps"],
        enable_fp_fusion=True)
    return names, builds


def test_triton_sm90_builds_one_wgmma_shape_and_no_fma():
    """The GPU builds (compiled for sm_90 with Triton's bundled ptxas, in a child process):

    * batch invariance of the tensor-core dots: every candidate (BLOCK_M, num_warps) lowers the
      projection to the same wgmma instruction;
    * GPU bits == interpreter bits: no kernel, as launched, contracts a product and a sum into an
      FMA (the control build with contraction on does); the only FMAs are the explicit ``tl.fma``
      sums of squares, which round once on both."""
    from sm90 import GPU_TRITON, build_sm90, instructions, pdl_prologue

    names, builds = _sm90_builds()
    built = dict(zip(names, build_sm90(builds)))
    if (GPU_TRITON / "triton").is_dir():  # run.sh test installs it: the PTX checked is the GPU image's Triton's
        assert {b["triton"] for b in built.values()} == {"3.6.0"}
    pre = [n for n in names if n.startswith("pre ")]
    assert len(pre) >= 4, pre
    for n in pre:
        ins = instructions(built[n]["ptx"])
        found = sorted({i.split()[0] for i in ins if i.startswith("wgmma.mma_async")})
        assert found == ["wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16"], (n, found)
        # 12 wgmma groups per chunk (4 streams x hi/mid/lo), plus the epilogue's
        groups = sum(i.startswith("wgmma.commit_group") for i in ins)
        assert groups in range(12, 20), (n, groups)
        # the hi part's dots start from a zero constant (its sums are added in fp32 registers); mid and lo
        # chain in the MMA: a fold of the hi add into the MMA chain would show as no zero-started dot
        ttir = built[n]["ttir"]
        zeros = set(re.findall(r"(%\w+) = arith.constant dense<0\.0+e\+00> : tensor<\d+x32xf32>", ttir))
        starts = [m.groups() for m in re.finditer(r"tt.dot %\w+, %(\w+), (%\w+)", ttir)]
        hi = [acc for w, acc in starts if w.startswith("w_hi")]
        assert hi and all(acc in zeros for acc in hi), (n, hi, zeros)
        assert not any(acc in zeros for w, acc in starts if not w.startswith("w_hi")), n
    # the default configs keep everything in registers (under Triton 3.9 the previous projection spilled)
    default = tk.DEFAULTS["mhc_pre"]
    usage = built[f"pre {default['BLOCK_M']}x{default['num_warps']}"]["usage"]
    assert usage and usage["STACK"] == 0 and usage["REG"] <= 255, usage
    # the post's loads of y and the residual with the evict-first policy, or (``loads`` "normal") with none
    loads = [[i for i in instructions(built[n]["ptx"]) if "ld.global" in i] for n in ("post", "post with normal loads")]
    assert sum("evict_first" in i for i in loads[0]) >= 5, loads[0][:6]
    assert len(loads[1]) == len(loads[0]) and not any("evict" in i for i in loads[1]), loads[1][:6]
    for n in ("collapse norm=False", "collapse norm=True", "post", "finish kernel 16 partials",
              "finish kernel 32 partials", "pre finish=kernel split=2", "decode pre 16x4 split=2",
              "decode boundary 16x4 split=2", "decode finish kernel", "finish kernel row-major norm",
              "post collapse split=1", "post collapse split=2", "stats kernel", "stats kernel pdl"):
        assert built[n]["usage"]["STACK"] == 0, (n, built[n]["usage"])
    # the stats kernel: a row a thread, nothing through shared memory (no barrier), within its register budget
    from dsv41_passes.lowering.triton.mhc_finish import STATS_MAXNREG, _maxnreg_option

    stats_k = built["stats kernel"]
    assert stats_k["shared"] == 0 and "bar.sync" not in stats_k["ptx"], stats_k["shared"]
    if _maxnreg_option():
        assert stats_k["usage"]["REG"] <= STATS_MAXNREG, stats_k["usage"]
    from dsv41_passes.lowering.triton.mhc_finish import _gdc_wait

    if _gdc_wait is not None:  # the pdl option: the projection lets the finish launch, the finish waits
        assert "griddepcontrol.launch_dependents" in built["decode pre 16x4 split=2"]["ptx"]
        assert "griddepcontrol.wait" in built["decode finish kernel"]["ptx"]
        assert "griddepcontrol" not in built["finish kernel 16 partials"]["ptx"]
        # the stats kernel after a TileLang ``finish_pdl`` build: its wait comes before its first global load, and
        # it is otherwise the same kernel
        pdl = pdl_prologue(built["stats kernel pdl"]["ptx"], built["stats kernel"]["ptx"])
        assert pdl == ["griddepcontrol.wait"], pdl
    # the stats' divisions and exponentials as pinned (``mhc_finish``; the TileLang fused finish repeats them): no
    # division the compiler picked (Triton 3.9 made ss / K an approximate reciprocal's product)
    for n in ("finish kernel 16 partials", "decode finish kernel", "pre 64x4", "boundary", "stats kernel"):
        ins = [i.split()[0] for i in instructions(built[n]["ptx"])]
        divs = {i for i in ins if i.startswith(("div.", "rcp.", "ex2.", "lg2."))}
        assert divs == {"div.full.f32", "div.rn.f32", "ex2.approx.f32"}, (n, divs)
    for n, b in built.items():
        # the kernels' only FMAs are their explicit sums of squares, ``tl.fma(x, x, acc)``
        fmas = [i.split(None, 1)[1].rstrip(";").replace(" ", "").split(",") for i in instructions(b["ptx"])
                if i.startswith("fma.")]
        contracted = [f for f in fmas if f[1] != f[2]]
        if n == "post with FMA contraction":
            assert contracted, "the control build should contract the combine into FMAs"
        else:
            assert not contracted, f"{n}: {len(contracted)} contracted FMAs, e.g. {contracted[0]}"


def test_tilelang_kernels_compile_for_sm90a(tmp_path, monkeypatch):
    pytest.importorskip("tilelang")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed: TileLang cannot build the sm_90a cubin")
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    from dsv41_passes.lowering.tilelang import mhc as tlk

    cfg = tlk.DEFAULTS["mhc_stats"]
    partial = tlk.compile_kernel(tlk.build_partial(5120, cfg["BLOCK_M"], cfg["threads"], cfg["num_stages"]))
    src = partial.get_kernel_source()
    assert "wgmma" in src and "tma_load" in src
    finish = tlk.compile_kernel(tlk.build_finish(5120, cfg["FINISH_ROWS"], ITERS, HC_EPS, NORM_EPS))
    assert "finish" in finish.get_kernel_source()
