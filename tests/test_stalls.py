"""kiec.runtime.stalls on a source page shaped as ncu writes it (a kernel line, then the header)."""
import csv
import gzip

import pytest

from kiec.runtime.stalls import format_summary, hot_runs, main, read_source, summarize

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "Instructions Executed", "stall_wait", "stall_long_sb", "stall_branch_resolving", "stall_wait (Not Issued)"]
# a prologue run once, a loop body run 1,000 times, an epilogue run once
BODY = [("LDC R1, c[0x0][0x28]", 2, 1, (1, 1, 0)),
        ("HMMA.16816.F32.BF16 R72, R76, R94, R72", 30, 1000, (20, 10, 0)),
        ("@P0   BRA 0x7fc5137d4cb0", 12, 1000, (2, 0, 10)),
        ("EXIT", 1, 1, (1, 0, 0))]


def write(path, gz: bool):
    opener = gzip.open if gz else open
    with opener(path, "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "kiec::decode_kernel(kiec::Params)", ""])
        w.writerow(HEADER)
        for k, (sass, samples, executed, (wait, sb, br)) in enumerate(BODY):
            w.writerow([hex(0x7000 + 16 * k), f"      {sass}", samples, samples, f"{executed:,}", wait, sb, br, wait])


@pytest.mark.parametrize("gz", [False, True])
def test_samples_by_reason_opcode_and_the_hot_run(tmp_path, gz):
    path = tmp_path / ("page.csv.gz" if gz else "page.csv")
    write(path, gz)
    ins = read_source(path)
    assert [i.opcode for i in ins] == ["LDC", "HMMA", "BRA", "EXIT"] and ins[1].executed == 1000
    assert ins[2].reasons == {"wait": 2, "long_sb": 0, "branch_resolving": 10}    # the Not-Issued columns left out
    s = summarize(ins)
    assert s["samples"] == 45 and s["reasons"] == {"wait": 24, "long_sb": 11, "branch_resolving": 10}
    assert s["opcodes"]["HMMA"] == 30 and s["hottest"][0][3].startswith("HMMA")
    assert hot_runs(ins) == [(1, 2, 42, 1000, {"wait": 22, "long_sb": 10, "branch_resolving": 10})]
    text = format_summary(s)
    assert "45 samples over 4 instructions" in text and "1-2" in text and "wait 53.3%" in text


def test_a_page_without_samples_is_named(tmp_path, capsys):
    path = tmp_path / "details.csv"
    path.write_text('"ID","Metric Name"\n"0","Duration"\n')
    assert main([str(path)]) == 2
    assert "no 'Warp Stall Sampling (All Samples)' column" in capsys.readouterr().err
