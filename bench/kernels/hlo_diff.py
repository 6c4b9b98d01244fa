"""Issue 63 item 2: where a model step's time outside the attention kernels goes, without a
chip. Compiles ``bench/chip/model_step.py``'s step ahead of time for a TPU generation (deviceless,
``kernel.aot.topology_device``) once per attention kernel, each at its default config for that
generation (flash's v5e default is the tuned q512 kv512/512 dkv512x512 dq512x512 of the chip's
Llama step; splash's is MaxText's), and compares the optimized programs' top-level
instructions outside the kernels: per (kind, output shape), in each variant, the count, the
bytes its operands and outputs span, those of them in HBM (not placed in VMEM, ``S(1)``, by
XLA's memory-space assignment) and the compiler's own estimate of its cycles
(``estimated_cycles``). Only rows that differ are printed, largest estimate first, then each
variant's totals. Async copies and slices (``copy-start``, ``slice-start``) move data beside
the compute: their bytes count, their cycles are none::

    python bench/kernels/hlo_diff.py --model llama --seq 4096          # flash against splash, v5e
    python bench/kernels/hlo_diff.py --kernels flash,splash --layers 1 --target v5e

With ``--mosaic CHECKOUT`` it compares the kernels themselves instead, across two checkouts:
the Mosaic module of each ``tpu_custom_call`` that each of ``--kernels`` lowers for TPU (on a
CPU host, nothing compiled) for the step's attention problem (causal ``fwd_bwd``, ``--batch``,
``--heads``, ``--kv-heads``, ``--seq``, ``--head-dim``, ``--dtype``) at the kernel's default
config for ``--target``, here and in ``CHECKOUT``'s ``kernel`` package, as text without
locations. It prints each module's verdict (and the first lines that differ) and exits 1 when
any differs: a change meant to leave a kernel alone (issue 74's float32-only statistics, for
bf16) is proved so without a chip::

    python bench/kernels/hlo_diff.py --mosaic /work/main --kernels flash --seq 512 --heads 2 \
        --kv-heads 2 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import base64
import difflib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import kernel  # noqa: E402
from bench.chip import model_step  # noqa: E402

_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
               "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b(pred|bf16|[suf]\d+)\[([\d,]*)\](\{[^}]*\})?")
_HEAD = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9-]*)\(")
_SILENT = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant", "copy-done",
           "slice-done"}  # no data moved, or moved by the op that started it


def array_bytes(shape: str, placed: str = "any") -> int:
    """Bytes of the arrays in an HLO shape (a tuple's leaves summed); ``placed``: ``"hbm"``
    counts only those not in VMEM (``S(1)`` in their layout)."""
    total = 0
    for dtype, dims, layout in _ARRAY.findall(shape):
        if placed == "hbm" and "S(1)" in layout:
            continue
        count = 1
        for dim in filter(None, dims.split(",")):
            count *= int(dim)
        total += count * _ITEM_BYTES.get(dtype, 4)
    return total


def entry_instructions(hlo: str) -> list[dict[str, Any]]:
    """The entry computation's instructions of an optimized HLO module's text: name, shape,
    opcode, operand names and attributes (an instruction's text may span lines: a kernel's
    backend config holds newlines)."""
    lines = hlo.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
    texts: list[str] = []
    for line in lines[start + 1:]:
        if line == "}":
            break
        if re.match(r"^\s*(ROOT )?%", line):
            texts.append(line)
        else:
            texts[-1] += line
    instructions = []
    for text in texts:
        head = _HEAD.match(text)
        rest, depth, end = text[head.end():], 1, 0
        while depth:
            depth += {"(": 1, ")": -1}.get(rest[end], 0)
            end += 1
        instructions.append({"name": head[1], "shape": head[2], "opcode": head[3],
                             "operands": re.findall(r"%([\w.-]+)", rest[:end - 1]),
                             "attributes": rest[end:]})
    return instructions


def _attribute(instruction: dict[str, Any], pattern: str) -> str:
    found = re.search(pattern, instruction["attributes"])
    return found[1] if found else ""


def outside_kernels(hlo: str) -> dict[tuple[str, str], list[int]]:
    """Per (kind, output shape without layout) of the entry's instructions other than the
    Mosaic kernels (``tpu_custom_call``): [count, bytes, HBM bytes, estimated cycles]. A
    fusion's kind is its ``kind=`` (kLoop, kOutput, ...), another instruction's its opcode or
    custom-call target; an async copy or slice counts its destination alone, all of it HBM
    traffic (it moves data between HBM and VMEM, or within HBM)."""
    instructions = entry_instructions(hlo)
    shapes = {instruction["name"]: instruction["shape"] for instruction in instructions}
    rows: dict[tuple[str, str], list[int]] = {}
    for instruction in instructions:
        target = _attribute(instruction, r'custom_call_target="([^"]*)"')
        if instruction["opcode"] in _SILENT or target == "tpu_custom_call":
            continue
        if instruction["opcode"] in ("copy-start", "slice-start"):  # one side is in HBM
            destination = _ARRAY.findall(instruction["shape"])[instruction["opcode"] == "slice-start"]
            moved = hbm = array_bytes("{}[{}]".format(*destination))
        else:
            shapes_moved = [instruction["shape"], *(shapes.get(name, "")
                                                    for name in instruction["operands"])]
            moved = sum(map(array_bytes, shapes_moved))
            hbm = sum(array_bytes(shape, "hbm") for shape in shapes_moved)
        kind = (_attribute(instruction, r"kind=(k\w+)") or target or instruction["opcode"])
        key = (kind, re.sub(r"\{[^}]*\}", "", instruction["shape"]))
        row = rows.setdefault(key, [0, 0, 0, 0])
        row[0] += 1
        row[1] += moved
        row[2] += hbm
        row[3] += int(_attribute(instruction, r'estimated_cycles\\?":\\?"(\d+)') or 0)
    return rows


def compiled_hlo(args: argparse.Namespace, kernel_name: str, target: str) -> str:
    """The optimized HLO text of ``bench/chip/model_step.py``'s step with its attention from
    ``kernel_name`` at its default config for ``target``, compiled for ``target`` deviceless."""
    from jax.sharding import SingleDeviceSharding

    from autotune.step_choice import pinned_table
    from kernel.aot import topology_device

    step = model_step.make_step(args)
    params = jax.eval_shape(lambda: model_step.init_params(args, jax.random.key(0)))
    x = jax.ShapeDtypeStruct((args.batch, args.seq, args.d_model), jnp.bfloat16)
    with kernel.capture() as captured:
        jax.eval_shape(step, params, x)
    table = pinned_table(list(captured), kernel_name,
                         lambda chosen, problem: chosen.default_config(problem, target))
    placed = SingleDeviceSharding(topology_device(target))
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed),
                         (params, x))
    with kernel.tables(table):
        return jax.jit(step).trace(*specs).lower().compile().as_text()


def table_lines(variants: dict[str, dict[tuple[str, str], list[int]]]) -> list[str]:
    """The rows that differ between the variants (largest estimate first, then most bytes),
    then totals."""
    names = list(variants)
    empty = [0, 0, 0, 0]
    keys = sorted({key for rows in variants.values() for key in rows},
                  key=lambda key: [-max(rows.get(key, empty)[i] for rows in variants.values())
                                   for i in (3, 1)])
    header = "".join(f" | {name[:30]:>30}" for name in names)
    lines = [f"{'kind':<14} {'output shape':<46}{header}",
             f"{'':<61}" + " | n       MB   HBM MB   Mcycles" * len(names)]

    def cells(row: list[int]) -> str:
        return f" | {row[0]:<2} {row[1] / 1e6:8.1f} {row[2] / 1e6:8.1f} {row[3] / 1e6:9.3f}"

    for key in keys:
        rows = [variants[name].get(key, empty) for name in names]
        if any(row != rows[0] for row in rows):
            lines.append(f"{key[0][:14]:<14} {key[1][:46]:<46}"
                         + "".join(cells(row) for row in rows))
    totals = [[sum(row[i] for row in variants[name].values()) for i in range(4)]
              for name in names]
    lines.append(f"{'total':<61}" + "".join(cells(row) for row in totals))
    return lines


def mosaic_modules(args: argparse.Namespace, kernel_names: list[str], dtype: str,
                   target: str) -> dict[str, str]:
    """Per kernel (``name:function``, in call order), the Mosaic module text (no locations) of
    each ``tpu_custom_call`` that ``kernel_names`` lower for TPU, for the causal ``fwd_bwd``
    attention problem of ``args`` (``model_step``'s shape flags) in ``dtype``, each at its
    default config for ``target``. Lowered only: no libtpu, no compile."""
    from jax._src.interpreters import mlir
    from jaxlib.mlir import ir
    from jaxlib.mlir.passmanager import PassManager
    from jaxlib.mosaic.python import tpu

    from kernel.contract import input_specs

    problem = kernel.Problem(args.batch, args.heads, args.kv_heads, args.seq, args.seq,
                             args.head_dim, dtype, True, "fwd_bwd")
    configs: list[tuple[str, str]] = []  # (kernel name, backend config JSON)

    def collect(name: str, op: ir.Operation) -> None:
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    inner = inner.operation
                    if (inner.name == "stablehlo.custom_call" and ir.StringAttr(
                            inner.attributes["call_target_name"]).value == "tpu_custom_call"):
                        configs.append(
                            (name, ir.StringAttr(inner.attributes["backend_config"]).value))
                    collect(name, inner)

    for name in kernel_names:
        chosen = kernel.get_kernel(name)
        fn = chosen.build(problem, chosen.default_config(problem, target))
        lowered = jax.jit(fn).trace(*input_specs(problem)).lower(lowering_platforms=("tpu",))
        collect(name, lowered.compiler_ir("stablehlo").operation)
    context = mlir.make_ir_context()
    tpu.register_dialect(context)
    modules = {}
    with context, ir.Location.unknown():
        # The body is Mosaic's versioned bytecode (stable_mosaic ops): read back into the tpu
        # dialect as jax's own downgrade does.
        context.allow_unregistered_dialects = True
        for name, config in configs:
            body = json.loads(config)["custom_call_config"]["body"]
            module = ir.Module.parse(base64.b64decode(body))
            PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(
                module.operation)
            text = module.operation.get_asm(enable_debug_info=False)
            function = re.search(r"func\.func @([\w.]+)", text)[1]
            key = f"{name}:{function}"
            while key in modules:
                key += "'"
            modules[key] = text
    return modules


# Runs a script with another checkout's ``kernel`` package: imported before the script puts its
# own repository first on the path (a package's submodules load from where it was found).
_IN_CHECKOUT = ("import runpy, sys; sys.path.insert(0, sys.argv[1]); import kernel; "
                "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def mosaic_lines(ours: dict[str, str], theirs: dict[str, str], checkout: str) -> list[str]:
    """Each module's verdict, ours against ``checkout``'s, with the first lines that differ."""
    lines = []
    for key in sorted(set(ours) | set(theirs), key=list({**ours, **theirs}).index):
        if key not in ours or key not in theirs:
            lines.append(f"{key}: only {'here' if key in ours else checkout}")
        elif ours[key] == theirs[key]:
            lines.append(f"{key}: identical ({len(ours[key])} characters)")
        else:
            diff = difflib.unified_diff(theirs[key].splitlines(), ours[key].splitlines(),
                                        checkout, "here", n=1, lineterm="")
            lines += [f"{key}: differs", *list(diff)[:40]]
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", default="flash,splash",
                        help="the attention kernels to compare (a,b), each at its default")
    parser.add_argument("--target", default="v5e", help="the TPU generation to compile for")
    parser.add_argument("--mosaic", metavar="CHECKOUT",
                        help="compare the kernels' Mosaic modules with this checkout's")
    parser.add_argument("--dtype", default="bfloat16", help="the attention inputs' (--mosaic)")
    parser.add_argument("--mosaic-out", type=Path, help=argparse.SUPPRESS)  # a --mosaic child's
    own, model_flags = parser.parse_known_args(argv)
    args = model_step.parse_args(model_flags)
    names = own.kernels.split(",")
    if own.mosaic_out:
        own.mosaic_out.write_text(json.dumps(mosaic_modules(args, names, own.dtype,
                                                            own.target)))
        return []
    if own.mosaic:
        with tempfile.TemporaryDirectory() as scratch:
            out = Path(scratch) / "modules.json"
            subprocess.run([sys.executable, "-c", _IN_CHECKOUT, own.mosaic, __file__,
                            *(sys.argv[1:] if argv is None else argv), "--mosaic-out", str(out)],
                           check=True)
            theirs = json.loads(out.read_text())
        ours = mosaic_modules(args, names, own.dtype, own.target)
        lines = mosaic_lines(ours, theirs, own.mosaic)
        print("\n".join(lines))
        if ours != theirs:
            raise SystemExit(1)
        return lines
    variants = {name: outside_kernels(compiled_hlo(args, name, own.target))
                for name in own.kernels.split(",")}
    lines = table_lines(variants)
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
