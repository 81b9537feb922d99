"""How fast the residual can be read in the order the TileLang ``mhc_pre`` reads it, against other orders: does the
DRAM's locality of its pieces (a 64-row box of 32 columns of each stream, at each K slice's own offset) cap its
pipeline below the copy bandwidth?

Each kernel is a plain TileLang pipeline (TMA copies of ``[rows, cols]`` boxes into shared memory, ``stages`` deep,
each box summed by 128 threads), 128 CTAs, reading ``h [M, 4 * d]`` bf16 once. Orders (a step is one box):
``slices``: the ``mhc_pre``'s: 8 groups of 16 CTAs on the 16 K slices of a 64-row block, each slice ``d / 16``
columns of each stream, walked 32 columns at a time with the 4 streams at each offset; ``interleaved``: the same
but a slice is every 16th 32-column chunk of each stream, so the 16 CTAs of a group read one contiguous KiB of a row
and stream at each step; ``rows``: each CTA walks whole rows of its own row blocks. Prints GB/s (the bytes of h over
the median CUDA-graph replay) beside a measured copy bandwidth.

    source .devsite/setup.sh && python3 benchmarks/probe_read_pattern.py [--m 65536] [--stages 4] [--orders slices]
"""


import argparse
import sys

import torch

HC, SLICES, GROUPS = 4, 16, 8


def column(order: str, d: int, box: int, s, u):
    """Column (within a stream) of step ``u`` of a row block, for slice (or CTA) ``s``; a step reads the 4 streams'
    boxes at that column and writes their sum there (``write``)."""
    if order == "slices":  # the slice's chunk u
        return s * (d // SLICES) + u * box
    if order == "interleaved":  # the slice's chunk u is the row's chunk 16 u + s
        return u * (box * SLICES) + s * box
    if order == "rows":  # the row's chunk u
        return u * box
    raise ValueError(order)


def build(order: str, m: int, d: int, rows: int, box: int, stages: int, write: bool, store: str = "st",
          load_policy: str | None = None):
    """A step copies 4 boxes (as the ``mhc_pre``'s stage holds the 4 streams' boxes at one column offset); with
    ``write`` it also stores their sum in bf16 to ``x [M, d]`` (the bytes of the ``mhc_pre``'s output): by the
    threads' own stores (``store`` "st") or through shared memory and a TMA store ("tma"). ``load_policy``: the
    residual's copies' L2 eviction policy (the ``mhc_pre``'s: "evict_first")."""
    import tilelang.language as T

    k_total = HC * d
    nprog = GROUPS * SLICES
    if order == "rows":
        spb = d // box  # steps a row block
        blocks = m // rows // nprog
    else:
        spb = d // SLICES // box
        blocks = m // rows // GROUPS
    bf16, f32 = "bfloat16", "float32"

    @T.prim_func
    def read(h: T.Tensor((m, k_total), bf16), x: T.Tensor((m, d), bf16), out: T.Tensor((nprog * rows,), f32)):
        with T.Kernel(nprog, threads=128) as p:
            a0 = T.alloc_shared((rows, box), bf16)
            a1 = T.alloc_shared((rows, box), bf16)
            a2 = T.alloc_shared((rows, box), bf16)
            a3 = T.alloc_shared((rows, box), bf16)
            y_s = T.alloc_shared((rows, box), bf16)
            acc = T.alloc_fragment((rows, box), f32)
            row = T.alloc_fragment((rows,), f32)
            T.clear(acc)
            for t in T.Pipelined(blocks * spb, num_stages=stages):
                if order == "rows":
                    r = (p + (t // spb) * nprog) * rows
                    s = p
                else:
                    r = (p // SLICES + (t // spb) * GROUPS) * rows
                    s = p % SLICES
                col = column(order, d, box, s, t % spb)
                T.copy(h[r, col], a0, eviction_policy=load_policy)
                T.copy(h[r, d + col], a1, eviction_policy=load_policy)
                T.copy(h[r, 2 * d + col], a2, eviction_policy=load_policy)
                T.copy(h[r, 3 * d + col], a3, eviction_policy=load_policy)
                for i, c in T.Parallel(rows, box):
                    v = (T.cast(a0[i, c], f32) + T.cast(a1[i, c], f32)) + (T.cast(a2[i, c], f32)
                                                                           + T.cast(a3[i, c], f32))
                    acc[i, c] += v
                    if write and store == "st":
                        x[r + i, col + c] = T.cast(v, bf16)
                    if write and store == "tma":
                        y_s[i, c] = T.cast(v, bf16)
                if write and store == "tma":
                    T.copy(y_s, x[r, col])
            T.reduce_sum(acc, row, dim=1)
            for i in T.Parallel(rows):
                out[p * rows + i] = row[i]

    return read


def compile_read(order: str, m: int, d: int, rows: int, box: int, stages: int, write: bool, store: str = "st",
                 load_policy: str | None = None):
    import tilelang
    from tvm.target import Target

    target = Target({"kind": "cuda", "arch": "sm_90a"})
    with target:
        func = build(order, m, d, rows, box, stages, write, store, load_policy)
        return tilelang.compile(func, target=target, execution_backend="tvm_ffi")


ORDERS = {  # name: (order, rows, box columns)
    "slices, 64 x 32 boxes (the mhc_pre's order)": ("slices", 64, 32),
    "interleaved slices, 64 x 32": ("interleaved", 64, 32),
    "slices, 64 x 64": ("slices", 64, 64),
    "whole rows, 64 x 32": ("rows", 64, 32),
    "whole rows, 64 x 64": ("rows", 64, 64),
}
# the mhc_pre's order with its stores and load policy varied: (write, store, load policy)
STORES = {
    "read": (False, "st", None),
    "read, evict-first loads": (False, "st", "evict_first"),
    "read + write x by the threads": (True, "st", None),
    "read + write x by the threads, evict-first loads": (True, "st", "evict_first"),
    "read + write x by TMA": (True, "tma", None),
    "read + write x by TMA, evict-first loads": (True, "tma", "evict_first"),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=65536)
    ap.add_argument("--d", type=int, default=5120)
    ap.add_argument("--stages", type=int, nargs="+", default=[4])
    ap.add_argument("--stores", action="store_true", help="the mhc_pre's order, its stores and load policy varied")
    ap.add_argument("--orders", nargs="+", default=None,
                    help="only the ORDERS whose names start with one of these (e.g. 'slices, 64 x 32')")
    a = ap.parse_args()
    sys.path.insert(0, ".")
    from benchmarks.common import measure_copy_bandwidth, time_interleaved, versions

    cases = []  # (name, order, rows, box, stages, write, store, policy)
    for st in a.stages:
        if a.stores:
            cases += [(f"{n}, {st} stages", "slices", 64, 32, st, *v) for n, v in STORES.items()]
        else:
            for name, (order, rows, box) in ORDERS.items():
                if a.orders and not any(name.startswith(o) for o in a.orders):
                    continue
                for write in (False, True):
                    cases.append((f"{name}, {st} stages, {'read + write x' if write else 'read'}", order, rows, box,
                                  st, write, "st", None))
    if not cases:
        ap.error(f"no order starts with any of {a.orders}: {list(ORDERS)}")
    m, d = a.m, a.d
    h = torch.randn(m, HC * d, device="cuda", dtype=torch.bfloat16)
    x = torch.empty(m, d, device="cuda", dtype=torch.bfloat16)
    ref = h.float().sum().item()
    hs = h.view(m, HC, d).float()
    x_ref = ((hs[:, 0] + hs[:, 1]) + (hs[:, 2] + hs[:, 3])).bfloat16()
    hs = None
    fns, nbytes = {}, {}
    for name, order, rows, box, st, write, store, policy in cases:
        if st * HC * rows * box * 2 > 200 * 1024:  # the stages' shared memory
            continue
        k = compile_read(order, m, d, rows, box, st, write, store, policy)
        out = torch.zeros(GROUPS * SLICES * rows, device="cuda", dtype=torch.float32)
        x.zero_()
        k(h, x, out)
        got = out.double().sum().item()
        assert abs(got - ref) <= 1e-4 * h.numel() ** 0.5 + 1e-5 * abs(ref), (name, got, ref)
        assert not write or torch.equal(x, x_ref), name
        fns[name] = lambda k=k, out=out: k(h, x, out)
        nbytes[name] = (h.numel() + (x.numel() if write else 0)) * 2
    fns["torch h.sum() (read)"] = lambda: h.sum()
    nbytes["torch h.sum() (read)"] = h.numel() * 2
    times = time_interleaved(fns)
    bw = measure_copy_bandwidth()
    print(versions())
    print(f"copy bandwidth (read + write): {bw / 1e9:.0f} GB/s; h {h.numel() * 2 / 1e9:.2f} GB, "
          f"x {x.numel() * 2 / 1e9:.2f} GB, M = {m}")
    print("| order | ms (median) | GB/s | of the copy bandwidth | its bytes at the copy bandwidth, ms |")
    print("|---|---|---|---|---|")
    for name, (ms, _) in times.items():
        gbs = nbytes[name] / (ms * 1e-3) / 1e9
        print(f"| {name} | {ms:.4f} | {gbs:.0f} | {gbs * 1e9 / bw:.0%} | {nbytes[name] / bw * 1e3:.4f} |")


if __name__ == "__main__":
    main()
