"""benchmarks/ncu_source_summary.py on a small CSV laid out as ``ncu --page source --csv --print-source sass`` writes
it: one header a kernel, samples and stall reasons by instruction, offsets from the kernel's first instruction, and
the sums over offset ranges (the roles of a warp-specialized kernel)."""

import csv

from benchmarks import ncu_source_summary as ns

HEADER = ["Address", "Source", "# Samples", "stall_long_sb", "stall_math", "stall_long_sb (Not Issued)"]


def write_csv(path):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "other_kernel"])
        w.writerow(HEADER)
        w.writerow(["0x7f0000001000", "NOP", "5", "5", "0", "5"])
        w.writerow(["Kernel Name", "pre_kernel"])
        w.writerow(HEADER)
        w.writerow(["0x7f0000002000", "BRA 0x7f0000002020", "10", "9", "1", "9"])
        w.writerow(["0x7f0000002010", "FMUL R1, R2, R3", "30", "0", "30", "0"])
        w.writerow(["0x7f0000002020", "FADD R1, R1, R4", "60", "50", "10", "50"])


def test_kernels_sites_and_ranges(tmp_path, capsys, monkeypatch):
    path = tmp_path / "source.csv"
    write_csv(path)
    ks = ns.kernels(str(path))
    assert [k["name"] for k in ks] == ["other_kernel", "pre_kernel"]
    rows = ns.sites(ks[1])
    assert [(n, off) for n, off, _, _ in rows] == [(10.0, 0x0), (30.0, 0x10), (60.0, 0x20)]
    assert rows[2][3] == {"long_sb": 50.0, "math": 10.0}  # the "Not Issued" columns are not reasons of their own
    monkeypatch.setattr("sys.argv", ["ncu_source_summary.py", str(path), "--kernel", "pre_kernel", "--top", "2",
                                     "--ranges", "0-20,20-30"])
    ns.main()
    out = capsys.readouterr().out
    assert "other_kernel" not in out
    assert "== pre_kernel: 100 samples" in out
    assert "reasons: long_sb 59.0%, math 41.0%" in out
    # the first range holds the first two instructions, the second the last (the end is excluded)
    assert "== offsets 00000-00020: 40 samples" in out and "reasons: math 77.5%, long_sb 22.5%" in out
    assert "== offsets 00020-00030: 60 samples" in out and "reasons: long_sb 83.3%, math 16.7%" in out
