"""The mHC family on the tiny model: site counts per kind, the fused boundary, logits vs eager, V4 wiring."""

import re

import pytest
import torch

import dsv41_passes as dp
from helpers import EMULATE, eager, packed, tiny_model

L = 2
REF_ONLY = dict(providers=("reference",), rope_store=False, wo_a=False)


def _compile(model, **cfg):
    torch._dynamo.reset()
    ids, pos, cu = packed([11, 29, 6])
    ref = eager(model, ids, pos, cu)
    model.reset_cache()
    out = dp.compile(model, dp.PassConfig(**cfg), options=EMULATE)(ids, pos, cu)
    return out, ref, dp.last_report()


def test_v41_sites_and_logits_without_boundary_fusion():
    out, ref, rep = _compile(tiny_model(), mhc_boundary=False, **REF_ONLY)
    assert rep.sites == {"mhc_stats": 2 * L, "mhc_collapse": 2 * L + 1, "mhc_post": 2 * L}, rep.to_markdown()
    assert torch.equal(out, ref)
    calls = re.findall(r"dsv41\.(\w+)\.default", rep.after)
    # boundary fusion off: every sub-block's stats + collapse share one read; posts and the final collapse
    # stay on their own
    assert sorted(calls) == sorted(["mhc_pre"] * (2 * L) + ["mhc_post"] * (2 * L) + ["mhc_collapse"])


def test_v41_sites_boundary_and_logits():
    out, ref, rep = _compile(tiny_model(), **REF_ONLY)  # the default forms the boundaries
    assert rep.sites == {"mhc_stats": 2 * L, "mhc_collapse": 2 * L + 1, "mhc_post": 2 * L}, rep.to_markdown()
    assert torch.equal(out, ref)  # reference providers + emulated casts: eager's bits
    calls = re.findall(r"dsv41\.(\w+)\.default", rep.after)
    # layer 0 attention: stats + collapse share one read; every post is fused with the next pre;
    # the last post and the final collapse (+ model norm) stay separate.
    assert sorted(calls) == sorted(["mhc_pre"] + ["mhc_boundary"] * (2 * L - 1) + ["mhc_post", "mhc_collapse"])
    ops = {}
    for r in rep.rows:
        ops.setdefault(r.kind, []).append(r.op)
    assert ops["mhc_post"].count("mhc_boundary") == 2 * L - 1
    final = [r for r in rep.rows if r.kind == "mhc_collapse" and r.layer is None]
    assert len(final) == 1 and final[0].location == "norm" and final[0].op == "mhc_collapse"


def test_v4_wiring_matches_but_keeps_stats_and_collapse_apart():
    out, ref, rep = _compile(tiny_model(mhc_shifted_pre=False), **REF_ONLY)
    assert rep.sites == {"mhc_stats": 2 * L, "mhc_collapse": 2 * L + 1, "mhc_post": 2 * L}
    assert torch.equal(out, ref)
    assert "mhc_pre" not in rep.after and "mhc_boundary" not in rep.after
    notes = [r.reason for r in rep.rows if r.kind == "mhc_stats"]
    assert all("V4 wiring" in n for n in notes)


@pytest.mark.slow
def test_mhc_off_is_plain():
    out, ref, rep = _compile(tiny_model(), mhc=False, rope_store=False, wo_a=False)
    assert rep.sites == {} and "dsv41" not in rep.after
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
