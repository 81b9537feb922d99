"""RoPE/store patterns: Q RoPE into the head-padded Q buffer, KV norm + RoPE + FP8 + cache store.

``q_rope_store``: ``q = wq_b_out.view(M, H, D)``; ``q[..., -rd:] = rope(q[..., -rd:])``;
``q_buf[:M, :H] = q``. After functionalization the in-place RoPE is a ``copy`` +
``slice_scatter`` of a second view of the projection output, and the store is
``copy`` + two ``slice_scatter`` into the buffer (plus a trailing ``copy_`` into the
graph input, outside the pattern). The search functions spell exactly that.

``kv_rope_store``: ``kv = rms_norm(wkv_out)``; ``kv[..., -rd:] = rope(...)``;
``kv = fp8_block_qdq(kv, block)``; store by slot (``index_copy_`` / ``index_put_`` give
``index_put``; ``cache[start:start + M] = kv`` gives ``slice_scatter``). The quantized kv
is also read by attention, so the KV patterns have two outputs (kv, new cache).

Spellings: RoPE as DeepSeek's complex product or the real cos/sin form; KV norm as the
reference ``rms_norm`` or ``F.rms_norm``. Literals the replacement needs are captured
with sentinels: the number of heads, the rope slice start (``-rd``, or ``D - rd``),
eps, the FP8 block, the slice-store bounds.

Both replacements emit the mutating op through ``auto_functionalized`` (v1) so that
Inductor's re-inplacing writes the real buffer once. Inductor re-inplaces a graph input
only when nothing reads its old value after the op; where the graph does (the reference
model gathers old cache rows after the store), :func:`order_stores` splits the KV site
into the fused computation and a late in-place store.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .. import lowering  # noqa: F401  (registers torch.ops.dsv41.*)
from ..reference.model import rms_norm
from ..reference.quant import fp8_block_qdq
from ..reference.rope import apply_rotary_complex, apply_rotary_real
from .base import M_EX, FusionPattern, Spelling, current_context, rms_normalized_functional
from .checks import first_failure, same, want_dtype

aten = torch.ops.aten
BF16, F32, C64 = torch.bfloat16, torch.float32, torch.complex64
SLICE_END = 2**63 - 1  # what `x[a:]` traces to

# example geometry (no dim equals M_EX = 7) and sentinels (values found nowhere else in the traces)
H_EX, D_EX, RD_EX, HPAD_EX, ROWS_EX = 5, 48, 12, 8, 24
KV_D_EX, BLOCK_EX, SLOTS_EX = 96, 24, 40
ROPE_START = -RD_EX
EPS_SENTINEL = 2.0**-17  # fp32-exact: F.rms_norm rounds eps to fp32 before it reaches the graph
START_SENTINEL = 1001
END_SENTINEL = START_SENTINEL + M_EX


# RoPE spellings: (x, *tables) -> rotated x, as the model code writes them
ROPES: dict[str, tuple[Callable[..., Any], tuple[str, ...]]] = {
    "complex": (apply_rotary_complex, ("freqs",)),
    "real": (apply_rotary_real, ("cos", "sin")),
}


def _tables(v: dict[str, Any]) -> tuple[Any, Any]:
    """(cos, sin) fp32 ``[M, rd/2]``: strided views of ``view_as_real(freqs)`` for the complex form."""
    if v.get("freqs") is not None:
        fr = torch.view_as_real(v["freqs"])
        return fr[..., 0], fr[..., 1]
    return v["cos"], v["sin"]


def _check_tables(v: dict[str, Any], m: Any, rd: int) -> str | None:
    if v.get("freqs") is not None:
        names = [("freqs", v["freqs"], C64)]
    else:
        names = [("cos", v["cos"], F32), ("sin", v["sin"], F32)]
    for name, t, dtype in names:
        why = want_dtype(name, t, dtype)
        if why:
            return why
        if t.dim() != 2 or not same(t.shape[0], m) or not same(t.shape[1], rd // 2):
            return f"{name} {tuple(t.shape)} is not [M, rope_dim/2] = [M, {rd // 2}]"
    return None


def _rope_dims(rope_start: int, d: Any) -> tuple[int | None, str | None]:
    """rd from the rope slice start (``-rd`` or ``D - rd``), or why it is not a valid tail."""
    if not isinstance(rope_start, int) or not isinstance(d, int):
        return None, f"rope slice start {rope_start!r} / head_dim {d!r} are not static ints"
    rd = -rope_start if rope_start < 0 else d - rope_start
    if rd <= 0 or rd > d or rd % 2:
        return None, f"rope dims {rd} (slice start {rope_start}) must be even and in (0, head_dim={d}]"
    return rd, None


def _int_ok(x: Any) -> bool:
    return isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool)


# ---------------------------------------------------------------------------
# Q: RoPE + store into the head-padded buffer
# ---------------------------------------------------------------------------
def _q_spelling(rope: str) -> Callable[..., Any]:
    fn, tables = ROPES[rope]

    def body(x, buf, heads, rope_start, *tabs):
        m, d = x.shape[0], x.shape[1] // heads
        q_w = x.view(m, heads, d)  # functionalization regenerates the view: one is scattered into,
        q_r = x.view(m, heads, d)  # the other read (and sliced twice: rope input and copy target)
        roped = fn(q_r[..., rope_start:], *tabs)
        q = aten.slice_scatter(q_w, aten.copy(q_r[..., rope_start:], roped), 2, rope_start, SLICE_END)
        rows = aten.slice_scatter(buf[:m], aten.copy(buf[:m, :heads], q), 1, 0, heads)
        return aten.slice_scatter(buf, rows, 0, 0, m)

    if tables == ("freqs",):

        def search(x, freqs, buf, heads, rope_start):
            return body(x, buf, heads, rope_start, freqs)

    else:

        def search(x, cos, sin, buf, heads, rope_start):
            return body(x, buf, heads, rope_start, cos, sin)

    return search


def _q_inputs(rope: str) -> Callable[[], list[Any]]:
    def make():
        tabs = [torch.empty(M_EX, RD_EX // 2, dtype=C64)] if rope == "complex" else [
            torch.empty(M_EX, RD_EX // 2, dtype=F32), torch.empty(M_EX, RD_EX // 2, dtype=F32)]
        x, buf = torch.empty(M_EX, H_EX * D_EX, dtype=BF16), torch.empty(ROWS_EX, HPAD_EX, D_EX, dtype=BF16)
        return [x, *tabs, buf, *Q_SCALARS.values()]

    return make


Q_SPELLINGS = {rope: _q_spelling(rope) for rope in ROPES}
Q_SCALARS = dict(heads=H_EX, rope_start=ROPE_START)


def _q_check(v: dict[str, Any]) -> str | None:
    x, buf, heads = v["x"], v["buf"], v["heads"]
    why = first_failure(want_dtype("q", x, BF16), want_dtype("q_buf", buf, BF16))
    if why:
        return why
    if x.dim() != 2 or buf.dim() != 3:
        return f"ranks: q projection {tuple(x.shape)} must be [M, H*D], buffer {tuple(buf.shape)} [T, Hpad, D]"
    d = buf.shape[2]
    if not isinstance(heads, int) or heads < 1 or not same(x.shape[1], heads * d):
        return f"q width {x.shape[1]} is not heads ({heads}) x buffer head_dim ({d})"
    if not statically_known_true(heads <= buf.shape[1]):
        return f"{heads} heads do not fit the buffer's {buf.shape[1]} padded heads"
    rd, why = _rope_dims(v["rope_start"], d)
    return why or _check_tables(v, x.shape[0], rd)


def _q_replace(x, buf, heads, rope_start, freqs=None, cos=None, sin=None):
    ctx = current_context()
    cos, sin = _tables(dict(freqs=freqs, cos=cos, sin=sin))
    q = x.view(x.shape[0], heads, buf.shape[2])
    out = auto_functionalized(
        torch.ops.dsv41.q_rope_store.default, q_buf=buf, q=q, cos=cos, sin=sin,
        providers=ctx.providers, op_mode=ctx.mode,
    )
    return out[1]


def _q_provider_args(v: dict[str, Any]) -> tuple[Any, ...]:
    x, buf = v["x"], v["buf"]
    cos, sin = _tables(v)
    return buf, x.view(x.shape[0], v["heads"], buf.shape[2]), cos, sin


# ---------------------------------------------------------------------------
# KV: RMSNorm + RoPE + FP8 round trip + store by slot
# ---------------------------------------------------------------------------
def _norm_functional(kv, weight, eps):
    """``F.rms_norm(kv.float(), (D,), weight, eps).to(kv.dtype)`` as it reaches post-grad graphs."""
    return (rms_normalized_functional(kv.float(), eps) * weight).to(kv.dtype)


NORMS = {"rms_norm": rms_norm, "F.rms_norm": _norm_functional}
STORES = ("index_put", "slice")


def _kv_spelling(norm: str, rope: str, store: str) -> Callable[..., Any]:
    norm_fn = NORMS[norm]
    rope_fn, tables = ROPES[rope]

    def body(kv, weight, cache, eps, rope_start, block, tabs, where):
        y = norm_fn(kv, weight, eps)
        roped = rope_fn(y[..., rope_start:], *tabs)
        y = aten.slice_scatter(y, aten.copy(y[..., rope_start:], roped), 1, rope_start, SLICE_END)
        q = fp8_block_qdq(y, block)
        if store == "index_put":
            return q, aten.index_put(cache, [where[0]], q)
        return q, aten.slice_scatter(cache, q, 0, where[0], where[1])

    # explicit signatures: the pattern's argument names are the parameters' names
    if tables == ("freqs",) and store == "index_put":

        def search(kv, weight, freqs, cache, slots, eps, rope_start, block):
            return body(kv, weight, cache, eps, rope_start, block, (freqs,), (slots,))

    elif tables == ("freqs",):

        def search(kv, weight, freqs, cache, eps, rope_start, block, start, end):
            return body(kv, weight, cache, eps, rope_start, block, (freqs,), (start, end))

    elif store == "index_put":

        def search(kv, weight, cos, sin, cache, slots, eps, rope_start, block):
            return body(kv, weight, cache, eps, rope_start, block, (cos, sin), (slots,))

    else:

        def search(kv, weight, cos, sin, cache, eps, rope_start, block, start, end):
            return body(kv, weight, cache, eps, rope_start, block, (cos, sin), (start, end))

    return search


def _kv_inputs(rope: str, store: str) -> Callable[[], list[Any]]:
    def make():
        tabs = [torch.empty(M_EX, RD_EX // 2, dtype=C64)] if rope == "complex" else [
            torch.empty(M_EX, RD_EX // 2, dtype=F32), torch.empty(M_EX, RD_EX // 2, dtype=F32)]
        slots = [torch.empty(M_EX, dtype=torch.int64)] if store == "index_put" else []
        return [torch.empty(M_EX, KV_D_EX, dtype=BF16), torch.empty(KV_D_EX, dtype=F32), *tabs,
                torch.empty(SLOTS_EX, KV_D_EX, dtype=BF16), *slots, *_kv_scalars(store).values()]

    return make


def _kv_scalars(store: str) -> dict[str, float | int]:
    s: dict[str, float | int] = dict(eps=EPS_SENTINEL, rope_start=ROPE_START, block=BLOCK_EX)
    if store == "slice":
        s.update(start=START_SENTINEL, end=END_SENTINEL)
    return s


KV_SPELLINGS = {
    f"{norm}.{rope}.{store}": (_kv_spelling(norm, rope, store), rope, store)
    for norm in NORMS
    for rope in ROPES
    for store in STORES
}


def _kv_check(v: dict[str, Any]) -> str | None:
    kv, weight, cache, eps, block = v["kv"], v["weight"], v["cache"], v["eps"], v["block"]
    why = first_failure(
        want_dtype("kv", kv, BF16), want_dtype("norm weight", weight, F32), want_dtype("cache", cache, BF16)
    )
    if why:
        return why
    if kv.dim() != 2 or cache.dim() != 2 or weight.dim() != 1:
        return (f"ranks: kv {tuple(kv.shape)} [M, D], cache {tuple(cache.shape)} [S, D], "
                f"weight {tuple(weight.shape)} [D]")
    m, d = kv.shape
    if not isinstance(d, int):
        return f"head_dim {d} is not static"
    if not same(cache.shape[1], d) or not same(weight.shape[0], d):
        return f"head_dim differs: kv {d}, cache {cache.shape[1]}, weight {weight.shape[0]}"
    if not isinstance(eps, float) or not math.isfinite(eps) or eps <= 0:
        return f"eps {eps!r} must be finite and > 0"
    if not isinstance(block, int) or block < 1 or d % block:
        return f"FP8 block {block!r} must divide head_dim {d}"
    rd, why = _rope_dims(v["rope_start"], d)
    if why:
        return why
    why = _check_tables(v, m, rd)
    if why:
        return why
    if "slots" in v:
        slots = v["slots"]
        why = want_dtype("slots", slots, torch.int64)
        # a slot count not provably M (e.g. slots passed as their own graph input) is checked
        # by the op at run time: a mismatch raises there instead of broadcasting
        if why or slots.dim() != 1 or statically_known_true(slots.shape[0] != m):
            return why or f"slots {tuple(slots.shape)} is not [M]"
        return None
    start, end = v["start"], v["end"]
    if not (_int_ok(start) and _int_ok(end)) or not same(end - start, m):
        return f"slice store [{start}:{end}] does not cover exactly the M = {m} new rows"
    if not statically_known_true(start >= 0):
        return f"slice store start {start} may be negative"
    return None


def _kv_slots(kv, slots=None, start=None, end=None):
    if slots is not None:
        return slots
    return torch.arange(kv.shape[0], device=kv.device) + start


def _kv_replace(kv, weight, cache, eps, rope_start, block, freqs=None, cos=None, sin=None, slots=None, start=None,
                end=None):
    ctx = current_context()
    cos, sin = _tables(dict(freqs=freqs, cos=cos, sin=sin))
    out = auto_functionalized(
        torch.ops.dsv41.kv_rope_quant_store.default, cache=cache, kv=kv, weight=weight, eps=eps, cos=cos, sin=sin,
        slots=_kv_slots(kv, slots, start, end), block=block, providers=ctx.providers, op_mode=ctx.mode,
    )
    return out[0], out[1]


def _kv_provider_args(v: dict[str, Any]) -> tuple[Any, ...]:
    kv = v["kv"]
    cos, sin = _tables(v)
    slots = v["slots"] if "slots" in v else kv.new_empty((kv.shape[0],), dtype=torch.int64)
    return v["cache"], kv, v["weight"], v["eps"], cos, sin, slots, v["block"]


# ---------------------------------------------------------------------------
# ordering: a cache whose old value is read after the store
# ---------------------------------------------------------------------------
KV_STORE = torch.ops.dsv41.kv_rope_quant_store.default
KV_QUANT = torch.ops.dsv41.kv_rope_quant.default


def _readers(buf: fx.Node) -> list[fx.Node]:
    """Nodes reading ``buf`` directly or through views (the views themselves excluded)."""
    out, stack = [], [buf]
    while stack:
        for user in stack.pop().users:
            if isinstance(user.target, torch._ops.OpOverload) and user.target.is_view:
                stack.append(user)
            else:
                out.append(user)
    return out


def _provenance(node: fx.Node) -> dict[str, Any]:
    return {k: node.meta[k] for k in ("stack_trace", "nn_module_stack", "source_fn_stack") if k in node.meta}


def order_stores(graph: fx.Graph) -> int:
    """Split a KV site whose cache is read (old value) after the fused store; returns the count.

    Inductor writes a mutated graph input in place only when nothing reads it after the
    mutation in graph order (the epilogue ``copy_`` aside); otherwise it copies the whole
    cache. The reference model gathers old cache rows for attention after its
    ``index_copy_``. Moving those reads ahead of the fused op is not enough: Inductor may
    realize a lazily lowered read only when it lowers the mutation, i.e. after it. So such
    a site becomes ``out = kv_rope_quant(...)`` at the op's place (same kernel, no store)
    plus ``index_put(cache, [slots], out)`` right after the last old-value read, which
    Inductor re-inplaces (reads still pending then are realized before its scatter).
    """
    split = 0
    for af in [n for n in graph.nodes if n.target is auto_functionalized and n.args and n.args[0] is KV_STORE]:
        cache, kw = af.kwargs["cache"], af.kwargs
        if not isinstance(cache, fx.Node) or cache.op != "placeholder":
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        epilogue = {u for u in cache.users if u.target is aten.copy_.default and u.args[0] is cache}
        old_reads = [r for r in _readers(cache) if r is not af and r not in epilogue and order[r] > order[af]]
        if not old_reads:
            continue  # Inductor re-inplaces the fused op as it is
        results = {u.args[1]: u for u in af.users if u.target is operator.getitem}
        last_read = max(old_reads, key=order.__getitem__)
        new_cache = results.get(1)
        if new_cache is not None and any(
            order[u] <= order[last_read] for u in new_cache.users if u not in epilogue
        ):
            continue  # the new value is read before the last old-value read: no single place for the store
        out_val, cache_val = af.meta["val"][0], af.meta["val"][1]
        with graph.inserting_before(af):
            out = graph.call_function(
                KV_QUANT, (kw["kv"], kw["weight"], kw["eps"], kw["cos"], kw["sin"], kw["block"], kw["providers"],
                           kw["op_mode"]),
            )
        out.meta.update(_provenance(af), val=out_val)
        with graph.inserting_after(last_read):
            store = graph.call_function(aten.index_put.default, (cache, [kw["slots"]], out))
        store.meta.update(_provenance(af), val=cache_val)
        for idx, node in results.items():
            node.replace_all_uses_with(out if idx == 0 else store)
            graph.erase_node(node)
        graph.erase_node(af)
        split += 1
    return split


def patterns() -> list[FusionPattern]:
    return [
        FusionPattern(
            kind="q_rope_store",
            family="rope_store",
            op="q_rope_store",
            spellings=[
                Spelling(rope, fn, _q_inputs(rope), scalars=dict(Q_SCALARS))
                for rope, fn in Q_SPELLINGS.items()
            ],
            replace=_q_replace,
            check=_q_check,
            provider_args=_q_provider_args,
        ),
        FusionPattern(
            kind="kv_rope_store",
            family="rope_store",
            op="kv_rope_quant_store",
            spellings=[
                Spelling(name, fn, _kv_inputs(rope, store), scalars=_kv_scalars(store))
                for name, (fn, rope, store) in KV_SPELLINGS.items()
            ],
            replace=_kv_replace,
            check=_kv_check,
            provider_args=_kv_provider_args,
        ),
    ]
