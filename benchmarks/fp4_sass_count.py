"""The FP4 experts' kernel's inner loop in machine instructions, per weight, without a GPU.

    python benchmarks/fp4_sass_count.py [--tree DIR] [--out fp4_sass.json]

Compiles fp4_moe_triton._fp4_grouped_kernel for Hopper (sm_90) with Triton's own ptxas, as a launch
on V4-Flash's experts would (pointers and strides divisible by 16, as Triton specializes them),
disassembles it (nvdisasm, shipped with Triton) and counts the instructions of the K loop's body,
by opcode. Divided by the weights a thread decodes an iteration (BLOCK_K x BLOCK_N / threads),
that is the kernel's arithmetic a weight: at decode sizes the kernel is bound by it, not by the
bytes it reads (an H100 issues about four instructions a weight in the time its memory delivers
one), so a change to the decode shows here before any GPU runs it. Static counts: no stalls, no
memory waits, only what each thread executes.

Each tiling of the default table and the variants beside it (PTX decode on and off, per-group
scales) is compiled; --tree DIR compiles the kernel of another checkout's `deepinfer` instead (a
before and after: `git archive REV deepinfer | tar -x -C DIR`).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import machine_info, print_table, write_json

# (name, BLOCK_M, BLOCK_N, BLOCK_K, dot, warps, extra constexprs)
VARIANTS = [
    ("b1 GEMV 64x256", 1, 64, 256, False, 8, {}),
    ("b1 GEMV 16x256", 1, 16, 256, False, 4, {}),
    ("batch dots 16x128x128", 16, 128, 128, True, 4, {}),
    ("batch dots 16x128x128 group scales", 16, 128, 128, True, 4, {"GROUP_SCALES": True}),
    ("batch dots 16x128x128 group scales, bf16 PTX", 16, 128, 128, True, 4, {"GROUP_SCALES": True, "BF16_PTX": True}),
]


def load_kernel_module(tree: str | None):
    """fp4_moe_triton from this checkout, or from `tree`'s deepinfer (loaded under its own name)."""
    if tree is None:
        from deepinfer.layers.quantization import fp4_moe_triton
        return fp4_moe_triton
    path = os.path.join(tree, "deepinfer", "layers", "quantization", "fp4_moe_triton.py")
    sys.path.insert(0, tree)   # its own `deepinfer` imports (fp4, fp8, envs) resolve inside the tree
    spec = importlib.util.spec_from_file_location("fp4_moe_triton_tree", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def loop_counts(sass: str) -> collections.Counter:
    """Opcodes of the longest backward-branching block of the disassembly (the K loop)."""
    instructions, labels, best = [], {}, collections.Counter()
    for line in sass.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        ins = re.match(r"\s+/\*[0-9a-f]+\*/\s+(.*?)\s*;", line)
        if ins:
            instructions.append(ins.group(1))
    for i, text in enumerate(instructions):
        target = re.search(r"BRA\s+`\((\.L_x_\d+)\)", text)
        if target and labels.get(target.group(1), i + 1) < i:
            body = instructions[labels[target.group(1)]:i + 1]
            if len(body) > sum(best.values()):
                best = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0] for x in body)
    return best


def compile_variant(module, block_m, block_n, block_k, dot, warps, extra):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = module._fp4_grouped_kernel
    params = kernel.arg_names
    constexprs = {"GROUP": 32, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "USE_DOT": dot,
                  "IEEE": False, **extra}
    for name, default in (("ASM", True), ("SPLIT_K", 1), ("GROUP_SCALES", False), ("BF16_PTX", False)):
        if name in params:
            constexprs.setdefault(name, default)
    constexprs = {k: v for k, v in constexprs.items() if k in params}
    types = {"x_ptr": "*bf16", "out_ptr": "*bf16", "codes_ptr": "*u8", "exps_ptr": "*u8"}
    signature = {p: "constexpr" if p in constexprs else types.get(p, "*i32" if p.endswith("_ptr") else "i32")
                 for p in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if p not in constexprs}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3})
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run([nvdisasm, "-c", cubin.name], check=True, capture_output=True, text=True).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", default=None, help="a checkout whose deepinfer to compile instead of this one")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    module = load_kernel_module(args.tree)
    result = {"benchmark": "fp4_sass_count", "machine": machine_info(), "tree": args.tree or "this checkout", "rows": []}
    params = module._fp4_grouped_kernel.arg_names
    for name, block_m, block_n, block_k, dot, warps, extra in VARIANTS:
        if any(key not in params for key in extra):
            continue   # a variant this tree's kernel does not have
        for asm in ((False, True) if "ASM" in params else (False,)):
            try:
                counts = loop_counts(compile_variant(module, block_m, block_n, block_k, dot, warps, {**extra, "ASM": asm}))
            except Exception as e:   # a variant the tree does not have (an older kernel)
                print(f"{name} asm={asm}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
                continue
            per_thread = block_k * block_n / (32 * warps)
            total = sum(counts.values())
            row = {"variant": name, "ptx_decode": asm, "loop_instructions": total,
                   "weights_per_thread": per_thread, "instructions_per_weight": total / per_thread,
                   "top": dict(counts.most_common(8))}
            result["rows"].append(row)
            print(row, flush=True)
    print()
    print_table(result["rows"], [("variant", "variant", ""), ("ptx_decode", "PTX decode", ""),
                                 ("loop_instructions", "loop instructions", ""),
                                 ("instructions_per_weight", "a weight", ".2f")])
    write_json(args.out, result)


if __name__ == "__main__":
    main()
