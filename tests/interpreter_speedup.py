"""A faster Triton interpreter for the tests: skip its repeated patching of ``triton.language``.

conftest.py installs it in the test process; tests/test_examples.py in each example it runs (``python -c`` that
installs it, then runs the script), so the examples' interpreted kernels get it too.
"""


def install() -> None:
    """Triton's interpreter re-patches ``triton.language`` (``inspect.getmembers`` over its namespaces) at every
    call of a ``@triton.jit`` helper, though the launch already patched the same modules: about a third of an
    interpreted mHC kernel's time (cProfile, 2026-12-03; two mHC kernel tests took 73 s with this against 105 s
    without, 2026-12-04). Skip the call when every namespace it would patch is
    patched (one builtin per namespace probed; a patch is all-or-nothing per namespace, so that is exact); any
    other case, and any interpreter without these hooks, runs Triton's own code."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return
    orig = getattr(ti, "_patch_lang", None)
    scope_cls = getattr(ti, "_LangPatchScope", None)
    is_builtin = getattr(tl.core, "is_builtin", None)
    desc = getattr(tl.core, "tensor_descriptor_base", None)
    if orig is None or scope_cls is None or is_builtin is None or desc is None or getattr(orig, "_dsv41", False):
        return

    def probes(fn):
        for value in fn.__globals__.values():
            if value is tl:
                yield from ((tl, "load"), (tl.tensor, "__add__"), (tl.math, "exp"))
            elif value is tl.core:
                yield from ((tl.core, "load"), (tl.core.tensor, "__add__"))
        yield desc, "load"

    def patch_lang(fn):
        seen = list(probes(fn))
        if len(seen) > 1 and all(hasattr(ns, name) and not is_builtin(getattr(ns, name)) for ns, name in seen):
            return scope_cls()  # nothing to patch, nothing to restore
        return orig(fn)

    patch_lang._dsv41 = True
    ti._patch_lang = patch_lang
