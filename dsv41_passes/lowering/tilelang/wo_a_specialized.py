"""Warp-specialized TileLang WO-A kernel (sm_90a) with the pipeline written out.

The product of ``wo_a.build_one_loop`` (one K loop over every ``BK`` chunk of the group, the tile
split between consumer warpgroups by rows, ``wgmma m64 x BN``, the same K order, so the same bits),
but the rope chunks come in already de-rotated: ``T [M, H*BK]`` bf16, every head's last chunk with
its rope dims de-rotated by ``triton.wo_a.rope_tails`` (the reference's rounding). The loop is then
a plain GEMM whose A tile comes from o or, for a head's last chunk, from T. TileLang's own warp
specialization keeps TMA loads only for an unconditional copy, so the pipeline is written here:

* warp 0 issues the TMA loads of the A and W tiles into ``stages`` stages (barrier ``loaded[stage]``);
* the consumer warpgroups wait on ``loaded``, issue the chunk's wgmma asynchronously and release the
  previous chunk's stage once its wgmma has completed (``wgmma.wait_group 1``), or with ``wait0`` wait
  for the chunk's own wgmma and release its stage (TileLang's schedule).

The bf16 tile leaves through shared memory (TMA store). M is ``T.dynamic``.
Run 91 tried the de-rotation in the producer warpgroup instead (three warps de-rotating the rope chunk
in shared memory): with cos/sin read from L2 a pair at a time it took 2.3-2.5 times the kernel's time.
"""

# No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.

PRODUCER_REGS, CONSUMER_REGS = 24, 240  # setmaxnreg budgets (TileLang's own for this split)
# the pipeline is written out, and so are the two thread syncs it needs
PASS_CONFIGS = {"tl.disable_warp_specialized": True, "tl.disable_thread_storage_sync": True}


def build_specialized(g: int, r: int, hpg: int, d: int, rope_dim: int, BM: int, BN: int, BK: int,
                      stages: int, threads: int = 0, wait0: bool = False):
    """The prim_func for one geometry and config (``threads`` is implied: one producer warpgroup and
    ``BM / 64`` consumers; a value passed must count the consumers or all of them)."""
    import tilelang.language as T

    if BM % 64:
        raise ValueError(f"wo_a (tilelang, specialized): BM {BM} is not a multiple of 64")
    consumers = 128 * (BM // 64)
    if threads and threads not in (consumers, 128 + consumers):
        raise ValueError(f"wo_a (tilelang, specialized): {threads} threads do not fit BM {BM}")
    bf16 = T.bfloat16
    M = T.dynamic("M")
    K, N = hpg * d, g * r
    RD = rope_dim
    chunks = d // BK  # K chunks a head; the last holds the rope dims
    total = hpg * chunks
    side_cols = g * hpg * BK if RD else 1

    @T.prim_func
    def wo_a_specialized_kernel(
        O: T.Tensor((M, g * K), bf16),
        W: T.Tensor((N, K), bf16),
        CS: T.Tensor((M, side_cols), bf16),  # the de-rotated rope chunks (unread without RoPE)
        Z: T.Tensor((M, N), bf16),
    ):
        with T.Kernel(T.ceildiv(N, BN), T.ceildiv(M, BM), threads=128 + consumers) as (bx, by):
            a_s = T.alloc_shared((stages, BM, BK), bf16)
            b_s = T.alloc_shared((stages, BN, BK), bf16)
            z_s = T.alloc_shared((BM, BN), bf16)
            loaded = T.alloc_barrier([32] * stages)
            empty = T.alloc_barrier([consumers] * stages)
            acc = T.alloc_fragment((BM, BN), T.float32)
            tx = T.get_thread_binding()
            grp = bx * BN // r  # this tile's group
            if tx < 128:
                T.set_max_nreg(PRODUCER_REGS, 0)
                if tx < 32:
                    for t in T.serial(total):
                        st = t % stages
                        if t >= stages:  # use n of a stage waits for the release of use n - 1
                            T.mbarrier_wait_parity(empty[st], ((t // stages) + 1) % 2)
                        k0 = (t // chunks) * d + (t % chunks) * BK
                        if RD > 0 and t % chunks == chunks - 1:
                            hd = grp * hpg + t // chunks
                            T.tma_copy(CS[by * BM:(by + 1) * BM, hd * BK:(hd + 1) * BK], a_s[st, :, :],
                                       barrier=loaded[st], leader_scope_threads=32)
                        else:
                            T.tma_copy(O[by * BM:(by + 1) * BM, grp * K + k0:grp * K + k0 + BK], a_s[st, :, :],
                                       barrier=loaded[st], leader_scope_threads=32)
                        T.tma_copy(W[bx * BN:(bx + 1) * BN, k0:k0 + BK], b_s[st, :, :],
                                   barrier=loaded[st], leader_scope_threads=32)
                        T.mbarrier_arrive(loaded[st])
            else:
                T.set_max_nreg(CONSUMER_REGS, 1)
                T.clear(acc)
                for t in T.serial(total):
                    st = t % stages
                    T.mbarrier_wait_parity(loaded[st], (t // stages) % 2)
                    T.wgmma_gemm(a_s[st, :, :], b_s[st, :, :], acc, transpose_B=True,
                                 policy=T.GemmWarpPolicy.FullRow)
                    if wait0:
                        T.wait_wgmma(0)
                        T.mbarrier_arrive(empty[st])
                    else:
                        T.wait_wgmma(1)  # chunk t - 1's wgmma is done: its stage can be refilled
                        if t > 0:
                            T.mbarrier_arrive(empty[(t + stages - 1) % stages])
                T.wait_wgmma(0)
                T.copy(acc, z_s)
                T.fence_proxy_async()  # the tile's shared-memory writes, before the TMA store reads them
                T.sync_threads(1, consumers)
                T.copy(z_s, Z[by * BM, bx * BN])

    return wo_a_specialized_kernel
