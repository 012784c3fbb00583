"""kiec.sass: the decode kernel's listing without addresses or encodings, and the comparison of two.
The listing's parsing runs anywhere; the build needs nvcc and cuobjdump (skipped without them)."""
import shutil

import pytest

from kiec.errors import KiecError
from kiec.sass import first_difference, kernel_listing, main

# cuobjdump's shape: functions in turn, instructions with addresses of any width (past 0xffff too)
DUMP = """
	code for sm_90a
		Function : _ZN4kiec12prefill_normEPKfS1_fPtj
        /*0000*/                   LDC R1, c[0x0][0x28] ;                      /* 0x00000a00ff017b82 */
        /*0010*/                   EXIT ;                                      /* 0x000000000000794d */
		Function : _ZN4kiec13decode_kernelENS_6ParamsE
	.headerflags	@"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                      /* 0x00000a00ff017b82 */
                                                                               /* 0x000fe40000000800 */
        /*fff0*/              @!P0 IMAD.WIDE.U32 R2, R70, 0x4, R16 ;           /* 0x0000000446028825 */
        /*10000*/                  HMMA.16816.F32.BF16 R8, R4, R2, R8 ;        /* 0x000000020408723c */
        /*10010*/                  EXIT ;                                      /* 0x000000000000794d */
"""


def test_the_listing_is_the_kernels_instructions_without_addresses_or_encodings():
    assert kernel_listing(DUMP) == ["LDC R1, c[0x0][0x28]", "@!P0 IMAD.WIDE.U32 R2, R70, 0x4, R16",
                                    "HMMA.16816.F32.BF16 R8, R4, R2, R8", "EXIT"]
    assert kernel_listing(DUMP, "prefill_norm") == ["LDC R1, c[0x0][0x28]", "EXIT"]
    with pytest.raises(KiecError, match="sass"):
        kernel_listing(DUMP, "lm_head_kernel")


def test_the_first_difference_is_a_line_or_the_shorter_ones_end():
    assert first_difference(["a", "b"], ["a", "b"]) is None
    assert first_difference(["a", "b"], ["a", "c"]) == 2
    assert first_difference(["a", "b"], ["a"]) == 2
    assert first_difference([], ["a"]) == 1


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("cuobjdump") is None,
                    reason="needs nvcc and cuobjdump")
def test_a_build_equals_itself_and_an_option_that_moves_code_differs(tmp_path, capsys):
    base, again, other = (tmp_path / name for name in ("base.lst", "again.lst", "other.lst"))
    assert main(["tiny-llama", "--out", str(base)]) == 0
    assert main(["tiny-llama", "--out", str(again), "--against", str(base)]) == 0
    assert "the same as" in capsys.readouterr().out
    # four accumulators instead of two: other products, the same model
    assert main(["tiny-llama", "--options", "tile_accumulators=4", "--out", str(other), "--against", str(base)]) == 1
    out = capsys.readouterr().out
    assert "differs from" in out and "0 bytes spill stores" in out
    assert base.read_text().count("\n") > 1000 and "HMMA" in base.read_text()
