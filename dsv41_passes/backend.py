"""torch.compile entry points: the ``dsv41`` Dynamo backend, ``compile()`` and ``inductor_options()``.

Nothing here mutates the global ``torch._inductor.config``: the pass manager and
the determinism switches travel as per-compile config patches.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import nullcontext
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from .config import PassConfig
from .guards import check_mode
from .pass_manager import PostGradPassManager
from .report import RewriteReport, publish, reports


def _pass_config(config: Any, where: str) -> PassConfig:
    """``config``, or the default PassConfig for None; anything else (e.g. a dict of Inductor options given in its
    place) is a TypeError here rather than an AttributeError at the first compile."""
    if config is None:
        return PassConfig()
    if not isinstance(config, PassConfig):
        raise TypeError(f"{where}: config must be a dsv41_passes.PassConfig, got {type(config).__name__} "
                        f"(Inductor options go to options=)")
    return config


def inductor_options(config: PassConfig | None = None) -> dict[str, Any]:
    """Inductor config patches installing the passes (``torch.compile(options=...)``,
    ``compile_fx(config_patches=...)``).

    In batch-invariant mode Inductor's own ``deterministic`` / ``batch_invariant``
    switches are set too, where this torch has them. With ``dump_dir`` the FX graph
    cache is bypassed: a cache hit would skip the passes and so the dump.
    """
    import torch._inductor.config as icfg

    config = _pass_config(config, "inductor_options")
    manager = PostGradPassManager(config)
    opts: dict[str, Any] = {"post_grad_custom_post_pass": manager}
    if config.dump_dir and hasattr(icfg, "fx_graph_cache"):
        opts["fx_graph_cache"] = False
    if manager.batch_invariant:
        for name in ("deterministic", "batch_invariant"):
            if hasattr(icfg, name):
                opts[name] = True
    return opts


def _report_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    d = Path(cache_dir()) / "dsv41_reports"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _locations_digest(gm: torch.fx.GraphModule) -> str:
    """A digest of what report rows take from node meta (module path, layer, source lines). The FX graph cache key
    leaves node meta out: graphs that differ only there (other module names or layer numbers) share an entry."""
    import hashlib

    from .patterns.base import node_location

    h = hashlib.sha256()
    seen: dict[tuple[Any, str], tuple[Any, ...]] = {}
    for n in gm.graph.nodes:
        stack = n.meta.get("nn_module_stack") or {}
        k = (list(stack.values())[-1][0] if stack else None, n.meta.get("stack_trace") or "")
        if k not in seen:
            seen[k] = node_location(n)
        h.update(repr(seen[k]).encode())
    return h.hexdigest()[:16]


def _inner_compile_with_reports(gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
    """Inductor's inner compile, keeping each graph's rewrite report beside its FX-graph-cache entry.

    On a cache miss the pass manager ran and published a report: it is saved under the
    entry's key and the graph's module paths and source lines. On a hit nothing ran: the
    report saved under both is loaded and published; where only a graph of the same code at
    other module paths or source lines left one, that one is, with a warning that its rows
    name those (its sites are this graph's: the passes do not read those paths).
    """
    from torch._inductor.compile_fx import compile_fx_inner

    last_before = reports()[-1] if reports() else None
    locations = _locations_digest(gm)  # before the compile: the passes rewrite gm's graph
    compiled = compile_fx_inner(gm, example_inputs, **kwargs)
    key = getattr(compiled, "_fx_graph_cache_key", None)
    ran = bool(reports()) and reports()[-1] is not last_before
    if key is None:
        return compiled
    path = _report_dir() / f"{key}.{locations}.json"
    if ran:
        try:
            reports()[-1].save(path)
        except OSError:
            pass
    else:
        saved = path if path.exists() else min(path.parent.glob(f"{key}.*.json"), default=None)
        if saved is not None:
            try:
                rep = RewriteReport.load(saved)
            except Exception as e:  # a damaged or older-format file costs the report, not the compile
                rep = RewriteReport(warnings=[f"graph restored from the FX graph cache; its saved rewrite report "
                                              f"{saved} could not be read ({type(e).__name__}: {e})"])
            else:
                if saved != path:
                    rep.warnings.append("graph restored from the FX graph cache; its rewrite report was kept for a "
                                        "graph of the same code at other module paths or source lines: the sites "
                                        "are this graph's, the rows' locations that graph's")
        else:
            rep = RewriteReport(warnings=["graph restored from the FX graph cache; its rewrite report was not kept"])
        rep.from_cache = True
        publish(rep)
    return compiled


def _user_options(options: dict[str, Any] | None) -> dict[str, Any]:
    user_opts = dict(options or {})
    if "post_grad_custom_post_pass" in user_opts:
        raise ValueError("options may not set post_grad_custom_post_pass: the dsv41 pass manager owns it")
    return user_opts


def make_backend(config: PassConfig | None = None, options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """A Dynamo backend running Inductor with the dsv41 passes (plus extra Inductor ``options``)."""
    config = _pass_config(config, "make_backend")
    user_opts = _user_options(options)

    def dsv41_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            if any(p.requires_grad for p in gm.parameters()) or any(
                isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs
            ):
                warnings.warn(
                    "dsv41: compiling with grad enabled; saved activations keep the patterns from matching. "
                    "Run the model under torch.inference_mode() (dsv41_passes.compile does).",
                    stacklevel=2,
                )
        patches = inductor_options(config) | user_opts
        floats = _float_inputs(gm)
        if floats:
            msg = (f"float constants are graph inputs ({', '.join(floats[:4])}{', ...' if len(floats) > 4 else ''}): "
                   "torch.compile(dynamic=True) does not specialize Python floats, and the patterns need eps and "
                   "scale values as constants, so the sites reading them stay unrewritten; set "
                   "torch._dynamo.config.specialize_float = True (dsv41_passes.compile does)")
            warnings.warn(f"dsv41: {msg}", stacklevel=2)
            patches["post_grad_custom_post_pass"].input_warnings = [msg]
        # AOTAutograd's own cache would skip the inner compile on a hit, and with it the report;
        # the FX graph cache below still serves the compiled code.
        import torch._functorch.config as fcfg

        ctx = fcfg.patch(enable_autograd_cache=False) if hasattr(fcfg, "enable_autograd_cache") else nullcontext()
        with ctx:
            compiled = compile_fx(gm, example_inputs, inner_compile=_inner_compile_with_reports,
                                  config_patches=patches)
        if config.batch_invariant is not None:
            return compiled
        # a graph that follows the global mode checks it at every call, not only inside its fused ops: a graph with
        # none (every site skipped, a family off, a fragment after a graph break) would run under the other mode
        bi = config.resolved_batch_invariant()

        def run(*args: Any) -> Any:
            check_mode(bi, True)
            return compiled(*args)

        run._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]
        return run

    return dsv41_backend


def _float_inputs(gm: torch.fx.GraphModule) -> list[str]:
    """Placeholders that Dynamo made of Python floats (unspecialized scalars passed as 0-d tensors)."""
    out = []
    for n in gm.graph.nodes:
        ga = n.meta.get("grapharg") if n.op == "placeholder" else None
        val = n.meta.get("example_value")
        if getattr(ga, "pass_arg_as_tensor", False) and isinstance(val, torch.Tensor) and val.is_floating_point():
            out.append(n.name)
    return out


def dsv41_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """The backend registered as ``"dsv41"``: default PassConfig (batch-invariant mode follows the global one)."""
    return make_backend()(gm, example_inputs)


def compile(model_or_fn: Any, config: PassConfig | None = None, **torch_compile_kwargs: Any) -> Callable[..., Any]:
    """``torch.compile`` with the dsv41 passes.

    * the returned callable enters ``torch.inference_mode()`` itself (the patterns
      need a graph without saved activations);
    * dim 0 (the token dimension) of every tensor argument is marked dynamic, so one
      graph serves every token count from 2 up (a call with M = 1 gets its own graph);
    * with ``config.batch_invariant=None`` the global mode is read at each call; a
      change of mode compiles a graph for the new mode rather than running the old one.

    ``options=`` adds Inductor options; other keyword arguments go to ``torch.compile``.
    """
    config = _pass_config(config, "dsv41_passes.compile")
    options = _user_options(torch_compile_kwargs.pop("options", None))  # (refused here, not at the first call)
    if torch_compile_kwargs.pop("backend", None) is not None:
        raise ValueError("dsv41_passes.compile chooses the backend; use torch.compile(backend='dsv41') instead")
    if torch_compile_kwargs.get("mode") not in (None, "default"):
        raise ValueError("mode= is not supported; pass Inductor options through options=")
    torch_compile_kwargs.pop("mode", None)
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
        # each mode's compile gets its own recompile limit: Dynamo otherwise counts every torch.compile of this
        # function against one, and past it runs the function eagerly (no passes, no batch-invariant mode)
        torch_compile_kwargs.setdefault("isolate_recompiles", True)
    compiled: dict[bool, Callable[..., Any]] = {}

    def for_mode(bi: bool) -> Callable[..., Any]:
        if bi not in compiled:
            backend = _pinned(make_backend(config, options), bi)
            compiled[bi] = torch.compile(model_or_fn, backend=backend, **torch_compile_kwargs)
        return compiled[bi]

    def run(*args: Any, **kwargs: Any) -> Any:
        bi = config.resolved_batch_invariant()
        fn = for_mode(bi)
        for t in (*args, *kwargs.values()):
            if isinstance(t, torch.Tensor) and t.dim() >= 1:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        with torch.inference_mode(), _specialized_floats():
            return fn(*args, **kwargs)

    if isinstance(model_or_fn, torch.nn.Module):
        functools.update_wrapper(run, model_or_fn.forward)
    else:
        functools.update_wrapper(run, model_or_fn)
    run._dsv41_compiled = compiled  # type: ignore[attr-defined]
    return run


def _specialized_floats() -> Any:
    """Python floats (eps, scales) traced as constants, also under ``dynamic=True``: the patterns need them so."""
    import torch._dynamo.config as dcfg

    return dcfg.patch(specialize_float=True) if hasattr(dcfg, "specialize_float") else nullcontext()


def _pinned(backend: Callable[..., Any], bi: bool) -> Callable[..., Any]:
    """Compile under the mode this backend is for (the pass manager reads it when it is built)."""
    from .guards import scoped_mode

    def run(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        with scoped_mode(bi):
            return backend(gm, example_inputs)

    return run


def register() -> None:
    """Register ``"dsv41"`` with Dynamo (the package entry point does the same lazily)."""
    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, register_backend

    # registered already (a second call), or an entry point Dynamo is loading, which it registers itself
    if "dsv41" in _COMPILER_FNS or _BACKENDS.get("dsv41") is not None:
        return
    register_backend(name="dsv41")(dsv41_backend)

