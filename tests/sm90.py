"""Build Triton kernels for sm_90 on a machine without a GPU and return their PTX.

The test process runs Triton under the interpreter (``TRITON_INTERPRET=1`` is read when the
kernels are decorated), so the build runs in a child process without it. Pointer and stride
arguments get the 16-divisibility a real launch sees, so the PTX is what the GPU runs
(vectorized loads, cp.async pipelines).

The GPU image runs Triton 3.6, which may reject code a newer Triton takes (run 235: a callee's default ``str``
constexpr). Where ``.venv/gpu-triton`` holds that Triton (``scripts/run.sh test`` installs it there), every build is
also made with it, and its output is the one returned: the PTX the GPU would run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_TRITON = Path(os.environ.get("DSV41_GPU_TRITON", ROOT / ".venv" / "gpu-triton"))

_SCRIPT = r"""
import importlib, json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

spec = json.loads(sys.stdin.read())
out = []
for b in spec["builds"]:
    kernel = getattr(importlib.import_module(b["module"]), b["kernel"])
    consts = b["constexprs"]
    types = b["types"]
    sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(kernel.arg_names)
             if a in b["aligned"] or (a in types and types[a].startswith("*"))}
    c = triton.compile(ASTSource(kernel, sig, consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=b["options"])
    usage = {}
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if os.path.exists(tool):  # registers and spill stack per thread, from the cubin
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(c.asm["cubin"])
            f.flush()
            text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        usage = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", text)}
    out.append(dict(ptx=c.asm["ptx"], ttir=c.asm.get("ttir", ""), shared=c.metadata.shared, usage=usage,
                    triton=triton.__version__))
print(json.dumps(out))
"""


def build_sm90(builds: list[dict]) -> list[dict]:
    """``builds``: dicts with module, kernel, types (arg -> ``*bf16``/``fp32``/...; others i32),
    aligned (int args divisible by 16), constexprs, options. Returns ``[{ptx, ttir, shared, usage, triton}]``,
    usage the cubin's per-thread ``REG``/``STACK`` (spill) counts from Triton's bundled cuobjdump, triton the
    version that built it."""
    stacks = [""] + ([str(GPU_TRITON)] if (GPU_TRITON / "triton").is_dir() else [])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = None
    for extra in stacks:  # this environment's Triton, then the GPU image's (whose output is returned)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), extra, os.environ.get("PYTHONPATH", "")) if p)
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(_SCRIPT)], input=json.dumps(dict(builds=builds)),
                           capture_output=True, text=True, env=env, timeout=900)
        assert r.returncode == 0, f"Triton from {extra or 'this environment'}:\n{r.stderr[-4000:]}"
        out = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def instructions(ptx: str) -> list[str]:
    """The PTX instruction lines (no directives, labels, braces or comments). An instruction without operands is
    spelled ``op ;`` whichever Triton wrote it (3.9: ``griddepcontrol.wait ;``, 3.6: ``griddepcontrol.wait; // x``)."""
    skip = ("//", ".", "$", "{", "}", ")", "(")
    lines = [line.split("//")[0].strip() for line in ptx.splitlines() if not line.strip().startswith(skip)]
    return [f"{line[:-1]} ;" if line.endswith(";") and " " not in line else line for line in lines if line]


def pdl_prologue(pdl_ptx: str, plain_ptx: str) -> list[str]:
    """The grid-dependency instructions of a kernel's PDL build, in order, checked to come before its first global
    access and to be all that differs from its plain build (instructions compared with their registers renamed
    away; the plain build has none)."""
    ops = [instructions(p) for p in (pdl_ptx, plain_ptx)]
    gdc = [(i, op.split()[0]) for i, op in enumerate(ops[0]) if op.startswith("griddepcontrol")]
    first_global = min(i for i, op in enumerate(ops[0]) if " ld.global" in f" {op}" or " st.global" in f" {op}")
    assert gdc and all(i < first_global for i, _ in gdc), (gdc, first_global)
    assert not any(op.startswith("griddepcontrol") for op in ops[1])
    plain = [sorted(re.sub(r"%\w+", "%", op) for op in o if not op.startswith("griddepcontrol")) for o in ops]
    assert plain[0] == plain[1], "the PDL build differs beyond its grid-dependency control"
    return [op for _, op in gdc]
