"""The stats of the TileLang ``mhc_pre`` computed inside its persistent kernel (``fused_finish``), instead of the Triton
stats kernel launched after it (``mhc_pre._finish``).

Warps 1-3 of the producer warpgroup are idle with ``held_norm`` (warp 0 issues the copies). Here they take, for each
row block of their CTA (group g, slice s), rows ``4 s .. 4 s + 3`` of the block's 64: once the 16 CTAs of the group have
published the block's mix and sum-of-squares partials, they sum them, scale by the rsqrt, and compute pre, post and
comb (softmax + Sinkhorn), with the Triton finish's roundings (``triton.mhc_finish``: its stats are pinned to the same
PTX instructions, ``FINISH_SOURCE`` repeats them), so with the Triton kernel's bits.

Publication: each warp of the dots role (after its ``ws`` stores) and of the vector role (after its ``ss`` stores)
adds 1 to the block's counter with a release reduction once its lanes have synced; the counters sit after the norm
partials in ``xss`` and start at ``SENTINEL`` like them (one fill before the launch), so a block is in when its counter
reaches ``SENTINEL + 16 * 12``. The finishing threads poll it with relaxed loads, then fence (``dsv41_wait_count``).

Work a block: 96 threads sum the 4 rows' 24 mix columns (thread (row, column): its 16 partials in a pairwise tree,
the row's 16 sum-of-squares partials the same way) into shared memory; then warps 1-2 hold the 4 rows' 16 comb
entries, one a lane (lanes 16 q + 4 i + j: the softmax and Sinkhorn's row and column sums are shuffles within 4 and
16 lanes, in the Triton kernel's pairwise order), and warp 3 the 4 rows' 4 pre and 4 post values. Only rows below M
are stored. The last row block's finish is the kernel's tail."""

# No ``from __future__ import annotations``: TileLang evaluates the macros' annotations.

from types import SimpleNamespace

# mix and sum-of-squares partials summed in the Triton finish's order and roundings (``triton.mhc_finish``:
# ``pairwise_row_sum`` over the 16 slices, ``_div`` = div.full, ``_div_rn``, ``_exp2`` = ex2.approx of a rounded
# product, every product and sum rounded on its own); the counters of published row blocks
FINISH_SOURCE = r"""
__device__ __forceinline__ float dsv41_div_full(float x, float y) {
  float r;
  asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
  return r;
}
__device__ __forceinline__ float dsv41_div_rn(float x, float y) {
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
  return r;
}
__device__ __forceinline__ float dsv41_ex2(float x) {
  float r;
  asm("ex2.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
// 16 values p[0], p[stride], ...: adjacent pairs, then pairs of those (``pairwise_row_sum``)
__device__ __forceinline__ float dsv41_tree16(const float* p, int stride) {
  float v[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = __ldcg(p + i * stride);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = __fadd_rn(v[2 * i], v[2 * i + 1]);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = __fadd_rn(v[2 * i], v[2 * i + 1]);
  v[0] = __fadd_rn(v[0], v[1]);
  v[1] = __fadd_rn(v[2], v[3]);
  return __fadd_rn(v[0], v[1]);
}
// the stats' rsqrt: 1 / sqrt(ss / K + eps)
__device__ __forceinline__ float dsv41_stats_rstd(float ss, float k, float eps) {
  return dsv41_div_full(1.0f, __fsqrt_rn(__fadd_rn(dsv41_div_rn(ss, k), eps)));
}
// 1 / (1 + e^-z)
__device__ __forceinline__ float dsv41_sigmoid(float z) {
  return dsv41_div_full(1.0f, __fadd_rn(dsv41_ex2(__fmul_rn(z, -0x1.715476p+0f)), 1.0f));
}
// v / (((v_a + v_b) + (v_c + v_d)) + eps) over the 4 lanes that differ in lane bits ``bit`` and 2 * bit
__device__ __forceinline__ float dsv41_norm4(float v, int bit, float eps) {
  float t = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, bit));
  t = __fadd_rn(t, __shfl_xor_sync(0xffffffffu, t, 2 * bit));
  return dsv41_div_full(v, __fadd_rn(t, eps));
}
// comb entry (i, j) of lane 16 q + 4 i + j from its softmax input z: softmax over j plus eps, the column
// normalization, then iters - 1 rounds of row and column normalization (Sinkhorn)
__device__ __forceinline__ float dsv41_comb(float z, float eps, int iters) {
  float mx = fmaxf(z, __shfl_xor_sync(0xffffffffu, z, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float e = dsv41_ex2(__fmul_rn(__fsub_rn(z, mx), 0x1.715476p+0f));
  float t = __fadd_rn(e, __shfl_xor_sync(0xffffffffu, e, 1));
  t = __fadd_rn(t, __shfl_xor_sync(0xffffffffu, t, 2));
  float c = dsv41_norm4(__fadd_rn(dsv41_div_full(e, t), eps), 4, eps);
  for (int it = 1; it < iters; ++it) {
    c = dsv41_norm4(c, 1, eps);
    c = dsv41_norm4(c, 4, eps);
  }
  return c;
}
// a warp's publication of a row block (after its lanes' stores) and the wait for all of them
__device__ __forceinline__ void dsv41_count_release(void* p) {
  asm volatile("red.release.gpu.global.add.f32 [%0], %1;" :: "l"(p), "f"(1.0f) : "memory");
}
// (polled relaxed, then one fence: an acquire load in the loop would be a fence at every poll)
__device__ __forceinline__ void dsv41_wait_count(void* p, float target) {
  float v;
  do {
    asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
  } while (v != target);
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
}
"""


def finish_loop(T, geo: SimpleNamespace):
    """``finish_blocks(ws, ss, xss, io_fin, s, g, nloc, ft, fin_s, f0, fv)``: the finishing warps' loop over the
    CTA's ``nloc`` row blocks (``ft``: the thread's index among the 96, ``fin_s[f0:f0 + 96]``: f32 shared, ``fv``: [8]
    f32 local (the scales, its phase-2 column's base, the rsqrt, a result), ``io_fin``: scale, base, pre, post,
    comb), and ``count_block(xss, rb, lt)``: a warp's publication of row block ``rb`` (``lt``: the thread's index in
    its role)."""
    S, BM, m, groups, wgs, d = geo.S, geo.BM, geo.m, geo.groups, geo.wgs, geo.d
    iters, hc_eps, norm_eps = geo.finish_consts
    cnt0 = T.ceildiv(m, geo.bm) * wgs * S * BM  # the counters' offset in xss (after the norm partials)
    # 16 CTAs of a group, each with its dots' 4 warps and its vector role's 8
    target = geo.SENTINEL + S * (1 + 2) * 4

    @T.macro
    def count_block(xss, rb, lt):
        T.sync_warp()
        if lt % 32 == 0:
            T.call_extern("handle", "dsv41_count_release", T.address_of(xss[cnt0 + rb]))

    @T.macro
    def finish_blocks(ws, ss, xss, io_fin, s, g, nloc, ft, fin_s, f0, fv):
        scale, base, pre, post, comb = io_fin
        q = ft // 24  # phase 1: row q of the 4, mix column c
        c = ft % 24
        for k in T.unroll(3):
            fv[k] = scale[k]
        if ft < 64:  # phase 2: comb (i, j) = e // 4, e % 4 of row ft // 16; warp 3: pre (cc < 4) or post
            fv[4] = base[8 + ft % 16]
        else:
            fv[4] = base[(ft - 64) % 8]
        for j in T.serial(nloc):
            rb = g + j * groups
            rr = s * 4 + q  # the row in its 64-row block
            T.call_extern("handle", "dsv41_wait_count", T.address_of(xss[cnt0 + rb]), T.float32(target))
            slot = (rb * wgs + rr // BM) * S * BM + rr % BM  # slice 0's partial of the row; slice s2 at + s2 * BM
            fv[5] = T.call_extern("float32", "dsv41_stats_rstd",
                                  T.call_extern("float32", "dsv41_tree16", T.address_of(ss[slot]), BM),
                                  T.float32(4 * d), T.float32(norm_eps))
            fin_s[f0 + ft] = T.ieee_mul(
                T.call_extern("float32", "dsv41_tree16", T.address_of(ws[slot, c]), BM * 24), fv[5])
            T.sync_threads(2, 96)
            if ft < 64:
                row = rb * geo.bm + s * 4 + ft // 16
                fv[6] = T.call_extern("float32", "dsv41_comb",
                                      T.ieee_add(T.ieee_mul(fin_s[f0 + ft // 16 * 24 + 8 + ft % 16], fv[2]), fv[4]),
                                      T.float32(hc_eps), T.int32(iters))
                if row < m:
                    comb[row, ft % 16] = fv[6]
            else:
                row = rb * geo.bm + s * 4 + (ft - 64) // 8
                cc = (ft - 64) % 8
                if cc < 4:
                    fv[6] = T.ieee_add(T.call_extern("float32", "dsv41_sigmoid",
                                                     T.ieee_add(T.ieee_mul(fin_s[f0 + (ft - 64) // 8 * 24 + cc], fv[0]),
                                                                fv[4])),
                                       T.float32(hc_eps))
                    if row < m:
                        pre[row, cc] = fv[6]
                else:
                    fv[6] = T.call_extern("float32", "dsv41_sigmoid",
                                          T.ieee_add(T.ieee_mul(fin_s[f0 + (ft - 64) // 8 * 24 + cc], fv[1]), fv[4]))
                    if row < m:
                        post[row, cc - 4] = T.ieee_add(fv[6], fv[6])
            T.sync_threads(2, 96)  # (fin_s is written again for the next block)

    return SimpleNamespace(count_block=count_block, finish_blocks=finish_blocks)
