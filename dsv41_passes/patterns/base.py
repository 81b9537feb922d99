"""Declarative fusion patterns on top of Inductor's pattern matcher.

A :class:`FusionPattern` is one site kind (``mhc_post``, ...) with one search
function per spelling, one replacement, example-input factories (run under a
fresh ``FakeTensorMode`` with an odd token count) and a domain check.

Inductor's coarse match treats every int, float, list, dtype and device literal
of a traced pattern as a wildcard. We hand Inductor that coarse pattern
pre-traced and verify each candidate ourselves against the spelling's traced
graph, node by node: op targets, and every literal except shape arguments
(reshape sizes, fills) and the example token count, with dims normalised by
rank (Inductor's own exact re-trace would reject near misses silently). Only then does the pattern's domain check
(dtypes, dims, contiguity, eps ranges) run. Whatever fails is reported as a
skipped site with the reason; the original subgraph stays.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, fwd_only, fx_to_pattern, register_replacement
from torch._subclasses.fake_tensor import FakeTensorMode

M_EX = 7  # example token count of every pattern trace; no other example dim may equal it

aten = torch.ops.aten
prims = torch.ops.prims

# ops whose int arguments are sizes (validated by domain checks, not literally)
SHAPE_OPS = {
    aten.reshape.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.expand.default,
    aten.full.default,
    aten.empty.memory_format,
    aten.new_empty.default,
    aten.new_zeros.default,
    aten.zeros.default,
    aten.repeat.default,
    prims.iota.default,
}
# (op, positional index of a dim argument, extra rank for ops that add a dim)
DIM_ARGS: dict[Any, tuple[int, int]] = {
    aten.sum.dim_IntList: (1, 0),
    aten.mean.dim: (1, 0),
    aten.amax.default: (1, 0),
    aten.amin.default: (1, 0),
    aten._softmax.default: (1, 0),
    aten.unsqueeze.default: (1, 1),
    aten.squeeze.dim: (1, 0),
    aten.select.int: (1, 0),
    aten.slice.Tensor: (1, 0),
    aten.slice_scatter.default: (2, 0),
    aten.select_scatter.default: (2, 0),
    aten.cat.default: (1, 0),
    aten.index_select.default: (1, 0),
}


def normalize(graph: fx.Graph) -> int:
    """Canonical forms shared by patterns and model graphs; returns the number of nodes changed.

    view -> reshape (Inductor does this before custom post-grad passes), and permute
    chains folded into one permute or removed when they compose to the identity
    (Inductor's joint-graph passes remove such pairs from the model graph, so the
    traced patterns must lose them too).
    """
    n = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target == aten.view.default:
            node.target = aten.reshape.default
            n += 1
        elif node.target == aten.permute.default:
            src, perm = node.args[0], list(node.args[1])
            if isinstance(src, fx.Node) and src.target == aten.permute.default and len(src.users) == 1:
                inner = list(src.args[1])
                perm = [inner[p] for p in perm]
                node.args = (src.args[0], perm)
                graph.erase_node(src)
                src = node.args[0]
                n += 1
            if perm == list(range(len(perm))):
                node.replace_all_uses_with(src)
                graph.erase_node(node)
                n += 1
    return n


def rms_normalized_functional(xf: torch.Tensor, eps: Any) -> torch.Tensor:
    """``F.rms_norm``'s normalised value ``xf * rstd`` as it reaches post-grad graphs (a spelling fragment for the
    families' search functions): its decomposition adds eps in place, ``add.Scalar`` once functionalized, which the
    plain trace of ``x + eps`` does not produce."""
    return xf * torch.rsqrt(aten.add.Scalar(xf.pow(2).mean(-1, keepdim=True), eps))


def trace(fn: Callable[..., Any], args: Any, **kwargs: Any) -> fx.GraphModule:
    """Inductor's ``fwd_only`` followed by :func:`normalize`, the forms post-grad graphs carry."""
    params = inspect.signature(fwd_only).parameters
    gm = fwd_only(fn, args, **{k: v for k, v in kwargs.items() if k in params})
    normalize(gm.graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


@dataclass
class Spelling:
    name: str
    search: Callable[..., Any]
    example_inputs: Callable[[], list[Any]]  # called inside a FakeTensorMode
    scalars: dict[str, float | int] = field(default_factory=dict)  # matched-literal arguments (sentinels)
    # None: traced at M_EX, matches any token count. An int: traced at that M and only tried on graphs
    # whose first input has exactly that many rows (the decode graph at M = 1, whose decompositions
    # place size-1 dims differently, e.g. einsum's permutes).
    tokens: int | None = None
    # None, or a check at match time: None when this spelling may apply to the graph being compiled, else why not
    # (a spelling of what Inductor makes of the code under some setting only)
    applies: Callable[[], str | None] | None = None


@dataclass
class FusionPattern:
    kind: str  # site kind in the report
    family: str  # PassConfig switch: mhc / rope_store / wo_a
    op: str  # fused op the replacement calls (for the report)
    spellings: list[Spelling]
    replace: Callable[..., Any]  # keyword arguments: the search functions' parameter names
    check: Callable[[dict[str, Any]], str | None]  # bound values -> None, or why this site is skipped
    provider_args: Callable[[dict[str, Any]], tuple[Any, ...]] | None = None


# ------------------------------------------------------------ pass context
@dataclass
class Site:
    kind: str
    anchor: fx.Node
    location: str
    layer: int | None
    source: str
    provider: str | None = None
    reasons: list[str] = field(default_factory=list)
    rewritten: bool = False
    note: str = ""
    fused_into: str = ""  # set when a later stage merged this site's op into a bigger one
    consumers: list[fx.Node] = field(default_factory=list)  # users of the anchor when it was accepted
    op_node: fx.Node | None = None  # the fused op call that replaced the site


@dataclass
class PassContext:
    providers: str
    batch_invariant: bool
    follows_global: bool = False
    static_weights: bool = False
    expect: dict[str, Any] = field(default_factory=dict)  # model constants the matchers require
    sites: dict[fx.Node, Site] = field(default_factory=dict)

    @property
    def mode(self) -> int:
        """The ``mode`` argument baked into every fused op of this graph."""
        from ..lowering.registry import encode_mode

        return encode_mode(self.batch_invariant, self.follows_global, self.static_weights)

    def site(self, anchor: fx.Node, kind: str) -> Site:
        s = self.sites.get(anchor)
        if s is None:
            loc, layer, src = node_location(anchor)
            s = self.sites[anchor] = Site(kind, anchor, loc, layer, src)
        return s


_CTX: contextvars.ContextVar[PassContext | None] = contextvars.ContextVar("dsv41_pass_ctx", default=None)


@contextlib.contextmanager
def pass_context(ctx: PassContext) -> Iterator[PassContext]:
    tok = _CTX.set(ctx)
    try:
        yield ctx
    finally:
        _CTX.reset(tok)


def current_context() -> PassContext:
    ctx = _CTX.get()
    if ctx is None:  # a pattern applied outside our pass manager (e.g. a unit test)
        ctx = PassContext("tilelang,triton,reference", False)
        _CTX.set(ctx)
    return ctx


def node_location(node: fx.Node) -> tuple[str, int | None, str]:
    """(module path, layer index, source line) from the node's meta."""
    path = ""
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path = list(stack.values())[-1][0]
        for prefix in ("L['self'].", "L__self__."):
            path = path.replace(prefix, "")
        path = path.replace("[", ".").replace("]", "").replace("'", "")
    layer = None
    parts = path.split(".")
    for i, p in enumerate(parts[:-1]):
        if p == "layers" and parts[i + 1].isdigit():
            layer = int(parts[i + 1])
    src = " > ".join(_frames(node.meta.get("stack_trace") or "")[-2:])
    return path or "<model>", layer, src


def _frames(trace_txt: str) -> list[str]:
    """``file:line code`` for each frame of an FX stack trace."""
    import re

    out: list[str] = []
    lines = trace_txt.splitlines()
    for i, ln in enumerate(lines):
        m = re.match(r'\s*File "([^"]+)", line (\d+)', ln)
        if m:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            out.append(f"{m.group(1).rsplit('/', 1)[-1]}:{m.group(2)} {code}")
    return out


# ------------------------------------------------------------ verification
def _rank(n: Any) -> int | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v.dim() if isinstance(v, torch.Tensor) else None


def _is_int(x: Any) -> bool:
    """An int, a SymInt, or a graph node producing one (symbolic sizes in post-grad graphs)."""
    if isinstance(x, fx.Node):
        x = x.meta.get("val")
    return isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool)


class _Verifier:
    def __init__(self, ref: fx.GraphModule, argnames: list[str], match: Match, scalars: dict[str, Any]):
        self.ref = ref
        self.kwargs = match.kwargs
        placeholders = [n for n in ref.graph.nodes if n.op == "placeholder"]
        self.names = dict(zip(placeholders, argnames))
        self.sentinels = {v: k for k, v in scalars.items()}
        self.memo: dict[tuple[fx.Node, Any], bool] = {}

    def node(self, rn: fx.Node, gn: Any) -> str | None:
        key = (rn, gn if isinstance(gn, fx.Node) else id(gn))
        if key in self.memo:
            return None
        self.memo[key] = True
        if rn.op == "placeholder":
            name = self.names.get(rn)
            bound = self.kwargs.get(name)
            return None if bound is gn else f"input {name} does not line up"
        if not isinstance(gn, fx.Node) or gn.op != "call_function":
            return f"{rn.target} expected, found {gn}"
        if gn.target != rn.target:
            return f"{rn.target} expected, found {gn.target}"
        rank = (_rank(rn.args[0]) if rn.args else None, _rank(gn.args[0]) if gn.args else None)
        for i, (ra, ga) in enumerate(zip(rn.args, gn.args)):
            why = self.arg(rn.target, i, ra, ga, rank)
            if why:
                return f"{gn.name}: {why}"
        if len(rn.args) != len(gn.args):
            return f"{gn.name}: {len(gn.args)} args, pattern has {len(rn.args)}"
        for k in set(rn.kwargs) | set(gn.kwargs):
            why = self.arg(rn.target, k, rn.kwargs.get(k), gn.kwargs.get(k), rank)
            if why:
                return f"{gn.name}: {why}"
        return None

    def arg(self, op: Any, pos: Any, ra: Any, ga: Any, rank: tuple[int | None, int | None]) -> str | None:
        if isinstance(ra, fx.Node) and not _is_int(ra):
            return self.node(ra, ga)
        if isinstance(ra, (list, tuple)):
            if not isinstance(ga, (list, tuple)) or len(ra) != len(ga):
                return f"arg {pos}: {ga} vs pattern {ra}"
            for x, y in zip(ra, ga):
                why = self.arg(op, pos, x, y, rank)
                if why:
                    return why
            return None
        if isinstance(ra, torch.device) or (isinstance(pos, str) and pos in ("device", "pin_memory")):
            return None
        if op in SHAPE_OPS and _is_int(ra):
            return None if _is_int(ga) else f"size {ga} is not an int"
        if _is_int(ra) and ra == M_EX:
            return None if _is_int(ga) else f"token count {ga} is not an int"
        if ra in self.sentinels and not isinstance(ra, bool):
            want = self.kwargs.get(self.sentinels[ra])
            return None if ga == want else f"{self.sentinels[ra]} {ga} != {want}"
        dim = DIM_ARGS.get(op)
        if dim is not None and pos == dim[0] and _is_int(ra) and _is_int(ga) and None not in rank:
            r0, r1 = rank[0] + dim[1], rank[1] + dim[1]
            return None if (ra % r0) == (ga % r1) else f"dim {ga} vs pattern {ra}"
        if type(ra) is not type(ga) and not (_is_int(ra) and _is_int(ga)):
            return f"arg {pos}: {ga!r} vs pattern {ra!r}"
        if isinstance(ga, torch.SymInt) or isinstance(ra, torch.SymInt):
            return None if str(ga) == str(ra) else f"arg {pos}: {ga} vs pattern {ra}"
        return None if ga == ra else f"arg {pos}: {ga!r} vs pattern {ra!r}"

    def run(self, outputs: list[fx.Node]) -> str | None:
        ref_out = next(n for n in self.ref.graph.nodes if n.op == "output").args[0]
        ref_out = list(ref_out) if isinstance(ref_out, (list, tuple)) else [ref_out]
        if len(ref_out) != len(outputs):
            return "output count differs"
        for rn, gn in zip(ref_out, outputs):
            why = self.node(rn, gn)
            if why:
                return why
        return None


def bound_values(match: Match) -> dict[str, Any]:
    out = {}
    for k, v in match.kwargs.items():
        out[k] = v.meta.get("val") if isinstance(v, fx.Node) else v
    return out


# ------------------------------------------------------------ registration
class PatternGroup:
    """Patterns of one family in one ``PatternMatcherPass``, registered once, lazily."""

    def __init__(
        self,
        family: str,
        patterns: Callable[[], list[FusionPattern]],
        rewriters: Callable[[], list[Callable[[fx.Graph, "PassContext"], int]]] | None = None,
    ):
        self.family = family
        self._factory = patterns
        self._rewriters = rewriters  # imperative matchers run before the declarative patterns
        self._pass: PatternMatcherPass | None = None
        self.patterns: list[FusionPattern] = []
        self.registered: list[tuple[str, Any]] = []  # (spelling name, PatternExpr) for dumps
        self.duplicates: list[str] = []
        self.register_seconds = 0.0

    def _register(self) -> PatternMatcherPass:
        t0 = time.perf_counter()
        pm_pass = PatternMatcherPass(pass_name=f"dsv41_{self.family}")
        self.patterns = self._factory()
        for pat in self.patterns:
            for sp in pat.spellings:
                with FakeTensorMode():
                    inputs = sp.example_inputs()
                    ref_gm = trace(sp.search, inputs)
                    # The coarse pattern (literals as wildcards) is handed to Inductor pre-traced, so
                    # the candidate reaches our check, which verifies every literal against ref_gm
                    # and can say why a near miss was skipped (Inductor's own re-trace is silent).
                    coarse = fx_to_pattern(
                        ref_gm,
                        ignore_types=(int, float, list, torch.device, torch.dtype),
                        argnames=list(inspect.signature(sp.search).parameters),
                        scalar_workaround=dict(sp.scalars),
                    )
                    expr = register_replacement(
                        sp.search,
                        _replacement(pat, sp),
                        inputs,
                        trace,
                        pm_pass,
                        extra_check=_extra_check(pat, sp, ref_gm),
                        scalar_workaround=dict(sp.scalars),
                        search_fn_pattern=coarse,
                        skip_duplicates=True,
                    )
                if expr is False:
                    self.duplicates.append(f"{pat.kind}.{sp.name}")
                else:
                    self.registered.append((f"{pat.kind}.{sp.name}", expr))
        self.register_seconds = time.perf_counter() - t0
        return pm_pass

    @property
    def pass_(self) -> PatternMatcherPass:
        if self._pass is None:
            self._pass = self._register()
        return self._pass

    def apply(self, graph: fx.Graph) -> int:
        n = 0
        if self._rewriters is not None:
            ctx = current_context()
            for rw in self._rewriters():
                n += rw(graph, ctx)
        n += self.pass_.apply(graph)
        link_sites(graph, current_context())
        return n


def fused_op_node(node: fx.Node) -> fx.Node | None:
    """The dsv41 op call producing ``node`` (itself, or through getitem)."""
    if node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]
    if node.op == "call_function" and str(node.target).startswith("dsv41."):
        return node
    return None


def link_sites(graph: fx.Graph, ctx: PassContext) -> None:
    """Tag each new fused-op node with the site it replaced (found through the old anchor's consumers)."""
    for site in ctx.sites.values():
        if site.op_node is not None or not getattr(site.anchor, "_erased", False):
            continue
        for consumer in site.consumers:
            if getattr(consumer, "_erased", False):
                continue
            for arg in consumer.all_input_nodes:
                op = fused_op_node(arg)
                if op is not None and "dsv41_site" not in op.meta:
                    op.meta["dsv41_site"] = site
                    site.op_node = op
                    break
            if site.op_node is not None:
                break


def _replacement(pat: FusionPattern, sp: Spelling) -> Callable[..., Any]:
    names = list(inspect.signature(sp.search).parameters)

    def repl(*args: Any) -> Any:
        return pat.replace(**dict(zip(names, args)))

    repl.__signature__ = inspect.signature(sp.search)  # type: ignore[attr-defined]
    repl.__name__ = f"replace_{pat.kind}_{sp.name}"
    return repl


def _extra_check(pat: FusionPattern, sp: Spelling, ref_gm: fx.GraphModule) -> Callable[[Match], bool]:
    argnames = list(inspect.signature(sp.search).parameters)

    def check(match: Match) -> bool:
        ctx = current_context()
        anchor = match.output_nodes()[0]
        values = bound_values(match)
        if sp.tokens is not None:  # silently not this spelling's graph: no near-miss to report
            first = values.get(argnames[0])
            if not (isinstance(first, torch.Tensor) and _is_int(first.shape[0]) and first.shape[0] == sp.tokens):
                return False
        why = sp.applies() if sp.applies is not None else None
        if why is None:
            why = _Verifier(ref_gm, argnames, match, sp.scalars).run(match.output_nodes())
        if why is None:
            why = pat.check(values)
        if why is not None:
            site = ctx.site(anchor, pat.kind)
            site.reasons.append(f"{sp.name}: {why}")
            return False
        site = ctx.site(anchor, pat.kind)
        site.consumers = list(anchor.users)
        if pat.provider_args is not None:
            from ..lowering import choose

            p, declined = choose(pat.op, ctx.providers, ctx.batch_invariant, *pat.provider_args(values))
            site.provider = p.name if p is not None else None
            site.note = "; ".join(declined)
        return True

    return check
