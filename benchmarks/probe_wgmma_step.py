"""How long one step of the ``mhc_pre`` dots' warpgroup takes on its own, by issue order: are its wgmmas paced by
the tensor cores, by shared memory, or by the latency of the [mid; lo] chain (8 dependent ``m64n48k16`` a step)?

Runs 252-253 (H200) had the dots' warpgroup busy about 1040 cycles a step inside the kernel, for about 290 cycles of
tensor-core work. This probe runs the same wgmmas on the same shared-memory tiles (a 4-stage ring of the four
streams' [64, 32] chunks, the streamed [24, 32] hi chunks, the resident [48, d/16] [mid; lo] tiles), with no copies,
no vector role and no barriers: one CTA of one warpgroup an SM, ``steps`` steps, clock64 around the loop.
Orders (``PATTERNS``; C is a stream's [mid; lo] chain group, H its hi dot):

* "step", the kernel's (``dots_deferred`` with ``dots_release_early``): wait for every group, issue H0-H3, then
  C0-C3, ``wait_wgmma<3>``, add the hi parts; "step_defer", the same without the first wait (``dots_defer`` alone:
  3 chain groups in flight into the next step);
* "hi" and "chain": either alone;
* "mix" and "mix_hc" (``dots_order`` "mix" and "alt"): the same 8 groups as C0 H0 H1 C1 H2 H3 C2 C3 and
  H0 C0 H1 C1 H2 C2 H3 C3 (the same products and sums);
* "k16": the same 16 wgmmas issued one k16 at a time, each chain wgmma between two hi ones (TileLang's k16 regions
  of a swizzled tile start at the wrong address: a timing only);
* "two_chains": streams 0-1 and 2-3 chained into two accumulators (other sums: a timing only);
* "n24": the hi dots, then mid and lo as two n24 chains (the layout before ``ml48``);
* "step+alu" and "step+lds": "step" beside two more warpgroups standing in for the vector role (each thread 8 values
  of a row of the 4 streams a step, 5 arithmetic instructions a value; "lds" also reads them from the stage tiles,
  16 KB a step as the role does, "alu" from registers): how much the role's instructions, or its shared-memory
  reads, slow the dots. The sm_90a build of "lds" issues 274 instructions a warp and step (the kernel's vector role:
  226), its reads as 16-bit loads (the role's: 16-byte ones). The stand-in runs free, not paced by a pipeline: an
  upper bound of its contention.

Prints cycles a step (median over the CTAs) for each, and the stand-in's.

    source .devsite/setup.sh && python3 benchmarks/probe_wgmma_step.py [--steps 4000] [--ctas 132]
"""

import argparse
import sys

import torch

HC, NMIX, BM, BK, NC, STAGES = 4, 24, 64, 32, 10, 4
PATTERNS = ("step", "step_defer", "hi", "chain", "mix", "mix_hc", "k16", "two_chains", "n24", "step+alu", "step+lds")


def build(pattern: str, steps: int, ctas: int):
    import tilelang.language as T

    pattern, _, vec = pattern.partition("+")  # "alu" / "lds": two more warpgroups of vector-like work
    threads, has_vec, lds = (384 if vec else 128), bool(vec), vec == "lds"

    bf16, f32 = "bfloat16", "float32"
    ds = NC * BK

    @T.prim_func
    def probe(a_in: T.Tensor((STAGES, BM, BK), bf16), hi_in: T.Tensor((STAGES, NMIX, BK), bf16),
              md_in: T.Tensor((2 * NMIX, ds), bf16), out: T.Tensor((ctas, 2 * NMIX), f32),
              cycles: T.Tensor((ctas, 2), "int64")):
        with T.Kernel(ctas, threads=threads) as cta:
            tx = T.get_thread_binding()
            a0 = T.alloc_shared((STAGES, BM, BK), bf16)
            a1 = T.alloc_shared((STAGES, BM, BK), bf16)
            a2 = T.alloc_shared((STAGES, BM, BK), bf16)
            a3 = T.alloc_shared((STAGES, BM, BK), bf16)
            lo0 = T.alloc_shared((STAGES, NMIX, BK), bf16)
            lo1 = T.alloc_shared((STAGES, NMIX, BK), bf16)
            lo2 = T.alloc_shared((STAGES, NMIX, BK), bf16)
            lo3 = T.alloc_shared((STAGES, NMIX, BK), bf16)
            md0 = T.alloc_shared((2 * NMIX, ds), bf16)
            md1 = T.alloc_shared((2 * NMIX, ds), bf16)
            md2 = T.alloc_shared((2 * NMIX, ds), bf16)
            md3 = T.alloc_shared((2 * NMIX, ds), bf16)
            acc_hi = T.alloc_fragment((BM, NMIX), f32)
            acc_ml = T.alloc_fragment((BM, 2 * NMIX), f32)
            acc_ml2 = T.alloc_fragment((BM, 2 * NMIX), f32)
            acc_m = T.alloc_fragment((BM, NMIX), f32)
            acc_l = T.alloc_fragment((BM, NMIX), f32)
            sh0 = T.alloc_fragment((BM, NMIX), f32)
            sh1 = T.alloc_fragment((BM, NMIX), f32)
            sh2 = T.alloc_fragment((BM, NMIX), f32)
            sh3 = T.alloc_fragment((BM, NMIX), f32)
            tm = T.alloc_local((1,), "int64")
            hb = T.alloc_local((HC * 8,), bf16)
            hv = T.alloc_local((8,), f32)
            sq = T.alloc_local((8,), f32)
            xq = T.alloc_local((8,), f32)
            for q in T.unroll(STAGES):
                for a in (a0, a1, a2, a3):
                    T.copy(a_in[q, :, :], a[q, :, :])
                for lo in (lo0, lo1, lo2, lo3):
                    T.copy(hi_in[q, :, :], lo[q, :, :])
            for md in (md0, md1, md2, md3):
                T.copy(md_in, md)
            if tx < 128:
                T.clear(acc_hi)
                T.clear(acc_ml)
                T.clear(acc_ml2)
                T.clear(acc_m)
                T.clear(acc_l)
                tm[0] = T.call_extern("int64", "clock64")
                for t in T.serial(steps):
                    st = t % STAGES
                    c = t % NC
                    if pattern in ("step", "step_defer", "hi", "chain", "two_chains", "n24"):
                        if pattern != "step_defer":
                            T.wait_wgmma(0)
                        if pattern != "chain":
                            for a, lo, sh in ((a0, lo0, sh0), (a1, lo1, sh1), (a2, lo2, sh2), (a3, lo3, sh3)):
                                T.wgmma_gemm(a[st, :, :], lo[st, :, :], sh, transpose_B=True, clear_accum=True)
                        if pattern in ("step", "step_defer", "chain"):
                            for a, md in ((a0, md0), (a1, md1), (a2, md2), (a3, md3)):
                                T.wgmma_gemm(a[st, :, :], md[:, c * BK:(c + 1) * BK], acc_ml, transpose_B=True)
                        if pattern == "two_chains":
                            for a, md, acc in ((a0, md0, acc_ml), (a1, md1, acc_ml), (a2, md2, acc_ml2),
                                               (a3, md3, acc_ml2)):
                                T.wgmma_gemm(a[st, :, :], md[:, c * BK:(c + 1) * BK], acc, transpose_B=True)
                        if pattern == "n24":  # the layout before ml48: mid and lo as two n24 chains
                            for a, md in ((a0, md0), (a1, md1), (a2, md2), (a3, md3)):
                                T.wgmma_gemm(a[st, :, :], md[0:NMIX, c * BK:(c + 1) * BK], acc_m, transpose_B=True)
                                T.wgmma_gemm(a[st, :, :], md[NMIX:2 * NMIX, c * BK:(c + 1) * BK], acc_l,
                                             transpose_B=True)
                        T.wait_wgmma({"step": 3, "step_defer": 3, "two_chains": 3, "n24": 6}.get(pattern, 0))
                        if pattern != "chain":
                            for i, n in T.Parallel(BM, NMIX):
                                acc_hi[i, n] = T.ieee_add(T.ieee_add(T.ieee_add(T.ieee_add(
                                    acc_hi[i, n], sh0[i, n]), sh1[i, n]), sh2[i, n]), sh3[i, n])
                    if pattern in ("mix", "mix_hc"):  # whole k32 groups: C0 H0 H1 C1 H2 H3 C2 C3 / H0 C0 H1 C1 ...
                        T.wait_wgmma(0)
                        if pattern == "mix":
                            order = ((a0, md0, None), (a0, lo0, sh0), (a1, lo1, sh1), (a1, md1, None), (a2, lo2, sh2),
                                     (a3, lo3, sh3), (a2, md2, None), (a3, md3, None))
                        else:
                            order = ((a0, lo0, sh0), (a0, md0, None), (a1, lo1, sh1), (a1, md1, None), (a2, lo2, sh2),
                                     (a2, md2, None), (a3, lo3, sh3), (a3, md3, None))
                        for a, w, sh in order:
                            if sh is None:
                                T.wgmma_gemm(a[st, :, :], w[:, c * BK:(c + 1) * BK], acc_ml, transpose_B=True)
                            else:
                                T.wgmma_gemm(a[st, :, :], w[st, :, :], sh, transpose_B=True, clear_accum=True)
                        T.wait_wgmma(2 if pattern == "mix" else 1)
                        for i, n in T.Parallel(BM, NMIX):
                            acc_hi[i, n] = T.ieee_add(T.ieee_add(T.ieee_add(T.ieee_add(
                                acc_hi[i, n], sh0[i, n]), sh1[i, n]), sh2[i, n]), sh3[i, n])
                    if pattern == "k16":  # chain k16 halves between hi ones: C0a H0a H1a C0b H0b H1b C1a H2a H3a ...
                        T.wait_wgmma(0)
                        for ca, cm, ha, hl, hs, hb, hm, hs2 in ((a0, md0, a0, lo0, sh0, a1, lo1, sh1),
                                                                (a2, md2, a2, lo2, sh2, a3, lo3, sh3)):
                            for kh in (0, 1):
                                T.wgmma_gemm(ca[st, :, kh * 16:kh * 16 + 16],
                                             cm[:, c * BK + kh * 16:c * BK + kh * 16 + 16], acc_ml, transpose_B=True)
                                T.wgmma_gemm(ha[st, :, kh * 16:kh * 16 + 16], hl[st, :, kh * 16:kh * 16 + 16], hs,
                                             transpose_B=True, clear_accum=kh == 0)
                                T.wgmma_gemm(hb[st, :, kh * 16:kh * 16 + 16], hm[st, :, kh * 16:kh * 16 + 16], hs2,
                                             transpose_B=True, clear_accum=kh == 0)
                        for ca, cm in ((a1, md1), (a3, md3)):  # streams 1 and 3's chains (timing only: order differs)
                            for kh in (0, 1):
                                T.wgmma_gemm(ca[st, :, kh * 16:kh * 16 + 16],
                                             cm[:, c * BK + kh * 16:c * BK + kh * 16 + 16], acc_ml, transpose_B=True)
                        T.wait_wgmma(4)
                        for i, n in T.Parallel(BM, NMIX):
                            acc_hi[i, n] = T.ieee_add(T.ieee_add(T.ieee_add(T.ieee_add(
                                acc_hi[i, n], sh0[i, n]), sh1[i, n]), sh2[i, n]), sh3[i, n])
                T.wait_wgmma(0)
                tm[0] = T.call_extern("int64", "clock64") - tm[0]
                cycles[cta, 0] = tm[0]
                for i, n in T.Parallel(BM, NMIX):
                    acc_hi[i, n] = (acc_hi[i, n] + acc_ml[i, n] + acc_ml2[i, n + NMIX] + sh0[i, n] + acc_m[i, n]
                                    + acc_l[i, n])
                for n in T.Parallel(NMIX):
                    out[cta, n] = acc_hi[0, n]
            if has_vec:  # the vector role's stand-in: each thread 8 columns of a row of the 4 streams
                if tx >= 128:
                    lt = tx - 128
                    for k, a in ((0, a0), (1, a1), (2, a2), (3, a3)):
                        for e in T.vectorized(8):
                            hb[k * 8 + e] = a[0, lt // 4, lt % 4 * 8 + e]
                    for e in T.unroll(8):
                        sq[e] = 0.0
                        xq[e] = 0.0
                    tm[0] = T.call_extern("int64", "clock64")
                    for t in T.serial(steps):
                        st = t % STAGES
                        for k, a in ((0, a0), (1, a1), (2, a2), (3, a3)):
                            if lds:  # its stage reads (16 KB a step over the 256 threads)
                                for e in T.vectorized(8):
                                    hb[k * 8 + e] = a[st, lt // 4, lt % 4 * 8 + e]
                            for e in T.unroll(8):  # about the role's arithmetic a value: squares, collapse, norm
                                hv[e] = T.ieee_add(T.cast(hb[k * 8 + e], f32), T.cast(t, f32))
                                sq[e] = T.ieee_fmaf(hv[e], hv[e], sq[e])
                                xq[e] = T.ieee_add(xq[e], T.ieee_mul(hv[e], sq[e]))
                                sq[e] = T.ieee_fmaf(xq[e], hv[e], sq[e])
                    tm[0] = T.call_extern("int64", "clock64") - tm[0]
                    if lt == 0:
                        cycles[cta, 1] = tm[0]
                        out[cta, NMIX] = sq[0] + xq[0]

    return probe


def compile_probe(pattern: str, steps: int, ctas: int):
    import tilelang
    from tvm.target import Target

    from dsv41_passes.lowering.tilelang.mhc_pre_kernel import PASS_CONFIGS, TARGET, _n24

    target = Target(TARGET)
    with target, _n24():
        return tilelang.compile(build(pattern, steps, ctas), target=target, execution_backend="tvm_ffi",
                                pass_configs=PASS_CONFIGS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--ctas", type=int, default=0, help="CTAs (default: one an SM)")
    ap.add_argument("--patterns", nargs="+", default=list(PATTERNS))
    a = ap.parse_args()
    sys.path.insert(0, ".")
    ctas = a.ctas or torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(0)
    a_in = torch.randn(STAGES, BM, BK, device="cuda", generator=g).bfloat16()
    hi_in = torch.randn(STAGES, NMIX, BK, device="cuda", generator=g).bfloat16()
    md_in = torch.randn(2 * NMIX, NC * BK, device="cuda", generator=g).bfloat16()
    print(f"# {torch.cuda.get_device_name()}, {ctas} CTAs, {a.steps} steps")
    print("| order | dots: cycles a step (median over CTAs) | min | max | vector stand-in: cycles a step |")
    print("|---|---|---|---|---|")
    for p in a.patterns:
        k = compile_probe(p, a.steps, ctas)
        out = torch.empty(ctas, 2 * NMIX, device="cuda")
        cyc = torch.zeros(ctas, 2, dtype=torch.int64, device="cuda")
        for _ in range(3):
            k(a_in, hi_in, md_in, out, cyc)
        torch.cuda.synchronize()
        per = cyc.double() / a.steps
        dots, vec = per[:, 0], per[:, 1]
        v = f"{vec.median().item():.0f}" if "+" in p else "-"
        print(f"| {p} | {dots.median().item():.0f} | {dots.min().item():.0f} | {dots.max().item():.0f} | {v} |",
              flush=True)

if __name__ == "__main__":
    main()
