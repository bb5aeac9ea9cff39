"""Compiles the Triton kernels of block quantization for a GPU, on a machine without one, and
saves what their PTX does: ``python -m triton_ptx OUT`` (``test_triton_kernels.py`` reads it).

Each kernel is built as a launch on a bucket of whole 256-element blocks builds it (pointers
and strides divisible by 16), for an H100 (``sm_90``) and an A100 (``sm_80``).
"""

import re
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from commhooks.compress import triton_kernels as kernels

TARGETS = {"sm_90": GPUTarget("cuda", 90, 32), "sm_80": GPUTarget("cuda", 80, 32)}
TILE = {"BLOCK": 256, "WIDTH": 256, "GROUP": 8}
INSTRUCTIONS = {
    "approximate": r"div\.full|div\.approx|rcp\.approx|\.ftz",
    "fma": r"fma\.rn\.f32",
    "vector loads": r"ld\.global(?:\.[a-z]+)*\.v[24]\.",
    "vector stores": r"st\.global(?:\.[a-z]+)*\.v[24]\.",
    "scalar loads": r"ld\.global(?:\.[a-z]+)*\.b(?:8|16|32) ",
}


def _signature(bits: int) -> dict[str, dict[str, str]]:
    codes = "*i8" if bits == 8 else "*u8"
    return {
        "quantize_kernel": {
            "x_ptr": "*fp32", "x_stride": "i32", "codes": codes, "scales": "*fp32",
            "packet_stride": "i32", "scale_stride": "i32", "first": "*fp32",
            "second": "*fp32", "added": "i32", "length": "i32", "blocks": "i32",
            "qmax": "fp32", "inv_qmax": "fp32",
        },
        "decode_kernel": {
            "codes": codes, "scales": "*fp32", "packet_stride": "i32", "scale_stride": "i32",
            "out": "*fp32", "out_stride": "i32", "rows": "i32",
            "columns": "i32", "blocks": "i32",
        },
        "requantize_kernel": {
            "codes": codes, "scales": "*fp32", "packet_stride": "i32", "scale_stride": "i32",
            "rows": "i32", "out": "*fp32", "own_codes": codes, "own_scales": "*fp32",
            "memory": "*fp32", "remembered": "i32", "blocks": "i32", "world": "fp32",
            "inv_world": "fp32", "qmax": "fp32", "inv_qmax": "fp32",
        },
    }  # fmt: skip


CONSTANTS = {
    "quantize_kernel": {"KEEP": True, "ADD": True, "RECIPROCAL": True},
    "decode_kernel": {"SUM": False, "BFLOAT16": False},
    "requantize_kernel": {"KEEP": True, "MEMORY": True, "RECIPROCAL": True},
}


def ptx(name: str, bits: int, target: GPUTarget) -> str:
    """The PTX of kernel ``name`` at ``bits``, built as the launches build it."""
    fn = getattr(kernels, name)
    signature = _signature(bits)[name]
    constants = {**TILE, "BITS": bits, **CONSTANTS[name]}
    # every pointer and integer divisible by 16, as the launcher finds them on such a bucket
    attrs = {
        (fn.arg_names.index(arg),): [["tt.divisibility", 16]]
        for arg, kind in signature.items()
        if kind[0] in "*i" and arg != "rows"
    }
    full = {**signature, **dict.fromkeys(constants, "constexpr")}
    source = ASTSource(fn=fn, signature=full, constexprs=constants, attrs=attrs)
    options = {"num_warps": 4, "enable_fp_fusion": False}
    return str(triton.compile(source, target=target, options=options).asm["ptx"])


def counts() -> dict[str, dict[str, int]]:
    """Each kernel's count of each kind of instruction, by ``target kernel bits``."""
    found = {}
    for target_name, target in TARGETS.items():
        for name in CONSTANTS:
            for bits in (8, 4):
                text = ptx(name, bits, target)
                key = f"{target_name} {name} {bits}"
                found[key] = {k: len(re.findall(p, text)) for k, p in INSTRUCTIONS.items()}
    return found


if __name__ == "__main__":
    torch.save(counts(), sys.argv[1])
