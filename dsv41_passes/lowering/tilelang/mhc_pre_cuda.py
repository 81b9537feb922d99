"""CUDA helpers of the TileLang ``mhc_pre`` kernel, put before its source (``T.Kernel(prelude=...)``) by
``mhc_pre_kernel.build`` where an option calls them. Moved out of ``mhc_pre_kernel`` in the twenty-fifth session (the
same strings). The fused finish's are in ``mhc_pre_finish``."""

# 16-byte global stores with an L2 eviction policy (``x_hints``)
X_HINTS_SOURCE = r"""
#define DSV41_ST16(NAME, POLICY)                                                                          \
  __device__ __forceinline__ void NAME(void* dst, void* src) {                                            \
    const uint4 v = *reinterpret_cast<const uint4*>(src);                                                 \
    asm volatile("{\n .reg .b64 pol;\n createpolicy.fractional.L2::" POLICY ".b64 pol, 1.0;\n"           \
                 " st.global.L2::cache_hint.v4.b32 [%0], {%1, %2, %3, %4}, pol;\n}"                      \
                 :: "l"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");                         \
  }
DSV41_ST16(dsv41_st16_evict_last, "evict_last")
DSV41_ST16(dsv41_st16_evict_first, "evict_first")
"""
# four norm partials by one 16-byte relaxed load (``xss_by_row``); each element is a value another CTA stored whole
LD4_RELAXED_SOURCE = r"""
__device__ __forceinline__ void dsv41_ld4_relaxed(void* dst, void* src) {
  float4 v;
  asm volatile("ld.relaxed.gpu.global.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(src) : "memory");
  *reinterpret_cast<float4*>(dst) = v;
}
"""
# bf16 <-> f32 by bit operations (``packed_cvt``): a bf16 is the high half of its float, so a value of a packed pair
# comes out by one shift or one mask (the compiler's own conversion spends a PRMT and a shift on a high half), and a
# pair rounds to nearest in one instruction (``cvt.rn.bf16x2.f32``, as a cast a value does for each)
PACKED_CVT_SOURCE = r"""
__device__ __forceinline__ void dsv41_bf16x8_to_f32(float* dst, const void* src) {
  const uint4 v = *reinterpret_cast<const uint4*>(src);
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    dst[2 * i] = __uint_as_float(w[i] << 16);
    dst[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void dsv41_f32x8_to_bf16_back(void* dst, float* back, const float* src) {
  uint4 v;
  unsigned* w = reinterpret_cast<unsigned*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // (the prelude comes before the CUDA headers: PTX, not __float22bfloat162_rn; the first operand is the high half)
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[i]) : "f"(src[2 * i + 1]), "f"(src[2 * i]));
    if (back != nullptr) {
      back[2 * i] = __uint_as_float(w[i] << 16);
      back[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  *reinterpret_cast<uint4*>(dst) = v;
}
__device__ __forceinline__ void dsv41_f32x8_to_bf16(void* dst, const float* src) {
  dsv41_f32x8_to_bf16_back(dst, nullptr, src);
}
// the norm of 8 bf16 values in place: bf16(w * (x * rstd)), each product rounded to nearest, a pair at a time
__device__ __forceinline__ void dsv41_norm_bf16x8(void* x8, const float* w8, float rstd) {
  uint4 v = *reinterpret_cast<const uint4*>(x8);
  unsigned* w = reinterpret_cast<unsigned*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float lo = __fmul_rn(w8[2 * i], __fmul_rn(__uint_as_float(w[i] << 16), rstd));
    const float hi = __fmul_rn(w8[2 * i + 1], __fmul_rn(__uint_as_float(w[i] & 0xffff0000u), rstd));
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[i]) : "f"(hi), "f"(lo));
  }
  *reinterpret_cast<uint4*>(x8) = v;
}
"""
# a row's weights of the next row blocks fetched into L1 ahead of their loads (``post_prefetch``): in the boundary
# the loads at a block's first step waited on DRAM (run 193's Nsight Compute samples)
PREFETCH_SOURCE = r"""
__device__ __forceinline__ void dsv41_prefetch_l1(const void* p) {
  asm volatile("prefetch.global.L1 [%0];" :: "l"(p));
}
"""
# the next grid (the Triton stats kernel, launched by programmatic dependent launch) may launch now (``finish_pdl``);
# it still waits for this grid's end and writes (``griddepcontrol.wait``) before it reads the partials
PDL_TRIGGER_SOURCE = r"""
__device__ __forceinline__ void dsv41_pdl_trigger() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
"""
