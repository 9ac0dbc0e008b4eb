"""bench/sass_mainloop.py, the static counter behind `make sass`, on a hand-written listing in
nvdisasm's form: it finds the innermost loop around the marker (not an enclosing one, not a loop
without it), picks the nth such loop, counts by kind, leaves out the excluded blocks, and counts
a predicated-off instruction (issued, never executed) as such."""

import importlib.util
import json
import subprocess
import sys

from conftest import REPO

SCRIPT = REPO / "bench" / "sass_mainloop.py"

LISTING = """
//--------------------- .text.kern_a --------------------------
        .section        .text.kern_a,"ax",@progbits
.text.kern_a:
        /*0000*/                   S2R R0, SR_TID.X ;
.L_x_0:
        /*0010*/                   IADD3 R1, R1, 0x1, RZ ;
.L_x_1:
        /*0020*/                   LDS R2, [R1] ;
        /*0030*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0040*/              @!PT LDS RZ, [RZ] ;
        /*0050*/                   ISETP.GT.AND P0, PT, R2, 0x3, PT ;
        /*0060*/               @P0 BRA `(.L_x_2) ;
        /*0070*/                   F2FP.BF16.F32.PACK_AB R3, R4, R5 ;
        /*0080*/                   STS [R1], R3 ;
.L_x_2:
        /*0090*/                   LDGSTS.E.BYPASS.128 [R6], desc[UR4][R8.64] ;
        /*00a0*/               @P1 BRA `(.L_x_1) ;
        /*00b0*/                   FFMA R7, R7, R7, R7 ;
        /*00c0*/               @P2 BRA `(.L_x_0) ;
.L_x_3:
        /*00d0*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*00e0*/                   VIADD R1, R1, 0x1 ;
        /*00f0*/               @P3 BRA `(.L_x_3) ;
        /*0100*/                   EXIT ;
//--------------------- .text.kern_b --------------------------
.text.kern_b:
        /*0000*/                   EXIT ;
"""


def load():
    spec = importlib.util.spec_from_file_location("sass_mainloop", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(tmp_path, *args):
    path = tmp_path / "k.sass"
    path.write_text(LISTING)
    out = subprocess.run([sys.executable, str(SCRIPT), str(path), *args], capture_output=True,
                         text=True)
    return out


def test_innermost_loop_by_kind(tmp_path):
    out = run(tmp_path, "--kernel", "kern_a", "--marker", "HMMA", "--exclude", "", "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    # .L_x_1 to its back branch: 9 instructions in three blocks, not the enclosing .L_x_0 loop.
    assert d["loop_insns"] == 9 and d["blocks"] == 3
    assert d["kinds"] == {"shared": 2, "tensor": 1, "predicated-off": 1, "integer/other": 1,
                          "branch": 2, "float": 1, "copy-async": 1}


def test_excluded_blocks_and_the_second_loop(tmp_path):
    out = run(tmp_path, "--kernel", "kern_a", "--marker", "HMMA", "--exclude", "F2FP", "--json")
    d = json.loads(out.stdout)
    assert d["loop_insns"] == 7 and d["excluded_blocks"] == 1  # the F2FP/STS block left out
    out = run(tmp_path, "--kernel", "kern_a", "--marker", "HMMA", "--loop", "2", "--json")
    d = json.loads(out.stdout)
    assert d["loop"] == 2 and d["loop_insns"] == 3


def test_refusals(tmp_path):
    assert run(tmp_path, "--kernel", "kern", "--marker", "HMMA").returncode != 0  # two match
    assert run(tmp_path, "--kernel", "kern_b", "--marker", "HMMA").returncode != 0  # no loop
    assert run(tmp_path, "--kernel", "kern_a", "--marker", "HMMA", "--loop", "3").returncode != 0


def test_kinds():
    m = load()
    assert m.kind("@!PT LDS RZ, [RZ]") == "predicated-off"
    assert m.kind("@P0 LDG.E R1, desc[UR4][R2.64]") == "global"
    assert m.kind("LD.E R1, desc[UR4][R2.64]") == "generic-mem"
    assert m.kind("QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR16], RZ") == "tensor"
    assert m.kind("PRMT R1, R2, 0x9d8c, R3") == "byte-permute"
