"""The bench tuners' candidate checks on CPU: a candidate that writes nothing is rejected, before any timing."""

import torch

from benchmarks import bench_rope_store


def test_rope_store_tuner_rejects_a_candidate_that_writes_nothing():
    buf = torch.zeros(4, 8, dtype=torch.bfloat16)
    want = torch.randn(4, 8).to(torch.bfloat16)
    buf.copy_(want)  # what the default config left there before the candidates run

    def run(cfg):
        if cfg["writes"]:
            buf.copy_(want)
        return buf

    def poison():
        buf.view(torch.int16).fill_(bench_rope_store.POISON)

    assert bench_rope_store.tune("q", run, [{"writes": False}], lambda b: torch.equal(b, want), poison) == (None, None)
    assert (buf.view(torch.int16) == bench_rope_store.POISON).all()  # the check ran on the poisoned buffer
