"""benchmarks/sass_report.py: the SASS parsing (no cuobjdump or GPU needed)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import sass_report  # noqa: E402

# A made-up listing in cuobjdump's format: a prologue, a loop with an HMMA (0x0030..0x0070), a
# second loop without one, and a kernel the pattern must skip.
LISTING = """
	code for sm_90a
		Function : _Z3fooP4Args
	.headerflags	@"EF_CUDA_SM90"
        /*0000*/                   MOV R1, c[0x0][0x28] ;                  /* 0x00000a0000017a02 */
        /*0010*/                   STL [R1+0x4], RZ ;                      /* 0x000004ff01007387 */
        /*0020*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64] ; /* 0x0000000004037fae */
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;           /* 0x0000000000007b1d */
        /*0040*/              @!P0 PRMT R5, R6, 0x2404, RZ ;               /* 0x0000240406058816 */
        /*0050*/                   HMMA.16816.F32.BF16 R8, R12, R16, R8 ;  /* 0x000000100c08723c */
        /*0060*/                   IADD3 R2, R2, 0x1, RZ ;                 /* 0x0000000102027810 */
        /*0070*/              @!P1 BRA 0x30 ;                              /* 0xfffffffc00e49947 */
        /*0080*/                   LDL R7, [R1+0x4] ;                      /* 0x0000040001077983 */
        /*0090*/                   IADD3 R2, R2, 0x1, RZ ;                 /* 0x0000000102027810 */
        /*00a0*/              @!P2 BRA 0x80 ;                              /* 0xfffffffc00e49947 */
        /*00b0*/                   EXIT ;                                  /* 0x000000000000794d */
		..........
		Function : _Z3barv
        /*0000*/                   EXIT ;                                  /* 0x000000000000794d */
"""


def test_split_and_opcodes():
    funcs = sass_report.split_functions(LISTING)
    assert list(funcs) == ["_Z3fooP4Args", "_Z3barv"]
    assert len(funcs["_Z3fooP4Args"]) == 12
    ops = [sass_report.opcode(line) for line in funcs["_Z3fooP4Args"]]
    assert ops[:5] == ["MOV", "STL", "LDGSTS", "BAR", "PRMT"]  # the predicate is skipped
    assert ops.count("HMMA") == 1


def test_main_loop_is_the_one_with_the_tensor_core_instruction():
    loop = sass_report.main_loop(sass_report.split_functions(LISTING)["_Z3fooP4Args"])
    assert [sass_report.opcode(line) for line in loop] == ["BAR", "PRMT", "HMMA", "IADD3", "BRA"]
    assert sass_report.main_loop(sass_report.split_functions(LISTING)["_Z3barv"]) == []


# The main loop (0x10..0x30) and an out-of-line retry block after the exit that branches back
# into it (0x50 -> 0x20): that range holds the same HMMA but spans the whole kernel.
LISTING_COLD = """
		Function : _Z4coldv
        /*0000*/                   MOV R1, c[0x0][0x28] ;                  /* 0x00000a0000017a02 */
        /*0010*/                   SYNCS.PHASECHK.TRANS64 P0, [R2], R3 ;   /* 0x000000030200 */
        /*0020*/                   HMMA.16816.F32.BF16 R8, R12, R16, R8 ;  /* 0x000000100c08723c */
        /*0030*/              @!P1 BRA 0x10 ;                              /* 0xfffffffc00e49947 */
        /*0040*/                   EXIT ;                                  /* 0x000000000000794d */
        /*0050*/                   BRA 0x20 ;                              /* 0xfffffffc00e49947 */
"""


def test_main_loop_ignores_cold_blocks_branching_back():
    loop = sass_report.main_loop(sass_report.split_functions(LISTING_COLD)["_Z4coldv"])
    assert [sass_report.opcode(line) for line in loop] == ["SYNCS", "HMMA", "BRA"]


def test_report_rows():
    rows = sass_report.report(sass_report.split_functions(LISTING), "foo")
    assert len(rows) == 1
    r = rows[0]
    assert (r["instructions"], r["local_memory"], r["loop_instructions"], r["loop_tensor"], r["loop_barriers"]) == (
        12,
        2,
        5,
        1,
        1,
    )
    assert r["loop_mix"]["HMMA"] == 1


def test_missing_library_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sass_report, "find_cuobjdump", lambda: "/bin/true")
    assert sass_report.main(["--lib", str(tmp_path / "nope.so")]) == 2
    assert "does not exist" in capsys.readouterr().err
