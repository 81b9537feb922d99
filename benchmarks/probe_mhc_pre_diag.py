"""Where the TileLang mhc_pre kernel's time goes: variants of the default config (build options as JSON; ``diag`` ones
drop a role's work or add clock64 timers, ``mhc_pre_kernel.build``), the kernel alone timed in turn with the default
(``mhc_pre.partials``: each call also allocates its outputs and fills the xss sentinel), its bits (x, ws, ss)
against the default's, and for "timers" builds each role's cycles: waiting on its barriers and in all (medians over
the CTAs, thousands of cycles and shares of the role's total; read back from xss).

    source .devsite/setup.sh && python3 benchmarks/probe_mhc_pre_diag.py 65536,16384 \
        'ws={"norm_w_smem": true}' 'tim={"diag": "timers"}' 'cut={"diag": "timers,nonorm"}'

A variant is ``name=JSON`` (options added to the default config) or a ``mhc_pre.CONFIGS`` name (that whole config);
``--unmeasured`` adds every config of ``mhc_pre.UNMEASURED``; ``--with-timers`` adds a ``"diag": "timers"`` build of
every variant (named ``<variant>+t``), the default's included. ``--op`` times the whole ``mhc_pre`` (the kernel and
the stats: the Triton stats kernel, or the kernel's own with ``fused_finish``) and compares x, pre, post and comb.
``--boundary``: the same for the fused boundary (``mhc_pre.BOUNDARY_CONFIG`` with ``boundary``, the post computed in
the kernel; its new residual compared too; with ``--op`` the whole ``mhc_pre.mhc_boundary``); its timers add the
dots' wait for the vector role's post of the stage (``ready``).
"""
import json
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.common import time_interleaved  # noqa: E402
from benchmarks.probe_mhc_pre_tilelang import _inputs  # noqa: E402
from dsv41_passes.lowering.mhc_weights import NUM_SLICES  # noqa: E402
from dsv41_passes.lowering.tilelang import mhc_pre as tlp  # noqa: E402

S = NUM_SLICES
ROLES = {"producer": ("wait empty", "-", "total"), "norm": ("wait xdone", "polls", "total"),
         "dots": ("wait full", "-", "total"), "vec": ("wait full", "wait xfree", "total")}
BOUNDARY_ROLES = dict(ROLES, dots=("wait full", "wait ready", "total"))  # (the dots wait for the post of a stage)


def parse_variants(specs: list[str]) -> dict[str, dict]:
    """The variants of the command line (see the module docstring), "base" (the default config) first."""
    flags = {a for a in specs if a.startswith("--")}
    unknown = flags - {"--unmeasured", "--with-timers", "--op", "--boundary"}
    if unknown:
        raise SystemExit(f"unknown option(s) {sorted(unknown)}")
    names = [a for a in specs if not a.startswith("--")]
    if "--unmeasured" in flags:
        names += [n for n in tlp.UNMEASURED if n not in names]
    variants = {"base": {}}
    for spec in names:
        name, eq, opts = spec.partition("=")
        if eq:
            variants[name] = json.loads(opts)
        elif name in tlp.CONFIGS:
            variants[name] = dict(tlp.CONFIGS[name], whole=True)
        else:
            raise SystemExit(f"{spec!r}: neither name=JSON nor one of {sorted(tlp.CONFIGS)}")
    if "--with-timers" in flags:
        for name, opts in list(variants.items()):
            diag = [f for f in opts.get("diag", "").split(",") if f]
            if "timers" not in diag:
                variants[f"{name}+t"] = dict(opts, diag=",".join(["timers", *diag]))
    return variants


ITERS, HC_EPS, NORM_EPS, EPS = 20, 1e-6, 1e-6, 1e-6


def _boundary_inputs(m: int):
    """``(y, post, comb)`` of a boundary at M = m (the post of the sub-block before)."""
    g = torch.Generator(device="cuda").manual_seed(m + 1)
    y = torch.randn(m, 5120, device="cuda", generator=g).bfloat16()
    post = 2 * torch.rand(m, 4, device="cuda", generator=g)
    comb = torch.rand(m, 4, 4, device="cuda", generator=g)
    comb = comb / comb.sum(-1, keepdim=True)
    return y, post, comb


def main():
    ms = [int(a) for a in sys.argv[1].split(",")]
    variants = parse_variants(sys.argv[2:])
    whole_op = "--op" in sys.argv[2:]
    boundary = "--boundary" in sys.argv[2:]
    base_cfg = dict(tlp.BOUNDARY_CONFIG, boundary=True) if boundary else tlp.DEFAULT_CONFIG
    roles = BOUNDARY_ROLES if boundary else ROLES
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    groups = tlp.groups_for(sm)
    for m in ms:
        h, pp, parts, sliced, scale, base, w = _inputs(m)
        post_in = _boundary_inputs(m) if boundary else None
        fns, outs, timers, cfgs = {}, {}, {}, {}
        for name, opts in variants.items():
            # a config name is that whole config (the default's options it lacks are off), JSON adds to the default
            cfg = dict(opts) if opts.get("whole") else dict(base_cfg, **opts)
            cfg.pop("whole", None)
            if boundary:
                cfg["boundary"] = True
            cfgs[name] = cfg

            def run(cfg=cfg):
                if whole_op and boundary:
                    y, post, comb = post_in
                    return tlp.mhc_boundary(y, h, post, comb, pp, sliced, scale, base, w, ITERS, HC_EPS, NORM_EPS, EPS,
                                            config=cfg)
                if whole_op:
                    return tlp.mhc_pre(h, pp, sliced, scale, base, w, ITERS, HC_EPS, NORM_EPS, EPS, config=cfg)
                fin = (scale, base, ITERS, HC_EPS, NORM_EPS) if cfg.get("fused_finish") else None
                return tlp.partials(h, pp, sliced, w, EPS, config=cfg, groups=groups, with_xss=True, finish=fin,
                                    post=post_in)
            res = run()
            fns[name] = run
            # the op's outputs, or the kernel's (x, ws, ss), with the boundary's new residual first
            k = 4 if boundary else 3
            outs[name] = res if whole_op else res[:k]
            xss = None if whole_op else res[k]
            if "timers" in cfg.get("diag", "") and xss is not None:  # rows 0-11 of each CTA's first row block
                timers[name] = xss.view(-1, S, 64)[:groups, :, :12].reshape(groups * S, 12).cpu()
        same = {n: all(torch.equal(a, b) for a, b in zip(o, outs["base"])) for n, o in outs.items()}
        times = time_interleaved(fns, rounds=8)
        what = ("the op" if whole_op else "the kernel") + (", fused boundary" if boundary else "")
        print(f"\n## M = {m} ({what})\n\n| variant | same bits as base | ms (median) | ms (min) |\n|---|---|---|---|")
        for n, (med, low) in times.items():
            # the options beside the default's (None: one the default has and this build does not)
            cfg, dflt = cfgs[n], base_cfg
            diff = {k: cfg.get(k) for k in sorted(set(cfg) | set(dflt)) if cfg.get(k) != dflt.get(k)}
            print(f"| {n} {json.dumps(diff)} | {same[n]} | {med:.4f} | {low:.4f} |")
        print("\nTimers: medians over the CTAs, thousands of cycles (and fractions of the role's total)\n")
        print("| variant | " + " | ".join(f"{role}: {c}" for role, cs in roles.items() for c in cs if c != "-") + " |")
        print("|---|" + "---|" * sum(c != "-" for cs in roles.values() for c in cs))
        for n, t in timers.items():
            cells = []
            for i, (role, cs) in enumerate(roles.items()):
                tot = t[:, 3 * i + 2]
                for j, c in enumerate(cs):
                    if c == "-":
                        continue
                    if role == "norm" and not cfgs[n].get("norm_wg"):  # (held_norm: no normalizing warps)
                        cells.append("-")
                        continue
                    v = t[:, 3 * i + j]
                    share = "" if j == 2 else f" ({(v / tot).median().item():.2f})"
                    cells.append(f"{v.median().item() / 1e3:.0f}{share}")
            print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
