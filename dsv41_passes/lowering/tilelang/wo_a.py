"""TileLang kernel of the WO-A family (sm_90a): inverse RoPE + grouped GEMM, token-major.

``z [M, G*R] = per group g: rope^-1(o[:, g-th head group]) @ Wa[g]^T``. One CTA owns a
``[BM, BN]`` tile of z whose BN columns lie in one group (``R % BN == 0``); CTAs that
share a row tile are adjacent in launch order (column tiles fastest) so o is read from
HBM about once and the weight stays in L2.

The K loop has two parts, like the Triton kernel:

1. a pipelined loop over every ``BK``-chunk without rope dims (all heads of the group):
   copy o and W chunks to shared memory, ``T.gemm`` (wgmma on sm_90a, fp32 accumulation);
2. each head's last chunk, which holds its ``RD`` rope dims: copy to shared, de-rotate
   in fp32 into a second shared tile (bf16 store = the reference's rounding), ``T.gemm``.

``build_one_loop`` (configs with ``one_loop=True``, tuner candidates) runs a single
warp-specialized loop over every chunk instead: the rope chunk is de-rotated in place in
its pipeline stage, and the tile is split between warpgroups by rows, so a 128 x 256 tile
issues wgmma m64n256k16 with four 48 KiB stages (192 KiB of shared memory).

``wo_a_specialized`` (configs with ``specialized=True``, the default from M = 2048, persistent there)
computes the same product with the pipeline written out; its rope chunks are de-rotated beforehand by
``triton.wo_a.rope_tails``, so its loop is a plain GEMM (the same bits as the one-loop kernel; above M = 32768),
or in the kernel: by its consumer warpgroups in the stage (``rope="consumers"``, a tuner candidate) or into the
A registers of a register-A wgmma (``rope="registers"``, M 2048 to 32768).

The rope table is read as ``cs [M, RD]`` fp32 with cos/sin interleaved per pair
(``view_as_real`` of the complex table, so the model's spelling needs no copy).
M is ``T.dynamic``: one binary per config serves every token count. nvcc runs with
``--fmad=false`` so the de-rotation rounds like the reference (the GEMM is wgmma).
"""

# No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations,
# which name this module's closure variables.

import threading
from typing import Any

import torch

from ...tuning import tactic
from ..rope_tables import interleaved_view
from ..wo_a import geometry, split_parts

# the launch configs and defaults (re-exported: callers and tests name them here)
from .wo_a_configs import (  # noqa: F401
    _DECODE,
    BATCH_INVARIANT_CONFIG,
    CANDIDATES,
    DECODE_MAX_M,
    DEFAULTS,
    MID_MAX_M,
    REGISTERS_128,
    REGISTERS_256,
    REGISTERS_64,
    REGISTERS_MAX_N,
    SPECIALIZED_CONFIG,
    SPECIALIZED_CONSUMERS_CONFIG,
    SPECIALIZED_REGISTERS_CONFIG,
    STREAM_K_SHARE,
    TACTIC_OP,
    decode_config,
    default_config,
    mid_config,
    sm_count,
    split_config,
    untuned_config,
)

TARGET = {"kind": "cuda", "arch": "sm_90a"}


def _pow2_divisor(x: int) -> int:
    return x & -x


def _tiles(cfg: dict, d: int, r: int, rope_dim: int) -> tuple[int, int]:
    """(BN, BK) clipped to the shape: BN divides R, BK divides D and holds the rope dims."""
    bn = min(cfg["BN"], _pow2_divisor(r))
    bk = min(cfg["BK"], _pow2_divisor(d))
    if rope_dim:
        bk = max(bk, 1 << (rope_dim - 1).bit_length())
    return bn, bk


def shape_reason(h: int, d: int, g: int, r: int, rope_dim: int) -> str | None:
    """Why the kernel cannot be built for this geometry (None when it can)."""
    if r % 32:
        return f"o_rank {r} is not a multiple of 32"
    if d % 64:
        return f"head_dim {d} is not a multiple of 64"
    if rope_dim and _pow2_divisor(d) < max(64, 1 << (rope_dim - 1).bit_length()):
        return f"rope_dim {rope_dim} does not fit one power-of-two chunk of head_dim {d}"
    return None


def unsupported_reason(o: torch.Tensor, weight: torch.Tensor, rope_dim: int) -> str | None:
    _, h, d, g, r, _ = geometry(o, weight)
    if o.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return f"dtypes {o.dtype}/{weight.dtype} (kernel is bf16)"
    if not o.is_contiguous():
        return f"o is not contiguous (strides {tuple(o.stride())}); the kernel reads a dense [M, H*D]"
    if not weight.is_contiguous():
        return "weight is not contiguous"
    return shape_reason(h, d, g, r, rope_dim)


# ------------------------------------------------------------------ kernel
def build(g: int, r: int, hpg: int, d: int, rope_dim: int, BM: int, BN: int, BK: int, stages: int, threads: int):
    """The TileLang prim_func for one geometry and config (M dynamic)."""
    import tilelang.language as T

    bf16, f32 = T.bfloat16, T.float32
    M = T.dynamic("M")
    K, N = hpg * d, g * r
    RD = rope_dim
    chunks = d // BK  # K-chunks per head
    plain = chunks - 1 if RD else chunks  # per head, chunks without rope dims
    rope_from = BK - RD  # first rope column inside a head's last chunk
    cs_cols = max(RD, 2)  # the table's width (a placeholder column pair without RoPE)

    @T.prim_func
    def wo_a_kernel(
        O: T.Tensor((M, g * K), bf16),  # noqa: E741
        W: T.Tensor((N, K), bf16),
        CS: T.Tensor((M, cs_cols), f32),
        Z: T.Tensor((M, N), bf16),
    ):
        with T.Kernel(T.ceildiv(N, BN), T.ceildiv(M, BM), threads=threads) as (bx, by):
            a_s = T.alloc_shared((BM, BK), bf16)
            b_s = T.alloc_shared((BN, BK), bf16)
            acc = T.alloc_fragment((BM, BN), f32)
            col0 = (bx * BN // r) * K  # first o column of this tile's group
            T.clear(acc)
            if plain > 0:
                for t in T.Pipelined(hpg * plain, num_stages=stages):
                    k0 = (t // plain) * d + (t % plain) * BK
                    T.copy(O[by * BM, col0 + k0], a_s)
                    T.copy(W[bx * BN, k0], b_s)
                    T.gemm(a_s, b_s, acc, transpose_B=True)
            if RD > 0:
                x_s = T.alloc_shared((BM, BK), bf16)
                y_s = T.alloc_shared((BM, BK), bf16)
                r_s = T.alloc_shared((BN, BK), bf16)
                cs_s = T.alloc_shared((BM, cs_cols), f32)
                T.copy(CS[by * BM, 0], cs_s)
                for h in T.Pipelined(hpg, num_stages=2):
                    k0 = h * d + d - BK
                    T.copy(O[by * BM, col0 + k0], x_s)
                    T.copy(W[bx * BN, k0], r_s)
                    for i, j in T.Parallel(BM, BK):
                        # pair (2p, 2p+1) of the tail: y0 = x0*c + x1*s, y1 = x1*c - x0*s
                        jr = T.max(j - rope_from, 0)
                        odd = jr % 2
                        c = cs_s[i, jr - odd]
                        s = cs_s[i, jr - odd + 1]
                        x = T.cast(x_s[i, j], f32)
                        xp = T.cast(x_s[i, j + 1 - 2 * odd], f32)
                        y_s[i, j] = T.if_then_else(
                            j >= rope_from, T.cast(x * c + xp * T.if_then_else(odd == 1, -s, s), bf16), x_s[i, j]
                        )
                    T.gemm(y_s, r_s, acc, transpose_B=True)
            T.copy(acc, Z[by * BM, bx * BN])

    return wo_a_kernel


def build_one_loop(g: int, r: int, hpg: int, d: int, rope_dim: int, BM: int, BN: int, BK: int, stages: int,
                   threads: int, rope_regs: bool = False, cs_regs: bool = False, epi_smem: bool = False,
                   split: int = 1, cluster: bool = False):
    """Variant (config ``one_loop=True``): one warp-specialized K loop over every chunk; the warpgroups
    split the tile by rows (wgmma ``m64 x BN``). A head's rope chunk is de-rotated in place in its
    pipeline stage before its gemm, or with ``rope_regs`` into a register fragment that feeds the
    wgmma as its A operand (each thread de-rotates its own elements: no barrier, the stage is read only).
    ``cs_regs`` (in-place path): cos/sin depend on the row only, so each thread loads the pairs it
    de-rotates once, before the loop, into registers, instead of at every head's rope chunk.
    ``epi_smem``: the bf16 tile goes to global memory through shared memory (row-contiguous stores)
    instead of straight from the accumulator fragment.
    ``split`` > 1 (split-K, decode sizes, not batch-invariant): the third grid axis picks ``HPG/split``
    whole heads of the group; each CTA writes its fp32 partial tile to ``Z [split, M, N]`` for a
    fixed-order sum kernel."""
    import tilelang.language as T

    bf16, f32 = T.bfloat16, T.float32
    M = T.dynamic("M")
    K, N = hpg * d, g * r
    RD = rope_dim
    chunks = d // BK
    rope_from = BK - RD
    cs_cols = max(RD, 2)
    half = max(RD // 2, 1)
    hps = hpg // split  # heads of the group one CTA reduces over
    if cluster and not (1 < split <= 8 and BM % split == 0 and BN % 4 == 0):
        raise ValueError(f"wo_a (tilelang): a cluster reduction needs 2 to 8 parts dividing BM and BN a multiple of 4, "
                         f"got {split} parts, BM {BM}, BN {BN}")
    z_shape, z_dtype = ((split, M, N), f32) if split > 1 and not cluster else ((M, N), bf16)
    rows = BM // split  # rows of the tile each CTA of a cluster sums
    launch = dict(cluster_dims=(1, 1, split), prelude=CLUSTER_SUM_SOURCE) if cluster else {}

    @T.prim_func
    def wo_a_one_loop_kernel(
        O: T.Tensor((M, g * K), bf16),  # noqa: E741
        W: T.Tensor((N, K), bf16),
        CS: T.Tensor((M, cs_cols), f32),
        Z: T.Tensor(z_shape, z_dtype),
    ):
        with T.Kernel(T.ceildiv(N, BN), T.ceildiv(M, BM), split, threads=threads, **launch) as (bx, by, bz):
            a_s = T.alloc_shared((BM, BK), bf16)
            b_s = T.alloc_shared((BN, BK), bf16)
            acc = T.alloc_fragment((BM, BN), f32)
            if cluster:
                p_s = T.alloc_shared((BM, BN), f32)  # this CTA's partial, read by the cluster
            if rope_regs:
                a_r = T.alloc_fragment((BM, BK), bf16)
            if not rope_regs:
                y0_f = T.alloc_fragment((BM, half), bf16)
                y1_f = T.alloc_fragment((BM, half), bf16)
            if cs_regs:
                c_f = T.alloc_fragment((BM, half), f32)
                s_f = T.alloc_fragment((BM, half), f32)
                for i, p in T.Parallel(BM, half):
                    live = by * BM + i < M
                    c_f[i, p] = T.if_then_else(live, CS[by * BM + i, 2 * p], 0.0)
                    s_f[i, p] = T.if_then_else(live, CS[by * BM + i, 2 * p + 1], 0.0)
            col0 = (bx * BN // r) * K
            T.clear(acc)
            for t in T.Pipelined(hps * chunks, num_stages=stages):
                k0 = (bz * hps + t // chunks) * d + (t % chunks) * BK
                T.copy(O[by * BM, col0 + k0], a_s)
                T.copy(W[bx * BN, k0], b_s)
                if RD > 0 and t % chunks == chunks - 1:
                    if rope_regs:
                        for i, j in T.Parallel(BM, BK):
                            # pair (2p, 2p+1) of the tail: y0 = x0*c + x1*s, y1 = x1*c - x0*s
                            jr = T.max(j - rope_from, 0)
                            odd = jr % 2
                            live = by * BM + i < M
                            c = T.if_then_else(live, CS[by * BM + i, jr - odd], 0.0)
                            s = T.if_then_else(live, CS[by * BM + i, jr - odd + 1], 0.0)
                            x = T.cast(a_s[i, j], f32)
                            xp = T.cast(a_s[i, j + 1 - 2 * odd], f32)
                            a_r[i, j] = T.if_then_else(
                                j >= rope_from, T.cast(x * c + xp * T.if_then_else(odd == 1, -s, s), bf16), a_s[i, j]
                            )
                        T.gemm(a_r, b_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    else:
                        # two phases (read all pairs, then write them back): one barrier between them;
                        # a single read-modify-write loop gets a barrier per pair of every thread
                        for i, p in T.Parallel(BM, half):
                            if cs_regs:
                                c = c_f[i, p]
                                s = s_f[i, p]
                            else:
                                live = by * BM + i < M
                                c = T.if_then_else(live, CS[by * BM + i, 2 * p], 0.0)
                                s = T.if_then_else(live, CS[by * BM + i, 2 * p + 1], 0.0)
                            x0 = T.cast(a_s[i, rope_from + 2 * p], f32)
                            x1 = T.cast(a_s[i, rope_from + 2 * p + 1], f32)
                            y0_f[i, p] = T.cast(x0 * c + x1 * s, bf16)
                            y1_f[i, p] = T.cast(x1 * c - x0 * s, bf16)
                        for i, p in T.Parallel(BM, half):
                            a_s[i, rope_from + 2 * p] = y0_f[i, p]
                            a_s[i, rope_from + 2 * p + 1] = y1_f[i, p]
                        T.gemm(a_s, b_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                else:
                    T.gemm(a_s, b_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            if cluster:
                T.copy(acc, p_s)
                T.cluster_sync()  # every partial is in its CTA's shared memory
                for i, j in T.Parallel(rows, BN // 4):  # rank bz of the cluster (its split index) sums rows bz * rows..
                    T.call_extern("handle", "dsv41_cluster_sum4", T.address_of(p_s[bz * rows + i, j * 4]), split,
                                  T.address_of(Z[by * BM + bz * rows + i, bx * BN + j * 4]),
                                  by * BM + bz * rows + i < M)
                T.cluster_sync()  # no CTA leaves while another reads its partial
            elif split > 1:
                T.copy(acc, Z[bz, by * BM, bx * BN])
            elif epi_smem:
                z_s = T.alloc_shared((BM, BN), bf16)
                T.copy(acc, z_s)
                T.copy(z_s, Z[by * BM, bx * BN])
            else:
                T.copy(acc, Z[by * BM, bx * BN])

    return wo_a_one_loop_kernel


# ``cluster``: four fp32 of a row, summed over the cluster's CTAs in rank order (the same offset in each CTA's
# shared memory, read through distributed shared memory), rounded to bf16 and stored when the row is live
CLUSTER_SUM_SOURCE = r"""
#include <cuda_bf16.h>
__device__ __forceinline__ void dsv41_cluster_sum4(void* src, int parts, void* dst, bool live) {
  const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(src));
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int q = 0; q < parts; ++q) {
    unsigned remote;
    float4 v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(q));
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(remote) : "memory");
    if (q == 0) {
      acc = v;
    } else {
      acc.x = __fadd_rn(acc.x, v.x); acc.y = __fadd_rn(acc.y, v.y);
      acc.z = __fadd_rn(acc.z, v.z); acc.w = __fadd_rn(acc.w, v.w);
    }
  }
  if (live) {
    __nv_bfloat162 out[2] = {__float22bfloat162_rn(make_float2(acc.x, acc.y)),
                             __float22bfloat162_rn(make_float2(acc.z, acc.w))};
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(out);
  }
}
"""

_CACHE: dict[tuple, Any] = {}
_LOCK = threading.Lock()


def compile_kernel(g: int, r: int, hpg: int, d: int, rope_dim: int, cfg: dict, target: dict | None = None):
    """Compiled kernel for a geometry + config, cached (one binary serves every M)."""
    key = (g, r, hpg, d, rope_dim, tuple(sorted(_tile_args(cfg).items())), _builder(cfg).__name__,
           tuple(sorted((target or TARGET).items())))
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            return hit
        import tilelang
        from tvm.target import Target

        tgt = Target(target or TARGET)
        with tgt:
            fn = _builder(cfg)(g, r, hpg, d, rope_dim, **_tile_args(cfg))
            # no FMA contraction: the de-rotation rounds each product and sum like the reference
            kernel = tilelang.compile(fn, target=tgt, execution_backend="tvm_ffi", compile_flags=["--fmad=false"],
                                      pass_configs=_pass_configs(cfg))
        _CACHE[key] = kernel
        return kernel


def lower_source(g: int, r: int, hpg: int, d: int, rope_dim: int, cfg: dict) -> str:
    """CUDA source of the kernel for sm_90a (needs no GPU and no nvcc)."""
    import tilelang
    from tvm.target import Target

    tgt = Target(TARGET)
    with tgt, tilelang.transform.PassContext(config=_pass_configs(cfg)):
        return tilelang.lower(_builder(cfg)(g, r, hpg, d, rope_dim, **_tile_args(cfg)), target=tgt).kernel_source


def _builder(cfg: dict):
    if cfg.get("specialized"):
        from .wo_a_specialized import build_specialized  # noqa: PLC0415

        return build_specialized
    return build_one_loop if cfg.get("one_loop") else build


def _pass_configs(cfg: dict) -> dict:
    if cfg.get("specialized"):
        from .wo_a_specialized import PASS_CONFIGS  # noqa: PLC0415

        return dict(PASS_CONFIGS)
    return {}


def _tile_args(cfg: dict) -> dict:
    skip = ("one_loop", "SPLIT", "pdl")  # (``pdl`` is the sum kernel's)
    if cfg.get("specialized"):  # the tile always leaves through shared memory
        skip += ("specialized", "cs_regs", "epi_smem", "persistent")
    args = {k: v for k, v in cfg.items() if k not in skip}
    if cfg.get("SPLIT", 1) > 1:
        args["split"] = cfg["SPLIT"]
    if cfg.get("specialized") and cfg.get("persistent"):
        args["ctas"] = sm_count()
    return args


_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``WS`` / ``FL`` of a specialized kernel: for ``stream_k`` the cut tiles' partials (fp32, one a CTA) and their
    flags (zero between launches: each launch takes every flag it sets), one pair per device and stream, so
    launches that may overlap never share one (CUDA graphs captured on one stream share it: replay them one at a
    time, as a serving loop does); otherwise one-element placeholders."""
    from .wo_a_specialized import workspace_shapes  # noqa: PLC0415

    sk = bool(cfg.get("stream_k"))
    ws, fl = workspace_shapes(sm_count() if sk else 1, cfg["BM"], cfg["BN"], sk)
    key = (str(device), torch.cuda.current_stream(device).stream_id if sk else 0, ws, fl)
    hit = _WORKSPACES.get(key)
    if hit is None:
        hit = _WORKSPACES[key] = (torch.empty(ws, dtype=torch.float32, device=device),
                                  torch.zeros(fl, dtype=torch.int32, device=device))
    return hit


def derotates_beforehand(cfg: dict, rope_dim: int) -> bool:
    """Whether the kernel of ``cfg`` reads its rope chunks de-rotated by ``rope_tails`` (not the table)."""
    return bool(rope_dim and cfg.get("specialized") and cfg.get("rope", "tails") == "tails")


def launch_config(config: dict, h: int, d: int, r: int, rope_dim: int) -> dict:
    """``config`` with BN / BK clipped to the shape (and ``z_cols``, the width of the tile's store buffer, to BN). A
    specialized config whose consumers cannot de-rotate the rope pairs (``rope_reason``) reads them from
    ``rope_tails``; one that reads them from there becomes the one-loop kernel with the same bits
    (``BATCH_INVARIANT_CONFIG``) where ``rope_tails`` cannot tile them."""
    from ..triton.wo_a import rope_tails_tile  # noqa: PLC0415
    from .wo_a_specialized import rope_reason  # noqa: PLC0415

    if config.get("stream_k") and not (config.get("specialized") and config.get("persistent")):
        raise ValueError(f"wo_a (tilelang): stream_k needs a persistent specialized config, got {config}")
    bn, bk = _tiles(config, d, r, rope_dim)
    if config.get("specialized") and rope_dim and rope_reason(config.get("rope", "tails"), rope_dim):
        config = dict(config, rope="tails")
    if derotates_beforehand(config, rope_dim) and not rope_tails_tile(h, bk):
        config = BATCH_INVARIANT_CONFIG
        bn, bk = _tiles(config, d, r, rope_dim)
    if config.get("z_cols", 0) > bn:  # a narrower tile leaves in one part
        config = dict(config, z_cols=bn)
    return dict(config, BN=bn, BK=bk)


def tactic_key(o: torch.Tensor, weight: torch.Tensor, rope_dim: int) -> tuple[str, dict]:
    """(op, shape key) under which this provider's tuned configs are stored (``rope_dim`` 0: no RoPE)."""
    _, _, d, g, r, k = geometry(o, weight)
    return TACTIC_OP, dict(g=g, r=r, k=k, d=d, rd=rope_dim)


def _rope_table(cos: torch.Tensor, sin: torch.Tensor, m: int, rope_dim: int) -> torch.Tensor:
    """``cs [M, RD]`` with (cos, sin) interleaved; a view when cos/sin come from ``view_as_real``."""
    cs = interleaved_view(cos, sin)
    if cs is not None and cs.is_contiguous():
        return cs
    return torch.stack((cos, sin), dim=-1).reshape(m, rope_dim)


def wo_a(
    o: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    rope_dim: int,
    *,
    batch_invariant: bool,
    config: dict | None = None,
) -> torch.Tensor:
    m, h, d, g, r, _ = geometry(o, weight)
    n = g * r
    rd = rope_dim if cos is not None else 0
    why = unsupported_reason(o, weight, rd)
    if why:
        raise ValueError(f"wo_a (tilelang): {why}")
    z = torch.empty((m, n), dtype=o.dtype, device=o.device)
    if m == 0:
        return z
    if config is None:
        default = BATCH_INVARIANT_CONFIG if batch_invariant else untuned_config(m, n, h // g)
        op, key = tactic_key(o, weight, rd)
        config = tactic(op, m, key, default, batch_invariant=batch_invariant)
    cfg = launch_config(config, h, d, r, rd)
    split = split_parts(cfg.pop("SPLIT", 1), h // g, batch_invariant, "tilelang")
    if split > 1:
        if not cfg.get("one_loop") or cfg.get("specialized"):
            raise ValueError("wo_a (tilelang): split-K needs a one_loop config (not a specialized one)")
        cfg["SPLIT"] = split
    else:
        cfg.pop("cluster", None)  # one part: nothing to reduce
    if batch_invariant:
        cfg.pop("stream_k", None)  # a cut tile's bits depend on M
    kernel = compile_kernel(g, r, h // g, d, rd, cfg)
    if derotates_beforehand(cfg, rd):  # its rope chunks come in de-rotated
        from ..triton.wo_a import rope_tails  # noqa: PLC0415  (one pass over the rope chunks of o)

        cs = rope_tails(o, cos, sin, rd, cfg["BK"]).view(m, h * cfg["BK"])
    elif rd:
        cs = _rope_table(cos, sin, m, rd)
    elif cfg.get("specialized"):
        cs = torch.empty((m, 1), dtype=o.dtype, device=o.device)  # unread
    else:
        cs = torch.empty((m, 2), dtype=torch.float32, device=o.device)  # unread
    if cfg.get("specialized"):
        kernel(o.view(m, h * d), weight, cs, z, *_workspace(o.device, cfg))
        return z
    if split == 1 or cfg.get("cluster"):  # (a cluster sums its parts itself)
        kernel(o.view(m, h * d), weight, cs, z)
        return z
    from ..triton.wo_a import sum_splits  # noqa: PLC0415  (the fixed-order sum of the parts)

    part = torch.empty((split, m, n), dtype=torch.float32, device=o.device)
    kernel(o.view(m, h * d), weight, cs, part)
    return sum_splits(part, z, pdl=bool(cfg.get("pdl")))
