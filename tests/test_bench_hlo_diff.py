"""bench/kernels/hlo_diff.py: the ops outside the attention kernels of a model step compiled for
a TPU without one (issue 63 item 2), and the kernels' Mosaic modules against another
checkout's."""

from __future__ import annotations

from pathlib import Path

from bench.kernels import hlo_diff

# An optimized module's shape: a kernel whose backend config spans lines (as splash's
# xprof_metadata does), an async copy into VMEM (S(1)) and a fusion with its cost estimate.
HLO = """HloModule step

%fused_computation (p: bf16[8,128]) -> bf16[8,128] {
  ROOT %p = bf16[8,128]{1,0} parameter(0)
}

ENTRY %main (a: bf16[8,128]) -> bf16[8,128] {
  %a = bf16[8,128]{1,0:T(8,128)(2,1)} parameter(0)
  %copy-start = (bf16[8,128]{1,0:T(8,128)(2,1)S(1)}, bf16[8,128]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%a)
  %copy-done = bf16[8,128]{1,0:T(8,128)(2,1)S(1)} copy-done(%copy-start)
  %kernel.1 = f32[8,128]{1,0} custom-call(%copy-done), custom_call_target="tpu_custom_call", backend_config={"xprof_metadata":"{
}"}
  ROOT %fusion = bf16[8,128]{1,0:T(8,128)(2,1)} fusion(%kernel.1, %copy-done), kind=kLoop, calls=%fused_computation, backend_config={"estimated_cycles":"42"}
}
"""


def test_counts_the_ops_outside_the_kernels_with_their_bytes_in_hbm():
    rows = hlo_diff.outside_kernels(HLO)
    tile = 8 * 128 * 2
    assert rows == {
        # the copy's destination, moved to or from HBM
        ("copy-start", "(bf16[8,128], bf16[8,128], u32[])"): [1, tile, tile, 0],
        # its output and both operands; the kernel's f32 output and its own output in HBM
        ("kLoop", "bf16[8,128]"): [1, tile + 2 * tile + tile, tile + 2 * tile, 42]}


def test_compares_flash_and_splash_compiled_for_v5e():
    """A tiny Llama step compiled deviceless for each kernel: the rows that differ include
    flash's delta, reduced in the fusion that produces dO in flash's [b, h, s, d] layout, and
    splash's iotas (its kernels' position inputs); no kernel is among them."""
    lines = hlo_diff.main(["--layers", "1", "--seq", "512", "--d-model", "256", "--heads",
                           "2", "--kv-heads", "1"])
    assert "flash" in lines[0] and "splash" in lines[0]
    counts = {(line[:14].strip(), line[15:61].strip()): [cell.split()[0] for cell in
                                                        line.split(" | ")[1:]]
              for line in lines[2:-1]}
    assert counts[("kOutput", "(f32[2,512], bf16[1,2,512,128])")] == ["1", "0"]
    assert counts[("iota", "s32[512,128]")] == ["0", "1"]
    assert not any(kind == "tpu_custom_call" for kind, _ in counts)
    assert lines[-1].startswith("total")


def test_mosaic_lines_name_each_module_that_differs_or_is_missing():
    lines = hlo_diff.mosaic_lines({"flash:a": "x\ny", "flash:b": "z"},
                                  {"flash:a": "x\nw", "flash:b": "z", "flash:c": "v"}, "main")
    assert lines[0] == "flash:a: differs" and "-w" in lines and "+y" in lines
    assert "flash:b: identical (1 characters)" in lines and "flash:c: only main" in lines


def test_mosaic_modules_of_a_checkout_match_its_own():
    """--mosaic lowers flash's three kernels for TPU here and, in a child process, from the
    given checkout (here the same one): every module identical, read back from Mosaic's
    serialized form."""
    root = str(Path(hlo_diff.__file__).resolve().parents[2])
    lines = hlo_diff.main(["--mosaic", root, "--kernels", "flash", "--seq", "256", "--heads",
                           "1", "--kv-heads", "1", "--head-dim", "64"])
    assert [line.split(":")[1] for line in lines] == ["flash_fwd", "flash_bwd_dkv",
                                                      "flash_bwd_dq"]
    assert all(": identical (" in line for line in lines), lines
