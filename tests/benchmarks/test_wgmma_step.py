"""benchmarks/probe_wgmma_step.py builds for sm_90a: each order issues the kernel's wgmma shapes in the order it names,
with its waits, the wgmmas kept asynchronous (one warpgroup barrier a wait in the SASS), and the vector stand-in on
warpgroups of its own."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks import probe_wgmma_step as ws

ACC = r"\(\(uint32_t\*\)\((\w+) \+ 0\)\)"  # a wgmma's accumulator in TileLang's CUDA


# each wgmma group's accumulator (numbered by first use) and N: H a stream's hi dot (n24, its own accumulator), C its
# [mid; lo] chain group (n48, one accumulator for all four); "step+lds" has the kernel's order beside the stand-in
H, C = 24, 48


@pytest.mark.parametrize("pattern,accs,shapes,waits", [
    ("mix", [0, 1, 2, 0, 3, 4, 0, 0], [C, H, H, C, H, H, C, C], ["0", "2", "0"]),
    ("step+lds", [0, 1, 2, 3, 4, 4, 4, 4], [H] * 4 + [C] * 4, ["0", "3", "0"]),
])
def test_probe_builds_for_sm90a(pattern, accs, shapes, waits, tmp_path, monkeypatch):
    pytest.importorskip("tilelang")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed: TileLang cannot build the sm_90a cubin")
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    src = ws.compile_probe(pattern, 40, 2).get_kernel_source()
    names = re.findall(ACC, src)
    assert [list(dict.fromkeys(names)).index(a) for a in names] == accs, names
    assert [int(n) for n in re.findall(r"kFloat32, 64, (\d+), 16,", src)] == shapes
    assert re.findall(r"tl::wait_wgmma<(\d)>", src) == waits
    assert ("threadIdx.x) < 128" in src) == ("+" in pattern) and ("LDS" not in src)
    if "+" in pattern:  # the stand-in reads the stage tiles (lds) on warpgroups 1-2
        assert "if (128 <= ((int)threadIdx.x))" in src and "(t_1 & 3) * 2048" in src
    cubins = list(Path(tmp_path).rglob("*.cubin"))
    tool = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if cubins and tool.exists():
        sass = subprocess.run([str(tool), "-sass", str(cubins[0])], capture_output=True, text=True).stdout
        assert sass.count("HGMMA.") == 2 * len(accs)
        assert sass.count("WARPGROUP.DEPBAR") == len(waits)
