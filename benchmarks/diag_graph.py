"""Print the post-grad graph region around the collapse and the softmax of the mHC unit (device forms)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dsv41_passes as dp  # noqa: E402
from benchmarks.diag_mhc_match import args, unit  # noqa: E402,F401

rep = dp.last_report()
lines = [ln.strip() for ln in rep.before.splitlines()]
for key in ("sum.dim_IntList](args = (%mul", "softmax", "amax", "_softmax"):
    for i, ln in enumerate(lines):
        if key in ln:
            print("\n".join(x[:230] for x in lines[i: i + (12 if key.startswith("sum") else 6)]))
            print("----")
            break
