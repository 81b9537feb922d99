"""mHC stats: projection + RMS + split/sigmoid + softmax + Sinkhorn, matched by our own walker.

The unrolled Sinkhorn chain (2 * iters - 1 normalisations of a 4x4 matrix per
token) gives Inductor's generic matcher many near matches to backtrack over (a
failing probe spun for minutes). Instead we anchor on the distinctive node, the
``mm`` of the flattened fp32 residual with an fp32 weight of ``(2+n)*n`` rows,
and walk the rest with a bounded, linear walk:

    xf = h.reshape(M, n*d).float()                  (or .float() then reshape)
    r  = rsqrt(mean(xf^2, -1) + norm_eps)           (pow or x*x; mean or sum/K)
    mix = mm(xf, fn^T) * r                          (or mm(xf * r, fn^T))
    pre  = sigmoid(mix[:, :n]   * scale[0] + base[:n])   + hc_eps
    post = sigmoid(mix[:, n:2n] * scale[1] + base[n:2n]) * 2
    c    = softmax((mix[:, 2n:] * scale[2] + base[2n:]).view(M, n, n), -1) + hc_eps
           (softmax decomposed with or without the max, _softmax, or Inductor's GPU
           ``prepare_softmax_online`` form)
    c    = c / (c.sum(-2) + hc_eps), then (iters - 1) x [row step, column step]

Every literal is checked (dims, eps equal to hc_eps everywhere, the 2 of post,
slice bounds, the chain ending on a column step, the iteration count equal to
``PassConfig.hc_sinkhorn_iters``). Anything else is reported as a skipped site
with the reason and keeps its subgraph.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from .base import PassContext, Site
from .checks import same

aten, prims = torch.ops.aten, torch.ops.prims
INT_MAX = 9223372036854775807
MAX_CHAIN = 512  # normalisation steps; bounds the walk (20 iterations = 39 steps)


class NoMatch(Exception):
    """Not an mHC stats subgraph (the reason goes to the report once the anchor looked like one)."""


def _is(n: Any, *targets: Any) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else n


def _need(cond: bool, why: str) -> None:
    if not cond:
        raise NoMatch(why)


def _scalar(n: fx.Node, node_other: fx.Node) -> Any:
    """The scalar operand of a binary op whose other operand is ``node_other`` (an ``alpha`` or any other keyword
    argument would change what the operand means: no match)."""
    _need(not n.kwargs, f"{n.target} has keyword arguments {dict(n.kwargs)}")
    a, b = n.args[0], n.args[1]
    return b if a is node_other else a


def _float32_reduction(n: fx.Node, what: str) -> None:
    """A reduction's keyword argument is its ``dtype``: another than the chain's float32 would run in (and return)
    another precision."""
    _need(not n.kwargs or dict(n.kwargs) == {"dtype": torch.float32},
          f"{what} ({n.name}) has keyword arguments {dict(n.kwargs)}")


def _binary(n: Any, targets: tuple, operand: fx.Node) -> bool:
    return _is(n, *targets) and operand in n.args[:2]


def _dim_ok(dims: Any, want: int, rank: int) -> bool:
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    return len(dims) == 1 and dims[0] % rank == want % rank


class _Walk:
    """One candidate: the nodes it covers, the values it binds."""

    def __init__(self, mm: fx.Node):
        self.mm = mm
        self.nodes: set[fx.Node] = {mm}
        self.bind: dict[str, Any] = {}

    def add(self, *ns: fx.Node) -> None:
        self.nodes.update(ns)

    def one_user(self, n: fx.Node, what: str) -> fx.Node:
        us = list(n.users)
        _need(len(us) == 1, f"{what} ({n.name}) has {len(us)} users, expected 1")
        return us[0]


def _flat_residual(w: _Walk, x: fx.Node, n: int, k: int) -> fx.Node:
    """xf = h.reshape(M, K).float() or h.float().reshape(M, K); returns xf, binds h."""
    _need(
        _is(x, prims.convert_element_type.default, aten.reshape.default),
        "projection input is not the flattened residual",
    )
    if x.target == prims.convert_element_type.default:
        _need(x.args[1] == torch.float32, "projection input is not upcast to float32")
        r = x.args[0]
        _need(_is(r, aten.reshape.default), "projection input is not the flattened residual")
        h = r.args[0]
        w.add(x, r)
    else:
        c = x.args[0]
        _need(_is(c, prims.convert_element_type.default) and c.args[1] == torch.float32,
              "projection input is not upcast to float32")
        h = c.args[0]
        w.add(x, c)
    hv = _val(h)
    _need(isinstance(hv, torch.Tensor) and hv.dim() == 3, "residual is not [M, n, d]")
    _need(
        same(hv.shape[1], n) and same(hv.shape[1] * hv.shape[2], k),
        f"residual {tuple(hv.shape)} does not flatten to K={k} with n={n}",
    )
    _need(hv.dtype == torch.bfloat16, f"residual dtype {hv.dtype}, expected bfloat16")
    w.bind["h"] = h
    return x


def _rstd(w: _Walk, r: fx.Node, xf: fx.Node, k: Any) -> None:
    """r = rsqrt(mean(xf^2, -1, keepdim) + eps)."""
    _need(_is(r, aten.rsqrt.default), "RMS scale is not an rsqrt")
    a = r.args[0]
    _need(_is(a, aten.add.Tensor, aten.add.Scalar), "rsqrt argument is not mean + eps")
    ms = next((x for x in a.args[:2] if isinstance(x, fx.Node)), None)
    eps = _scalar(a, ms)
    _need(isinstance(eps, float) and eps > 0, f"RMS eps {eps!r} is not a positive float")
    if _is(ms, aten.mean.dim):
        _need(_dim_ok(ms.args[1], -1, 2) and (len(ms.args) > 2 and ms.args[2]), "RMS mean is not over the last dim")
        _float32_reduction(ms, "RMS mean")
        sq = ms.args[0]
        w.add(ms)
    else:
        _need(_is(ms, aten.div.Tensor), "RMS statistic is not a mean")
        s = ms.args[0]
        _need(
            _is(s, aten.sum.dim_IntList) and _dim_ok(s.args[1], -1, 2) and len(s.args) > 2 and s.args[2],
            "RMS statistic is not a sum over the last dim (keepdim)",
        )
        _need(isinstance(ms.args[1], (int, float)) and same(ms.args[1], k), "RMS sum is not divided by K")
        _float32_reduction(s, "RMS sum")
        sq = s.args[0]
        w.add(ms, s)
    if _is(sq, aten.pow.Tensor_Scalar):
        _need(sq.args[0] is xf and sq.args[1] == 2, "RMS square is not xf ** 2")
    else:
        _need(_is(sq, aten.mul.Tensor) and sq.args[0] is xf and sq.args[1] is xf, "RMS square is not xf * xf")
    w.add(r, a, sq)
    w.bind["norm_eps"] = float(eps)


def _affine(w: _Walk, sl: fx.Node, idx: int, lo: int, hi: Any) -> fx.Node:
    """slice * scale[idx] + base[lo:hi] -> the add node; binds scale and base. Only the comb's bias (idx 2, to the
    end of base) may be open-ended: base[n:] is not base[n:2n] (at n = 1 it broadcasts to two columns)."""
    m = w.one_user(sl, "mix slice")
    _need(_is(m, aten.mul.Tensor), f"mix slice {idx} is not scaled")
    sel = _scalar(m, sl)
    _need(
        _is(sel, aten.select.int) and sel.args[1] == 0 and sel.args[2] == idx,
        f"mix slice {idx} is not scaled by scale[{idx}]",
    )
    a = w.one_user(m, "scaled mix")
    _need(_is(a, aten.add.Tensor), f"mix slice {idx} has no bias")
    b = _scalar(a, m)
    _need(_is(b, aten.slice.Tensor) and b.args[1] == 0 and b.args[2] == lo
          and (b.args[3] == hi or (idx == 2 and b.args[3] == INT_MAX)) and (len(b.args) < 5 or b.args[4] == 1),
          f"bias of slice {idx} is not base[{lo}:{hi}]")
    for key, node in (("scale", sel.args[0]), ("base", b.args[0])):
        prev = w.bind.setdefault(key, node)
        _need(prev is node, f"the three mix slices use different {key} tensors")
    w.add(m, a, sel, b)
    return a


def _online_softmax(w: _Walk, logits: fx.Node, us: list[fx.Node]) -> fx.Node:
    """Inductor's GPU form: (max, sum) = prepare_softmax_online(x, -1); exp(x - max) / sum."""
    prep = next(u for u in us if _is(u, prims.prepare_softmax_online.default))
    sub = next((u for u in us if _is(u, aten.sub.Tensor)), None)
    _need(_dim_ok(prep.args[1], -1, 3), "online softmax is not over the last dim")
    gets = {g.args[1]: g for g in prep.users if g.target is operator.getitem}
    _need(len(prep.users) == 2 and set(gets) == {0, 1}, "online softmax outputs not recognised")
    _need(sub is not None and sub.args == (logits, gets[0]), "online softmax max-subtraction not recognised")
    e = w.one_user(sub, "softmax shift")
    _need(_is(e, aten.exp.default), "softmax exp not found")
    d = w.one_user(e, "softmax exp")
    _need(_is(d, aten.div.Tensor) and d.args == (e, gets[1]) and len(gets[1].users) == 1,
          "online softmax normalisation not recognised")
    w.add(prep, gets[0], gets[1], sub, e, d)
    return d


def _softmax(w: _Walk, logits: fx.Node) -> fx.Node:
    """softmax over the last dim: _softmax, max-subtracted exp/sum, plain exp/sum, or Inductor's online form."""
    us = list(logits.users)
    if len(us) == 1 and _is(us[0], aten._softmax.default):
        sm = us[0]
        _need(_dim_ok(sm.args[1], -1, 3) and not sm.args[2], "softmax is not over the last dim")
        w.add(sm)
        return sm
    if hasattr(prims, "prepare_softmax_online") and any(_is(u, prims.prepare_softmax_online.default) for u in us):
        return _online_softmax(w, logits, us)
    if len(us) == 2:
        amax = next((u for u in us if _is(u, aten.amax.default)), None)
        sub = next((u for u in us if _is(u, aten.sub.Tensor)), None)
        _need(
            amax is not None and sub is not None and sub.args == (logits, amax),
            "softmax max-subtraction not recognised",
        )
        _need(_dim_ok(amax.args[1], -1, 3) and len(amax.args) > 2 and amax.args[2],
              "softmax max is not over the last dim (keepdim)")
        e = w.one_user(sub, "softmax shift")
        w.add(amax, sub)
    else:
        e = w.one_user(logits, "comb logits")
    _need(_is(e, aten.exp.default), "softmax exp not found")
    s = next((u for u in e.users if _is(u, aten.sum.dim_IntList)), None)
    d = next((u for u in e.users if _is(u, aten.div.Tensor)), None)
    _need(
        len(e.users) == 2 and s is not None and d is not None and d.args == (e, s),
        "softmax normalisation not recognised",
    )
    _need(_dim_ok(s.args[1], -1, 3) and len(s.args) > 2 and s.args[2], "softmax sum is not over the last dim")
    _float32_reduction(s, "softmax sum")
    w.add(e, s, d)
    return d


def _step(w: _Walk, c: fx.Node, eps: float) -> tuple[fx.Node, int] | None:
    """One Sinkhorn normalisation c / (c.sum(dim) + eps): (next c, dim) or None when c has no such users."""
    us = list(c.users)
    if len(us) != 2:
        return None
    s = next((u for u in us if _is(u, aten.sum.dim_IntList)), None)
    d = next((u for u in us if _is(u, aten.div.Tensor)), None)
    if s is None or d is None or d.args[0] is not c or len(s.users) != 1:
        return None
    a = next(iter(s.users))
    if not (_is(a, aten.add.Tensor, aten.add.Scalar) and s in a.args[:2] and d.args[1] is a and len(a.users) == 1):
        return None
    dims = s.args[1]
    _need(len(s.args) > 2 and s.args[2], "Sinkhorn sum drops the reduced dim")
    _float32_reduction(s, "Sinkhorn sum")
    _need(
        isinstance(dims, (list, tuple)) and len(dims) == 1 and dims[0] % 3 in (1, 2), f"Sinkhorn sum over dims {dims}"
    )
    e = _scalar(a, s)
    _need(e == eps, f"Sinkhorn eps {e!r} differs from hc_eps {eps!r}")
    w.add(s, a, d)
    return d, dims[0] % 3


def match(mm: fx.Node, expect_iters: int) -> tuple[_Walk, fx.Node, fx.Node, fx.Node] | None:
    """Walk from ``mm``; returns (walk, pre, post, comb) or None if this mm is not an mHC projection.

    Raises NoMatch with the reason when it is one but something differs.
    """
    x, wt = mm.args
    if not (_is(wt, aten.permute.default) and list(wt.args[1]) == [1, 0]):
        return None
    fn = wt.args[0]
    fv = _val(fn)
    if not (isinstance(fv, torch.Tensor) and fv.dtype == torch.float32 and fv.dim() == 2):
        return None
    nmix, k = fv.shape
    n = next((c for c in range(1, 9) if (2 + c) * c == nmix), None)
    if n is None or not isinstance(k, int) or k % n:
        return None
    w = _Walk(mm)
    w.add(wt)
    w.bind.update(fn=fn, n=n)
    # projection input and the RMS fold: mix = mm(xf, fn^T) * r, or mm(xf * r, fn^T)
    if _is(x, aten.mul.Tensor) and any(_is(a, aten.rsqrt.default) for a in x.args[:2]):
        r = next(a for a in x.args[:2] if _is(a, aten.rsqrt.default))
        xf = _flat_residual(w, _scalar(x, r), n, k)
        _rstd(w, r, xf, k)
        w.add(x)
        mix = mm
    else:
        try:
            xf = _flat_residual(w, x, n, k)
        except NoMatch:
            return None  # an fp32 GEMM of the right shape on something else
        m = w.one_user(mm, "projection")
        _need(_is(m, aten.mul.Tensor), "projection is not scaled by the RMS")
        r = _scalar(m, mm)
        _rstd(w, r, xf, k)
        w.add(m)
        mix = m
    # the three slices
    sl = list(mix.users)
    _need(len(sl) == 3 and all(_is(s, aten.slice.Tensor) and s.args[1] % 2 == 1 and (len(s.args) < 5 or s.args[4] == 1)
                               for s in sl),
          "mixes are not split into three column slices")
    by_start = {s.args[2]: s for s in sl}
    _need(set(by_start) == {0, n, 2 * n}, f"mix slices start at {sorted(by_start)}, expected 0, {n}, {2 * n}")
    _need(by_start[0].args[3] == n and by_start[n].args[3] == 2 * n and by_start[2 * n].args[3] in (nmix, INT_MAX),
          "mix slice bounds differ from [0:n], [n:2n], [2n:]")
    w.add(*sl)
    # pre = sigmoid(.) + hc_eps
    a0 = _affine(w, by_start[0], 0, 0, n)
    sg = w.one_user(a0, "pre logits")
    _need(_is(sg, aten.sigmoid.default), "pre is not a sigmoid")
    pre = w.one_user(sg, "pre sigmoid")
    _need(_is(pre, aten.add.Tensor, aten.add.Scalar), "pre is not sigmoid + eps")
    hc_eps = _scalar(pre, sg)
    _need(isinstance(hc_eps, float) and hc_eps > 0, f"pre eps {hc_eps!r} is not a positive float")
    w.add(sg, pre)
    # post = 2 * sigmoid(.)
    a1 = _affine(w, by_start[n], 1, n, 2 * n)
    sg1 = w.one_user(a1, "post logits")
    _need(_is(sg1, aten.sigmoid.default), "post is not a sigmoid")
    post = w.one_user(sg1, "post sigmoid")
    _need(_is(post, aten.mul.Tensor) and _scalar(post, sg1) == 2, "post is not 2 * sigmoid")
    w.add(sg1, post)
    # comb logits -> softmax + eps -> Sinkhorn
    a2 = _affine(w, by_start[2 * n], 2, 2 * n, nmix)
    rs = w.one_user(a2, "comb logits")
    _need(_is(rs, aten.reshape.default) and list(rs.args[1])[1:] == [n, n], "comb logits are not viewed [M, n, n]")
    w.add(rs)
    sm = _softmax(w, rs)
    c = w.one_user(sm, "softmax")
    _need(_is(c, aten.add.Tensor, aten.add.Scalar) and _scalar(c, sm) == hc_eps,
          f"softmax + eps uses {_scalar(c, sm)!r}, pre uses hc_eps {hc_eps!r}")
    w.add(c)
    dims: list[int] = []
    for _ in range(MAX_CHAIN):
        nxt = _step(w, c, hc_eps)
        if nxt is None:
            break
        c, d = nxt
        dims.append(d)
    _need(dims and dims[0] == 1, "Sinkhorn does not start with a column normalisation")
    _need(all(dims[i] != dims[i + 1] for i in range(len(dims) - 1)), "Sinkhorn steps do not alternate")
    _need(dims[-1] == 1, "Sinkhorn does not end on a column normalisation")
    iters = (len(dims) + 1) // 2
    _need(iters == expect_iters,
          f"Sinkhorn chain has {iters} iterations; PassConfig.hc_sinkhorn_iters is {expect_iters}")
    for key, want in (("scale", (3,)), ("base", (nmix,))):
        v = _val(w.bind[key])
        _need(isinstance(v, torch.Tensor) and v.dtype == torch.float32 and tuple(v.shape) == want,
              f"{key} must be float32 {list(want)}")
    _need(_graph_input(fn), f"projection weight fn ({fn.name}) is computed in the graph: the kernels cache its "
          "bf16x3 parts per weight tensor, and a buffer Inductor reuses for another site's fn would get stale parts")
    w.bind.update(iters=iters, hc_eps=float(hc_eps))
    return w, pre, post, c


def _graph_input(n: fx.Node) -> bool:
    """A graph input or constant, directly or through views (a weight whose tensor only changes in place)."""
    while isinstance(n, fx.Node) and n.op == "call_function" and getattr(n.target, "is_view", False):
        n = n.args[0]
    return isinstance(n, fx.Node) and n.op in ("placeholder", "get_attr")


def _outside_users(w: _Walk, outputs: set[fx.Node]) -> str | None:
    for nd in w.nodes:
        if nd in outputs:
            continue
        for u in nd.users:
            if u not in w.nodes:
                return f"intermediate {nd.name} is used outside the stats subgraph (by {u.name})"
    return None


def rewrite(graph: fx.Graph, ctx: PassContext) -> int:
    """Replace every verified stats subgraph by ``dsv41.mhc_stats``; returns the number replaced."""
    from ..lowering import choose

    count = 0
    order = {nd: i for i, nd in enumerate(graph.nodes)}
    for mm in list(graph.find_nodes(op="call_function", target=aten.mm.default)):
        if getattr(mm, "_erased", False):
            continue
        try:
            found = match(mm, ctx.expect.get("hc_sinkhorn_iters", 20))
            if found is None:
                continue
            w, pre, post, comb = found
            why = _outside_users(w, {pre, post, comb})
            if why:
                raise NoMatch(why)
        except NoMatch as e:
            ctx.site(mm, "mhc_stats").reasons.append(str(e))
            continue
        except (IndexError, KeyError, TypeError, AttributeError) as e:  # a form the walker does not know: kept as is
            ctx.site(mm, "mhc_stats").reasons.append(f"the walker could not read this graph ({type(e).__name__}: {e})")
            continue
        b = w.bind
        site: Site = ctx.site(mm, "mhc_stats")
        inputs = [b["h"], b["fn"], b["scale"], b["base"]]
        args = (*inputs, b["iters"], b["hc_eps"], b["norm_eps"], ctx.providers, ctx.mode)
        vals = [_val(a) for a in inputs]
        fake_mode = detect_fake_mode(vals)
        with fake_mode:
            out_vals = torch.ops.dsv41.mhc_stats.default(*vals, *args[4:])
        last_input = max(inputs, key=lambda nd: order.get(nd, -1))
        with graph.inserting_after(last_input):
            node = graph.call_function(torch.ops.dsv41.mhc_stats.default, args)
        node.meta["val"] = out_vals
        for key in ("stack_trace", "nn_module_stack"):
            if key in mm.meta:
                node.meta[key] = mm.meta[key]
        with graph.inserting_after(node):
            gets = [graph.call_function(operator.getitem, (node, i)) for i in range(3)]
        for g, v, old in zip(gets, out_vals, (pre, post, comb)):
            g.meta["val"] = v
            old.replace_all_uses_with(g)
        for nd in sorted(w.nodes, key=lambda x: -order[x]):
            if not nd.users:
                graph.erase_node(nd)
        p, declined = choose("mhc_stats", ctx.providers, ctx.batch_invariant, *vals, *args[4:7])
        site.provider = p.name if p else None
        site.note = "; ".join(declined)
        site.rewritten = True
        site.op_node = node
        node.meta["dsv41_site"] = site
        count += 1
        order = {nd: i for i, nd in enumerate(graph.nodes)}
    return count
