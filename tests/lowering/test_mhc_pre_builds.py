"""The TileLang ``mhc_pre`` kernel built for sm_90a without a GPU (``mhc_pre_kernel.build``): every config's source and
SASS (the wgmma shape, no contraction, TMA with its hints, the roles' barriers, no spills, the wgmmas asynchronous,
the shared memory), the ``boundary``, ``diag`` and other build options and their checks. The op, its provider and the
GPU tests: ``test_mhc_pre_tilelang.py``."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from mhc_cases import BOUNDARY_OPTS, BUILD_CONFIG_NAMES, PRE_CONFIG_NAMES, opts_id

FLASH_D = 5120
ITERS, HC_EPS, NORM_EPS, EPS = 20, 1e-6, 1e-6, 1e-6


def _stage_of(step: str, stages: int) -> str:
    """The source's stage index of ``step`` (TileLang writes a power-of-two modulus as a mask)."""
    return f"({step} & {stages - 1})" if stages & (stages - 1) == 0 else f"({step} % {stages})"


def test_build_configs_take_every_option():
    """The configs CI builds (``BUILD_CONFIG_NAMES``) are configs, the defaults among them, and every build option a
    config of PRE_CONFIG_NAMES sets, at each value it takes there, is set so by one of them."""
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp

    assert set(BUILD_CONFIG_NAMES) <= set(PRE_CONFIG_NAMES) <= set(tlp.CONFIGS)
    built = [tlp.CONFIGS[n] for n in BUILD_CONFIG_NAMES]
    assert tlp.DEFAULT_CONFIG in built and tlp.BOUNDARY_CONFIG in built
    assert {k: v for k, v in tlp.DEFAULT_CONFIG.items() if k != "hi_multicast"} in built  # (where pairs do not fit)
    taken = {(k, repr(v)) for c in built for k, v in c.items()}
    missing = {(n, k, repr(v)) for n in PRE_CONFIG_NAMES for k, v in tlp.CONFIGS[n].items()
               if (k, repr(v)) not in taken}
    assert not missing, sorted(missing)


@pytest.mark.parametrize("name", BUILD_CONFIG_NAMES)
def test_compiles_for_sm90a(name, tmp_path, monkeypatch):
    """The sm_90a build: one wgmma shape (m64n24k16, the 24 mix columns unpadded), rounding spelled out
    (no contraction: nvcc --fmad=false and explicit __f*_rn), the residual loads by TMA with the
    evict-first hint (or none with ``loads_evict_first`` off), no register spills, and the shared memory within
    the 227 KiB an SM gives a block.
    With a producer warpgroup: warp 0 alone issues the copies, each stage's reuse waits for the consumers'
    release, and after the set-up no barrier takes the whole CTA. With two stage rings: warp 1 fills the second,
    and each consumer warpgroup has a loop of its own (its own wgmma, 12 a step). With split roles: warpgroup 1
    issues every wgmma, warpgroup 2 stores x and publishes the norm partials. With the collapse held in registers
    (``held_norm``): the registers moved by setmaxnreg (honored by ptxas), x stored once a value and never read back.
    With ``hi_multicast``: rank 0 of a cluster loads the streamed hi part into all its CTAs, the residual only for a
    row block within M, a warp's one arrival on each other CTA's stage barrier after its own, cluster barriers at both
    ends."""
    pytest.importorskip("tilelang")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed: TileLang cannot build the sm_90a cubin")
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp

    cfg = dict(tlp.CONFIGS[name])
    if cfg.get("fused_finish"):  # (the host adds the model's Sinkhorn iterations and eps)
        cfg["finish_consts"] = (ITERS, HC_EPS, NORM_EPS)
    producer = cfg.get("producer", False)
    rings = cfg.get("rings", 1)
    split = cfg.get("split_roles", False)
    k = tlp.compile_kernel(tlp.build(FLASH_D, 8, EPS, **cfg), producer)
    src = k.get_kernel_source()
    mcast = cfg.get("hi_multicast", False)
    if producer:  # the barriers' initialization (with a cluster, a cluster barrier)
        assert src.count("__syncthreads()") == (0 if mcast else 1)
        assert "if (((int)threadIdx.x) < 32) {" in src and "tl_shuffle_elect<32>" in src
        assert "tl_shuffle_elect<128>" not in src and "tl_shuffle_elect<256>" not in src
        if rings == 1:
            assert f"empty[{_stage_of('q', cfg['stages'])}].wait(" in src and "].arrive();" in src
        else:  # warp w waits on ring w's stages
            assert "if (((int)threadIdx.x) < 64) {" in src
            assert "empty[(((((int)threadIdx.x) >> 5) * 2) + (q & 1))].wait(" in src
            assert "if (((int)threadIdx.x) < 256) {" in src and "if (256 <= ((int)threadIdx.x)) {" in src
        # two consumer warpgroups (384 threads) need registers moved to them; one (256) has them already, and
        # with three (512) each role keeps the launch's 128
        vec_wgs = cfg.get("vec_wgs", 1)
        assert ("warpgroup_reg_alloc<240>" in src) == (cfg["wgs"] * rings * (1 + vec_wgs if split else 1) == 2)
        assert "warpgroup_reg_alloc" not in src or vec_wgs == 1 or cfg.get("held_norm")
        if split:
            dots, rest = src.split("if (256 <= ((int)threadIdx.x)) {")
            assert "if (((int)threadIdx.x) < 256) {" in dots and "wgmma_ss<" not in rest
            assert "AtomicStore" in rest and "AtomicStore" not in dots.split("if (((int)threadIdx.x) < 256) {")[1]
            # two vector warpgroups: 512 threads, four a row, the runs' sums paired across lanes 1 then 2 apart
            assert f"__launch_bounds__({256 + 128 * vec_wgs}" in src
            lanes = set(re.findall(r"__shfl_xor_sync\([^,]*, [^,]*, (\d+)", rest))
            assert lanes == ({"1", "2"} if vec_wgs == 2 else {"1"}), lanes
    if cfg.get("norm_wg"):  # warps 2-3 (or 1-3) alone poll the norm partials; the vector role hands blocks over, back
        front, vector = src.split("if (256 <= ((int)threadIdx.x)) {")
        first = 128 - 32 * cfg.get("norm_warps", 2)
        polls = 3 if cfg.get("norm_prepoll") else 1  # with norm_prepoll: before xdone, a pass ahead, and the re-poll
        if cfg.get("xss_by_row"):  # a row's 16 partials as four 16-byte relaxed loads (and the helper's definition)
            poll = "dsv41_ld4_relaxed(("
            assert "AtomicLoad" not in src and src.count(poll) == polls and "ld.relaxed.gpu.global.v4.f32" in src
        else:
            poll = "AtomicLoad"
            assert src.count(poll) == polls
        assert f"if ({first} <= ((int)threadIdx.x)) {{" in front.split(poll)[0]
        assert "xdone[" in vector and "].arrive();" in vector and "xfree[" in vector and "].wait(" in vector
        # their weights: from the consumers' shared copy with norm_w_smem (nw is then read once, into w_s)
        assert ("(nw + " in front) != bool(cfg.get("norm_w_smem")) and src.count(" = nw[") == 1
    if cfg.get("x_hints"):  # the plain x stores, once in the step and in the lagged norm (in and after the loop) or
        # the normalizing warps' pass, through the hinted helpers
        assert "createpolicy.fractional.L2::" in src and "st.global.L2::cache_hint.v4.b32" in src
        # (held_norm: the previous block's chunks, those that waited for its rsqrt (k > 0), the last block's; no
        # un-normalized store)
        firsts = 1 if cfg.get("norm_wg") else 2 + (cfg.get("held_norm", 0) > 1)
        lasts = 0 if cfg.get("held_norm") else 1
        assert src.count("dsv41_st16_evict_last(") == lasts and src.count("dsv41_st16_evict_first(") == firsts
    if cfg.get("norm_wg"):
        assert ("dsv41_st16_evict_first(" in front) == bool(cfg.get("x_hints"))  # (front: the normalizing warps)
    shapes = re.findall(r"wgmma_ss<[^>]*kFloat32, (\d+), (\d+), (\d+),", src)
    ml48 = cfg.get("ml48", False)  # the mid and lo chains as one n48 wgmma (hi n24): 8 a step, not 12
    assert set(shapes) == ({("64", "24", "16"), ("64", "48", "16")} if ml48 else {("64", "24", "16")}), shapes
    assert shapes.count(("64", "48", "16")) == (4 if ml48 else 0)
    chains = ["acc_mid"] if ml48 else ["acc_mid", "acc_lo"]
    waits = re.findall(r"tl::wait_wgmma<(\d)>", src)
    if cfg.get("dots_defer"):  # streams 1-3's chains of a step in flight into the next; all waited at a block's end
        early = ["0"] if cfg.get("dots_release_early") else []  # (all the previous step's groups, then its release)
        order = cfg.get("dots_order", "")  # the chain groups left in flight: 3 (hi first), 2 ("mix") or 1 ("alt")
        in_flight = {"": 3 * len(chains), "mix": 2, "alt": 1}[order]
        assert src.count("wgmma_ss<") == 4 + 4 * len(chains) and waits == early + [str(in_flight), "0"], waits
        dots = src[src.index("if (((int)threadIdx.x) < 256) {"):src.index("if (256 <= ((int)threadIdx.x)) {")]
        # a step's stage wait after the previous step's release: with dots_release_early all its groups done first,
        # else after this step's dots
        first = [dots.index(k) for k in ("tl::wait_wgmma<0>", "empty[", "].wait(")]
        assert (first[0] < first[1] < first[2]) == bool(cfg.get("dots_release_early")), first
        issued = re.findall(r"\(\(uint32_t\*\)\((\w+) \+ 0\)\)", dots)  # the accumulator of each wgmma, in order
        hi = [i for i, a in enumerate(issued) if a.startswith("sh")]
        assert [issued[i] for i in hi] == ["sh0", "sh1", "sh2", "sh3"], issued
        assert hi == {"": [0, 1, 2, 3], "mix": [1, 2, 4, 5], "alt": [0, 2, 4, 6]}[order], issued
        if ml48:  # one [mid | lo] accumulator (TileLang names it after one of its two bindings)
            ml = [a for i, a in enumerate(issued) if i not in hi]
            assert len(issued) == 8 and len(set(ml)) == 1 and ml[0] in ("acc_mid", "acc_lo"), issued
        else:
            assert issued[4:] == chains * 4, issued
        assert dots.count("((c == 0) ? 0 : 1)") == len(chains)  # a block's chains start from zero by stream 0's scale-d
    else:  # 4 streams x 3 parts (2 with ml48), one wait a step
        assert src.count("wgmma_ss<") == (4 + 4 * len(chains)) * rings and waits == ["0"] * rings
    if ml48:  # hi comes with the stage, [mid; lo] is resident (one [48, 32] box a chunk)
        # (ml_stream the other way round: hi resident, [mid; lo] with the stage)
        streamed, kept = ("wmid", "whi") if cfg.get("ml_stream") else ("whi", "wmid")
        assert src.count(f"tma_load({streamed}_desc, full[") == 4 and f"tma_load({streamed}_desc, wbar[" not in src
        assert src.count(f"tma_load({kept}_desc, wbar[") == 4 and "wlo_desc" not in src
    hint = "<tl::CacheHintSm90::EVICT_FIRST>" if cfg.get("loads_evict_first", True) else ""  # (or the normal policy)
    assert f"tma_load{hint}(h_desc" in src and (hint or "EVICT_FIRST>(h_desc" not in src)
    if mcast:
        _check_hi_multicast(src, cfg)
    else:
        assert "cluster" not in src and "tma_load_multicast" not in src
    if cfg.get("fused_finish"):
        _check_fused_finish(src, cfg)
    else:
        assert "dsv41_count_release" not in src and "dsv41_wait_count" not in src
    # finish_pdl: each thread triggers the dependent launch once, before anything else of the kernel's
    body = src[src.index("__global__"):]
    assert body.count("dsv41_pdl_trigger();") == (1 if cfg.get("finish_pdl") else 0)
    assert ("griddepcontrol.launch_dependents" in src) == bool(cfg.get("finish_pdl"))
    if cfg.get("finish_pdl"):
        assert body.index("dsv41_pdl_trigger();") < body.index("tma_load")
    assert "__fmaf_rn" in src and "__fdiv_rn" in src and "__fsqrt_rn" in src
    offsets = [int(v) for v in re.findall(r"buf_dyn_shmem \+ (\d+)\)", src)]
    assert max(offsets) < 227 * 1024
    _check_shared_apart(src)
    cubins = list(Path(tmp_path).rglob("*.cubin"))
    tool = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if cubins and tool.exists():
        out = subprocess.run([str(tool), "--dump-resource-usage", str(cubins[0])], capture_output=True, text=True)
        usage = dict(re.findall(r"\b(REG|STACK):(\d+)", out.stdout))
        assert usage and int(usage["STACK"]) == 0 and int(usage["REG"]) <= 255, usage
        # the wgmmas stay asynchronous: one warpgroup barrier a wait in the source; where ptxas cannot keep them in
        # flight (too few registers, accumulators touched while in flight: C7512-C7518) it puts one after each
        sass = subprocess.run([str(tool), "-sass", str(cubins[0])], capture_output=True, text=True).stdout
        # two k16 steps a 32-column chunk
        assert sass.count("HGMMA.64x24x16") + sass.count("HGMMA.64x48x16") == 2 * src.count("wgmma_ss<")
        assert sass.count("HGMMA.64x48x16") == (8 if ml48 else 0)
        assert sass.count("WARPGROUP.DEPBAR") == len(waits), (sass.count("WARPGROUP.DEPBAR"), len(waits))
        # packed_cvt: every bf16 rounding two values an instruction (none a value), through the helpers
        assert ("F2F.BF16.F32 " in sass) != bool(cfg.get("packed_cvt"))
        if cfg.get("packed_cvt"):  # the stage reads, the collapse and the norm call the helpers
            body = src[src.index("__global__"):]
            assert body.count("dsv41_bf16x8_to_f32(") == 4 and body.count("dsv41_f32x8_to_bf16_back(") == 1
            norms = 2 + (cfg["held_norm"] > 1) if cfg.get("held_norm") else 1
            assert body.count("dsv41_norm_bf16x8(") == norms and "cvt.rn.bf16x2.f32" in src
        if cfg.get("held_norm"):  # producer / dots / vector budgets, all three kept by ptxas (it drops them all where
            # one is below what its code needs)
            lo, mid, hi = tlp.HELD_REGS
            assert f"warpgroup_reg_dealloc<{lo}>" in src and f"warpgroup_reg_dealloc<{mid}>" in src
            assert f"warpgroup_reg_alloc<{hi}>" in src and sass.count("USETMAXREG") == 3
            assert 128 * (lo + mid) + 256 * hi <= 65536
            # the partials polled by the vector role (in the loop and for the last block), x only ever stored
            # (and with held_prepoll the first poll a step ahead)
            polls = 2 + bool(cfg.get("held_prepoll"))
            assert src.count("AtomicLoad") == polls and "xdone" not in src and " = x[" not in src


def _check_fused_finish(src: str, cfg: dict) -> None:
    """``fused_finish``: warps 1-3 of the producer warpgroup wait for each row block's counter, sum the partials,
    meet on a named barrier of their 96 threads, then Sinkhorn (warps 1-2) and pre / post (warp 3); each warp of the
    dots and of the vector role counts its publication once a block, after its stores."""
    body = src[src.index("__global__ void __launch_bounds__"):]
    producer, consumers = body.split("if (128 <= ((int)threadIdx.x)) {", 1)
    finish = producer[producer.index("if (32 <= ((int)threadIdx.x)) {"):]
    assert finish.count("dsv41_wait_count(") == 1 and "dsv41_count_release" not in finish
    assert finish.index("dsv41_wait_count(") < finish.index("dsv41_tree16(") < finish.index("dsv41_comb(")
    # the target: SENTINEL + 16 CTAs x 12 warps; the Triton finish's roundings (its constants baked in)
    assert "0x1.7ep+7f" in finish and f", {ITERS});" in finish and finish.count("dsv41_sigmoid(") == 2
    assert finish.count("tl::__sync_thread_partial(2, 96);") == 2 and finish.count("dsv41_tree16(") == 2
    assert "0x1.4p+14f" in finish  # K = 4 * 5120, the stats' divisor
    dots, vector = consumers.split("if (256 <= ((int)threadIdx.x)) {")
    count = r"__syncwarp\(\);\s*if \(\(\(\(int\)threadIdx.x\) % 32\) == 0\) \{\s*dsv41_count_release"
    for role, stores in ((dots, r"\bws\[[^\n]*\n\s*\}\s*"), (vector, r"AtomicStore\(\(&\(xss\[[^\n]*\n\s*\}\s*")):
        # one count a warp, right after the role's partials
        assert role.count("dsv41_count_release(") == 1 and re.search(stores + count, role)
    for helper in ("div.full.f32", "div.rn.f32", "ex2.approx.f32", "red.release.gpu.global.add.f32",
                   "ld.relaxed.gpu.global.f32", "fence.acq_rel.gpu"):
        assert helper in src, helper


def _check_shared_apart(src: str) -> None:
    """Every shared buffer at an offset of its own: the roles run at once, so no two may share bytes (TileLang's
    planner gave the fused finish's buffer the norm weights' bytes, whose users are in another role: the norm then
    read mixes as weights, found on the GPU in run 189)."""
    bufs = re.findall(r"(\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)", src)
    at = {}
    for name, off in bufs:
        at.setdefault(int(off), []).append(name)
    assert len(bufs) >= 8 and all(len(v) == 1 for v in at.values()), {k: v for k, v in at.items() if len(v) > 1}


def _check_hi_multicast(src: str, cfg: dict) -> None:
    """The cluster's copies and barriers in a ``hi_multicast`` build's source."""
    n = cfg["hi_multicast"]
    consumers = 128 * (1 + cfg["vec_wgs"])
    # each stage's empty: this CTA's consumers and one thread of each of the other CTAs' warps
    assert [src.count(f"empty[{i}].init({consumers + (n - 1) * consumers // 32});") for i in range(4)] == [1] * 4
    # rank 0 multicasts each stream's hi chunk to the n CTAs (the others only expect its bytes), and the resident
    # [mid; lo] tiles once at the start
    streamed, kept = ("wmid", "whi") if cfg.get("ml_stream") else ("whi", "wmid")
    assert src.count(f"tl::tma_load_multicast({streamed}_desc, full[") == 4
    assert src.count(f"(uint16_t)({2 ** n - 1})") == 8
    assert src.count(f"tl::tma_load_multicast({kept}_desc, wbar[") == 4
    producer = src[src.index("for (int q = 0;"):src.index("if (128 <= ((int)threadIdx.x)) {")]
    # the residual's four copies under the row block's test (q / 10 below this CTA's own count of blocks)
    guard = producer.index("if ((q / 10) < ")
    assert guard < producer.index("(h_desc, full[") and producer.count("(h_desc, full[") == 4
    # remote arrivals after a warp sync, by a warp's first lane at each local release of the dots and the vector
    # role: one on each other rank's barrier (rank + o) % n, o = 1 .. n - 1
    rank = f"(((int)blockIdx.x) & {n - 1})"
    one = r"empty\[[^\]]*\]\.arrive\(\(%s\)\);"
    sync = r"__syncwarp\(\);\s*if \(\(\(\(int\)threadIdx.x\) % 32\) == 0\) \{\s*"
    if n == 2:
        peer = re.escape(f"({rank} + 1) & 1")
    else:  # (an unrolled loop over o)
        sync += r"#pragma unroll\s*for \(int (o\w*) = 1; \1 < %d; \+\+\1\) \{\s*" % n
        peer = r"\(\1 \+ %s\) & %d" % (re.escape(rank), n - 1)
    assert len(re.findall(sync + one % peer, src)) == 3 and src.count(".arrive((") == 3
    # cluster barriers: after the barriers' initialization (TileLang's) and before the CTAs leave
    assert src.count("tl::cluster_sync();") == 2 and re.search(r"tl::fence_barrier_init\(\);\s*tl::cluster_sync", src)
    assert re.search(r"tl::cluster_sync\(\);\s*\}\s*$", src)


@pytest.mark.parametrize("n", [2, 4])
def test_hi_multicast_schedule(n):
    """``hi_multicast``'s clusters: every (slice, row block) has exactly one CTA, the n CTAs of a cluster share a slice
    and walk as many row blocks (rank 0's), and only a later rank's last may be past M (groups n and 8, M from 0 to
    40 row blocks)."""
    from dsv41_passes.lowering.tilelang.mhc_pre_options import cluster_slot, walked_blocks

    S = 16
    for groups in (n, 8):
        for nrb in range(41):
            seen = []
            for p in range(groups * S // n):
                slots = [cluster_slot(n * p + r, n, S) for r in range(n)]
                s, g0, _ = slots[0]
                assert slots == [(s, g0 + r, r) for r in range(n)] and g0 % n == 0
                walk = len(range(g0, nrb, groups))  # rank 0's row blocks
                for _, g, r in slots:
                    real = range(g, nrb, groups)
                    assert walked_blocks(nrb, g, r, groups) == walk
                    assert len(real) in ((walk,) if r == 0 else (walk, walk - 1))
                    seen += [(s, rb) for rb in real]
            assert sorted(seen) == [(s, rb) for s in range(S) for rb in range(nrb)]


def test_two_vector_warpgroups_need_split_roles():
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp

    pytest.importorskip("tilelang")
    with pytest.raises(ValueError, match="two vector warpgroups need split roles"):
        tlp.build(FLASH_D, 8, EPS, stages=4, wgs=1, producer=True, vec_wgs=2)
    with pytest.raises(ValueError, match="two vector warpgroups"):
        tlp.build(FLASH_D, 8, EPS, stages=4, wgs=1, producer=True, split_roles=True, vec_wgs=3)


def test_build_options_are_checked():
    """``diag`` takes only its known flags, ``norm_w_smem`` only goes with the normalizing warps, ``dots_defer`` with
    split roles and ``ml48`` with split roles and the mid part resident, ``dots_order`` with the deferred dots and
    ``ml48``."""
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp

    pytest.importorskip("tilelang")
    with pytest.raises(ValueError, match="diag 'timers,nosq'"):
        tlp.build(FLASH_D, 8, EPS, **dict(tlp.DEFAULT_CONFIG, diag="timers,nosq"))
    with pytest.raises(ValueError, match="norm_w_smem and norm_prepoll are for the normalizing warps"):
        tlp.build(FLASH_D, 8, EPS, **dict(tlp.CONFIGS["wg1-split-v2"], norm_w_smem=True))
    with pytest.raises(ValueError, match="dots_defer needs split roles"):
        tlp.build(FLASH_D, 8, EPS, **dict(tlp.CONFIGS["wg1-producer"], dots_defer=True))
    with pytest.raises(ValueError, match="ml48 needs split roles and the mid part resident"):
        tlp.build(FLASH_D, 8, EPS, **dict(tlp.CONFIGS["wg1-producer"], ml48=True))
    with pytest.raises(ValueError, match="ml48 needs split roles and the mid part resident"):
        tlp.build(FLASH_D, 8, EPS, **dict(tlp.DEFAULT_CONFIG, ml48=True, mid_resident=False))
    with pytest.raises(ValueError, match="dots_order 'hc'"):
        tlp.build(FLASH_D, 8, EPS, **dict(tlp.DEFAULT_CONFIG, dots_order="hc"))
    with pytest.raises(ValueError, match="dots_order 'mix'"):
        tlp.build(FLASH_D, 8, EPS, **dict(tlp.CONFIGS["wg1-split-v2-normwg3-ws-ml"], dots_order="mix"))
    mc = tlp.CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-mc"]
    # (no norm on the producer's warps or in registers: the vector role's lagged norm; no deferred dots; odd groups)
    for cfg, groups in ((dict(mc, held_norm=0), 8), (dict(mc, dots_defer=False), 8), (mc, 7),
                        (dict(mc, hi_multicast=4), 6)):
        with pytest.raises(ValueError, match=r"hi_multicast \d \(2 or 4 CTAs\) needs held_norm"):
            tlp.build(FLASH_D, groups, EPS, **cfg)
    h, pp = torch.zeros(4, 4, FLASH_D, dtype=torch.bfloat16), torch.ones(4, 4)
    with pytest.raises(ValueError, match="hi_multicast 3"):
        tlp.build(FLASH_D, 6, EPS, **dict(mc, hi_multicast=3))
    with pytest.raises(ValueError, match="hi_multicast clusters CTAs of 2 groups, got 1"):
        tlp.partials(h, pp, None, torch.ones(FLASH_D), EPS, config=mc, groups=1)
    bc = dict(tlp.BOUNDARY_CONFIG, boundary=True)
    for cfg in (dict(bc, post_prefetch=11), dict(bc, post_prefetch=2, held_norm=2, norm_wg=False, norm_w_smem=False)):
        with pytest.raises(ValueError, match="post_prefetch .* is for the boundary with the normalizing warps"):
            tlp.build(FLASH_D, 8, EPS, **cfg)
    with pytest.raises(ValueError, match="post_store_late is for the boundary with the normalizing warps, without"):
        tlp.build(FLASH_D, 8, EPS, **dict(bc, post_store_late=True, post_tma_store=True))
    ff = tlp.CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-ff"]
    with pytest.raises(ValueError, match="finish_pdl lets the Triton stats kernel launch early"):
        tlp.build(FLASH_D, 8, EPS, **dict(ff, finish_pdl=True, finish_consts=(ITERS, HC_EPS, NORM_EPS)))
    with pytest.raises(ValueError, match="fused_finish needs held_norm"):  # (and the model's constants)
        tlp.build(FLASH_D, 8, EPS, **ff)
    with pytest.raises(ValueError, match="fused_finish needs held_norm"):
        tlp.build(FLASH_D, 8, EPS, **dict(tlp.CONFIGS["wg1-split-v2-normwg3-ws-ml-pk-dd-xh"], fused_finish=True,
                                          finish_consts=(ITERS, HC_EPS, NORM_EPS)))
    sliced, w = torch.zeros(3, 16, 4, 24, FLASH_D // 16, dtype=torch.bfloat16), torch.ones(FLASH_D)
    fin = (torch.ones(3), torch.zeros(24), ITERS, HC_EPS, NORM_EPS)
    with pytest.raises(ValueError, match="a fused_finish build takes"):
        tlp.partials(h, pp, sliced, w, EPS, config=ff, groups=8)
    with pytest.raises(ValueError, match="a fused_finish build takes"):
        tlp.partials(h, pp, sliced, w, EPS, groups=8, finish=fin)
    with pytest.raises(ValueError, match="scale must be float32 with 3 values"):
        tlp.partials(h, pp, sliced, w, EPS, config=ff, groups=8, finish=(torch.ones(3).double(), *fin[1:]))
    with pytest.raises(ValueError, match="base must be float32 with 24 values"):
        tlp.partials(h, pp, sliced, w, EPS, config=ff, groups=8, finish=(fin[0], torch.zeros(4, 4), *fin[2:]))


@pytest.mark.parametrize("opts", BOUNDARY_OPTS, ids=opts_id)
def test_boundary_build(opts, tmp_path, monkeypatch):
    """``mhc_boundary`` in the persistent kernel (``boundary``): y's chunk comes by TMA with the stage; the vector role
    computes the post with the Triton post kernel's roundings, writes the new residual over the stage and to HBM,
    fences the async proxy and arrives on the stage's ``ready`` barrier, which the dots wait on after ``full``; no
    spills, the wgmmas asynchronous, the shared memory within the 227 KiB of a block. ``post_tma_store``: a vector
    warp stores the new residual from the stage by TMA once ``ready`` completes, and waits for the stores' reads
    before its warp releases the stage."""
    pytest.importorskip("tilelang")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed: TileLang cannot build the sm_90a cubin")
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp

    cfg = dict(tlp.BOUNDARY_CONFIG, boundary=True, **opts)
    k = tlp.compile_kernel(tlp.build(FLASH_D, 8, EPS, **cfg), True)
    src = k.get_kernel_source()
    hint = "<tl::CacheHintSm90::EVICT_FIRST>" if cfg.get("loads_evict_first", True) else ""
    assert f"tma_load{hint}(y_desc, full[" in src and f"tma_load{hint}(h_desc" in src
    assert hint or "EVICT_FIRST>(" not in src
    assert [src.count(f"ready[{i}].init(256);") for i in range(4)] == [1] * 4
    dots, vector = src.split("if (256 <= ((int)threadIdx.x)) {")
    dots = dots[dots.rindex("if (((int)threadIdx.x) < 256) {"):]
    assert dots.index("full[") < dots.index("ready[") < dots.index("wgmma_ss<")  # stage in, post written, then dots
    post = vector[vector.index("post_in + "):vector.index("].arrive();")]
    # _combine's order: ((c0 r0 + c1 r1) + c2 r2) + c3 r3, then post y + that, each rounded; one bf16 rounding
    assert "__fadd_rn(__fadd_rn(__fadd_rn(__fmul_rn(cm[" in post
    if cfg.get("packed_cvt"):  # rounded by the pair, the new values back in f32 by bit operations
        assert "] = __fadd_rn(__fmul_rn(pk[" in post and post.count("dsv41_f32x8_to_bf16_back(") == 4
    else:
        assert "(bfloat16_t)__fadd_rn(__fmul_rn(pk[" in post
    assert all(f"*(uint4*)(((bfloat16_t*)a{i})" in post for i in range(4))
    if opts.get("post_tma_store"):  # from the stage, after every vector thread's writes; read before the release
        assert "new_res + " not in vector and vector.count("tl::tma_store(new_res_desc") == 4
        tail = vector[vector.index("tl::fence_proxy_async();"):]
        assert tail.index("].arrive();") < tail.index("].wait(") < tail.index("tl::tma_store(new_res_desc")
        assert tail.index("tl::tma_store_wait<0, true>();") < tail.index("empty[")
    else:  # to HBM once the stage is handed to the dots: the async-proxy fence has no global stores to order
        assert "new_res + " not in post
        tail = vector[vector.index("tl::fence_proxy_async();"):]
        # (post_evict_first: by the 16-byte evict-first helper, 4 streams x the thread's runs a step)
        store = "dsv41_st16_evict_first((&(new_res[" if cfg.get("post_evict_first") else "*(uint4*)(new_res + "
        assert vector.count(store) == 1 and ("*(uint4*)(new_res + " in vector) != bool(cfg.get("post_evict_first"))
        assert tail.index("].arrive();") < tail.index(store)
        # (the stores read registers: with vec_release_early the stage may go back before them)
        assert tail.index(store) < tail.index("empty[") or cfg.get("vec_release_early")
        if cfg.get("norm_wg"):  # post_store_late: after the step's x stores (the x_hints helper), else before them
            xs = tail.index("dsv41_st16_evict_last(")
            assert (xs < tail.index(store)) == bool(cfg.get("post_store_late"))
            # vec_release_early: the stage goes back right after the post's stores, before the collapse and x stores
            assert (tail.index("empty[") < xs) == bool(cfg.get("vec_release_early"))
            # the thread's arrival (and with a CTA pair its warp's one on the other CTA's barrier)
            assert tail.count("empty[") == (2 if cfg.get("hi_multicast") else 1)
    st = cfg["stages"]  # (the stage index of whatever expression the loop's step is)
    modulus = f" & {st - 1}" if st & (st - 1) == 0 else f" % {st}"
    assert re.search(r"tl::fence_proxy_async\(\);\s*ready\[\([^\]]*" + modulus + r"\)\]\.arrive\(\);", vector)
    # post_prefetch k: the next block's post and comb rows and the pre row after into L1 at step 10 - k, the only ones
    assert vector.count("dsv41_prefetch_l1(") == (3 if cfg.get("post_prefetch") else 0)
    if cfg.get("post_prefetch"):
        assert f"if ((t % 10) == {10 - cfg['post_prefetch']}) {{" in vector
    if cfg.get("hi_multicast"):  # the pair's copies and barriers, and y only for a row block within M
        _check_hi_multicast(src, cfg)
        producer = src[src.index("for (int q = 0;"):]
        assert producer.index("if ((q / 10) < ") < producer.index("(y_desc, full[")
    offsets = [int(v) for v in re.findall(r"buf_dyn_shmem \+ (\d+)\)", src)]
    assert max(offsets) + 320 * 4 <= 227 * 1024 - 1024  # w_s last, and 1 KiB of static shared memory
    _check_shared_apart(src)
    cubins = list(Path(tmp_path).rglob("*.cubin"))
    tool = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if cubins and tool.exists():
        out = subprocess.run([str(tool), "--dump-resource-usage", str(cubins[0])], capture_output=True, text=True)
        usage = dict(re.findall(r"\b(REG|STACK):(\d+)", out.stdout))
        assert usage and int(usage["STACK"]) == 0, usage
        sass = subprocess.run([str(tool), "-sass", str(cubins[0])], capture_output=True, text=True).stdout
        assert sass.count("WARPGROUP.DEPBAR") == src.count("tl::wait_wgmma<")
        assert ("F2F.BF16.F32 " in sass) != bool(cfg.get("packed_cvt"))
        assert sass.count("CCTL.E.PF1 ") == (3 if cfg.get("post_prefetch") else 0)  # prefetch.global.L1


def test_boundary_inputs_are_checked():
    """A boundary build takes (y, post, comb) and only it does; the op checks their shapes and dtypes first."""
    pytest.importorskip("tilelang")
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp

    h = torch.zeros(4, 4, FLASH_D, dtype=torch.bfloat16)
    sliced = torch.zeros(3, 16, 4, 24, FLASH_D // 16, dtype=torch.bfloat16)
    w, pp = torch.ones(FLASH_D), torch.ones(4, 4)
    with pytest.raises(ValueError, match="a boundary build takes"):
        tlp.partials(h, pp, sliced, w, EPS, config=dict(tlp.BOUNDARY_CONFIG, boundary=True), groups=8)
    with pytest.raises(ValueError, match="a boundary build takes"):
        tlp.partials(h, pp, sliced, w, EPS, groups=8, post=(h[:, 0], pp, pp.view(4, 2, 2)))
    y, post, comb = h[:, 0], torch.ones(4, 4), torch.ones(4, 4, 4)
    args = (torch.ones(3), torch.zeros(24), w, ITERS, HC_EPS, NORM_EPS, EPS)
    with pytest.raises(ValueError, match="y must be"):
        tlp.mhc_boundary(y.float(), h, post, comb, pp, sliced, *args)
    with pytest.raises(ValueError, match="comb must be"):
        tlp.mhc_boundary(y, h, post, comb[:, :2], pp, sliced, *args)
    with pytest.raises(ValueError, match="boundary .post fused. needs the normalizing warps"):
        tlp.build(FLASH_D, 8, EPS, **dict(tlp.CONFIGS["wg1-split-v2"], boundary=True))
    for bad in (dict(x_hints=False), dict(post_tma_store=True)):  # (the evict-first helper comes with x_hints)
        with pytest.raises(ValueError, match="post_evict_first is for the boundary with x_hints"):
            tlp.build(FLASH_D, 8, EPS, **dict(tlp.BOUNDARY_CONFIG, boundary=True, post_evict_first=True, **bad))
    with pytest.raises(ValueError, match="post_tma_store is for the boundary"):
        tlp.build(FLASH_D, 8, EPS, **dict(tlp.DEFAULT_CONFIG, post_tma_store=True))
    with pytest.raises(ValueError, match="nopostmath is for the boundary"):
        tlp.build(FLASH_D, 8, EPS, **dict(tlp.BOUNDARY_CONFIG, diag="nopostmath"))


def test_boundary_without_the_post_math_build(tmp_path, monkeypatch):
    """The probe build ``diag`` "nopostmath" (``run_gpu.sh mhc_boundary_timers``): the vector role writes the old
    residual back as the new one, with the post's conversions, stores and barriers kept."""
    pytest.importorskip("tilelang")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed: TileLang cannot build the sm_90a cubin")
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp

    cfg = dict(tlp.BOUNDARY_CONFIG, boundary=True)
    srcs = [tlp.compile_kernel(tlp.build(FLASH_D, 8, EPS, **dict(cfg, diag=d)), True).get_kernel_source()
            for d in ("", "nopostmath")]
    vectors = [src.split("if (256 <= ((int)threadIdx.x)) {")[1] for src in srcs]
    assert "__fmul_rn(pk[" in vectors[0] and "__fmul_rn(pk[" not in vectors[1]
    for v in vectors:
        assert v.count("dsv41_f32x8_to_bf16_back(") == 5 and v.count("*(uint4*)(new_res + ") == 1
        assert v.count("ready[") == 1 and "tl::fence_proxy_async();" in v


# the default; the deferred dots' own loop; the normalizing warps' (the boundary's config)
@pytest.mark.parametrize("name", [None, "wg1-split-v2-normwg3-ws-dd", "wg1-split-v2-normwg3-ws-ml-pk-dd-xh"])
def test_diag_timers_build(name, tmp_path, monkeypatch):
    """The probe build (``diag`` "timers", ``benchmarks/probe_mhc_pre_diag.py``): each role's first thread reads the
    cycle counter around its barrier waits and writes three counts over xss at the end; no spills."""
    pytest.importorskip("tilelang")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed: TileLang cannot build the sm_90a cubin")
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp

    cfg = tlp.DEFAULT_CONFIG if name is None else tlp.CONFIGS[name]
    src = tlp.compile_kernel(tlp.build(FLASH_D, 8, EPS, **dict(cfg, diag="timers")), True)
    src = src.get_kernel_source()
    # (a CTA's row of 64: blockIdx.x * 64, or with CTA clusters (hi_multicast) its group, rank and slice's)
    writes = re.findall(r"xss\[\(+\(\(int\)blockIdx.x\)[^=]* \+ k_\d+\)(?: \+ (\d+))?\)?\] = \(\(float\)tm\[", src)
    roles = [0, 3, 6, 9] if cfg.get("norm_wg") else [0, 6, 9]  # (held_norm: no normalizing warps)
    assert sorted(int(w or 0) for w in writes) == roles and src.count("clock64()") >= 4 * len(roles)  # a role's rows
    plain = tlp.compile_kernel(tlp.build(FLASH_D, 8, EPS, **cfg), True).get_kernel_source()
    assert "clock64" not in plain


def test_diag_cuts_build_for_held_norm(tmp_path, monkeypatch):
    """The ``diag`` cuts of the default (``held_norm``, the deferred dots; wrong results by design, for
    ``probe_mhc_pre_diag.py``): "noxstore" keeps the norm but drops x's stores, "novec" drops the vector role's loads,
    arithmetic and stores (its stage releases and the group's wait for the norm partials stay), "nodots" has the dots'
    warpgroup only wait for each stage and release it, "nopoll" reads the partials once without waiting for them."""
    pytest.importorskip("tilelang")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed: TileLang cannot build the sm_90a cubin")
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp

    poll = "if ((pv[s2_1] == -0x1p+0f"  # (the norm partial's sentinel, -1)
    seen = {}
    for diag in ("", "noxstore", "novec", "nodots", "nopoll"):
        src = tlp.compile_kernel(tlp.build(FLASH_D, 8, EPS, **dict(tlp.DEFAULT_CONFIG, diag=diag)), True)
        dots, vector = src.get_kernel_source().split("if (256 <= ((int)threadIdx.x)) {")
        seen[diag] = (vector.count("dsv41_st16_evict_first("), vector.count("dsv41_norm_bf16x8("),
                      vector.count("empty["), poll in vector, "continue;" in dots[dots.rindex("for (int j = 0;"):])
    e = 1 + bool(tlp.DEFAULT_CONFIG.get("hi_multicast"))  # (CTA pairs: its release of the stage in both CTAs)
    assert seen[""] == (3, 3, e, True, False)  # (the stores of chunks 0-2 at step 2, then one a step)
    assert seen["noxstore"] == (0, 3, e, True, False)
    assert seen["novec"] == (0, 0, e, True, False)
    assert seen["nodots"] == (3, 3, e, True, True)
    assert seen["nopoll"] == (3, 3, e, False, False)


def test_diag_cuts_of_the_dots_streams(tmp_path, monkeypatch):
    """The ``diag`` cuts "nohi23" and "nochain23" of the default (wrong mixes by design, for
    ``probe_mhc_pre_diag.py``): six wgmma groups a step instead of eight, without streams 2-3's hi dots (n24) or their
    [mid; lo] chain groups (n48), and the step's wait leaves the chain groups after stream 0's in flight; "twochains"
    all eight, streams 2-3's chain into an accumulator of its own with the dots' registers raised
    (``TWO_CHAIN_REGS``); only with the deferred dots of ml48 in their default order."""
    pytest.importorskip("tilelang")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed: TileLang cannot build the sm_90a cubin")
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp

    for diag, (n24, n48, waits) in (("nohi23", (2, 4, ["0", "3", "0"])), ("nochain23", (4, 2, ["0", "1", "0"])),
                                    ("twochains", (4, 4, ["0", "3", "0"]))):
        src = tlp.compile_kernel(tlp.build(FLASH_D, 8, EPS, **dict(tlp.DEFAULT_CONFIG, diag=diag)), True)
        src = src.get_kernel_source()
        assert src.count("64, 24, 16, false") == n24 and src.count("64, 48, 16, false") == n48, diag
        assert re.findall(r"tl::wait_wgmma<(\d)>", src) == waits, diag
        chains = re.findall(r"64, 48, 16, false[^;]*\(\(uint32_t\*\)\((\w+) \+ 0\)\)", src)
        # twochains: streams 0-1 and 2-3 in two accumulators, the dots' registers raised for the second
        assert len(set(chains)) == (2 if diag == "twochains" else 1), chains
        regs = tlp.TWO_CHAIN_REGS if diag == "twochains" else tlp.HELD_REGS
        assert f"warpgroup_reg_dealloc<{regs[1]}>" in src and f"warpgroup_reg_alloc<{regs[2]}>" in src
        assert 128 * (regs[0] + regs[1]) + 256 * regs[2] <= 65536
    with pytest.raises(ValueError, match="nochain23 and twochains change the deferred dots"):
        tlp.build(FLASH_D, 8, EPS, **dict(tlp.DEFAULT_CONFIG, diag="nochain23", dots_order="mix"))


def test_diag_nodots_keeps_the_fused_finish_count(tmp_path, monkeypatch):
    """``diag`` "nodots" with ``fused_finish``: the dots' warps still count each row block (before the cut's
    ``continue``), or the finishing warps, which wait for 16 CTAs x 12 warps, would spin forever."""
    pytest.importorskip("tilelang")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed: TileLang cannot build the sm_90a cubin")
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp

    cfg = dict(tlp.CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-ff"], diag="nodots", finish_consts=(ITERS, HC_EPS, NORM_EPS))
    src = tlp.compile_kernel(tlp.build(FLASH_D, 8, EPS, **cfg), True).get_kernel_source()
    body = src[src.index("__global__ void __launch_bounds__"):]
    dots = body.split("if (128 <= ((int)threadIdx.x)) {", 1)[1].split("if (256 <= ((int)threadIdx.x)) {")[0]
    loop = dots[dots.rindex("for (int j"):]
    assert "continue;" in loop and "dsv41_count_release(" in loop.split("continue;")[0]
