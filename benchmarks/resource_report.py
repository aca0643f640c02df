"""Shared memory, registers and spills of the fused MoE GEMMs for a Hopper GPU, compiled on any machine.

    python benchmarks/resource_report.py --model mixtral-8x7b --M 256 --device-name NVIDIA_H100_80GB_HBM3

No GPU needed: the launch wrapper runs on meta tensors, its launch is caught, and the kernel is compiled
for sm_90 with Triton's bundled ptxas. For each GEMM (base and every LoRA variant the layer would launch at
that M) it prints the shared memory the launch asks for against the 227 KiB an H100/H200 block may use,
the registers and spill bytes ptxas reports (``cuobjdump --dump-resource-usage``) and the blocks that
fit on an SM, flagged where a LoRA variant fits fewer than its base GEMM; "pf" marks the variants that
prefetch their epilogue operands before the K-loop (``lora_prefetch_pays``). The Triton here may
differ from the one on the device; treat the numbers as close, and confirm on the GPU.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moelora.bench import MODELS  # noqa: E402
from triton_ops import fused_moe, lora_epilogues, plan  # noqa: E402
from triton_ops.configs import (  # noqa: E402
    MAX_SHARED_BYTES,
    MoEConfig,
    blocks_per_sm_by_shared,
    default_moe_config,
    tuned_moe_config,
)
from triton_ops.fused_experts import _with_lora_tiles  # noqa: E402
from triton_ops.fused_moe import (  # noqa: E402
    LoRAOperands,
    invoke_fused_moe_kernel,
    lora_rank_block,
)
from triton_ops.moe_align import SINGLE_PROGRAM_MAX_PAIRS  # noqa: E402

# 64K 32-bit registers and 64 resident warps per SM on the H100/H200 (and A100).
REGISTERS_PER_SM = 65536
WARPS_PER_SM = 64

HOPPER = GPUTarget("cuda", 90, 32)
HOPPER_SMS = 132  # H100 SXM and H200


def blocks_per_sm(shared: int, regs: int, num_warps: int) -> int:
    """Blocks of a kernel resident per SM on Hopper: the least of what shared memory (plus the 1 KiB each
    block reserves), registers (allocated per warp in units of 256) and warp slots allow."""
    by_smem = blocks_per_sm_by_shared(shared)
    regs_per_warp = -(-regs * 32 // 256) * 256
    by_regs = REGISTERS_PER_SM // (regs_per_warp * num_warps)
    return min(by_smem, by_regs, WARPS_PER_SM // num_warps)
_TORCH_TO_TRITON = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
                    torch.int32: "*i32", torch.int64: "*i64"}


class _CaughtLaunch:
    """Stands in for ``_fused_moe_kernel``: records the launch's keyword arguments instead of running."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.launches: list[dict] = []

    def __getitem__(self, grid):
        def launch(**kwargs):
            self.launches.append(kwargs)
        return launch


def compile_launch(kernel, kwargs: dict) -> dict:
    constexpr_names = {p.name for p in kernel.params if p.is_constexpr}
    signature, constexprs, attrs = {}, {}, {}
    # As a launch specialises: 16-byte aligned pointers (fresh allocations), ints divisible by 16, ints == 1
    # (each item of a tuple argument, an operand's bundle, likewise at its path).
    aligned = [["tt.divisibility", 16]]

    def kind(value, path: tuple[int, ...], no_spec: bool, no_align: bool):
        if isinstance(value, tuple):
            return tuple(kind(item, (*path, i), no_spec, no_align) for i, item in enumerate(value))
        if isinstance(value, torch.Tensor):
            attrs[path] = aligned
            return _TORCH_TO_TRITON[value.dtype]
        if isinstance(value, float):
            return "fp32"
        if int(value) == 1 and not no_spec:
            constexprs[path] = 1
            return "constexpr"
        if int(value) % 16 == 0 and not (no_spec or no_align):
            attrs[path] = aligned
        return "i64" if abs(int(value)) >= 2**31 else "i32"

    for index, (name, param) in enumerate(zip(kernel.arg_names, kernel.params, strict=True)):
        # A defaulted parameter the launch leaves out (USE_PDL) compiles with its default.
        value = kwargs[name] if name in kwargs else param.default
        if name in constexpr_names:
            signature[name] = "constexpr"
            constexprs[(index,)] = value
        else:
            signature[name] = kind(value, (index,), param.do_not_specialize,
                                   param.do_not_specialize_on_alignment)
    options = {k: kwargs[k] for k in ("num_warps", "num_stages", "maxnreg") if kwargs.get(k) is not None}
    binary = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=HOPPER, options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(binary.asm["cubin"])
        f.flush()
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True,
                               text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    local = re.search(r"LOCAL:(\d+)", usage)
    return {"shared": binary.metadata.shared, "regs": int(regs.group(1)) if regs else -1,
            "spill_bytes": max(int(stack.group(1)) if stack else 0, int(local.group(1)) if local else 0)}


def gemm_launches(model: str, m: int, rank: int, adapters: int, cfg: MoEConfig, splits: int = 4
                  ) -> list[tuple[str, dict]]:
    """The base and LoRA launches of both GEMMs at M tokens, as caught keyword arguments; the split
    variants read ``splits`` shrink partials (1: as after ``reduce_shrink_splits``). The split and ext
    variants take the tiles the split layer runs at this rank and adapter count (``cfg.for_lora``: an
    entry's ``"lora"``, ``"lora_by_rank"`` or, from two adapters, ``"lora_multi_by_rank"`` tiles), the base
    and fused ones the entry's own."""
    shape = MODELS[model]
    E, k, H, inter = shape.E, shape.top_k, shape.H, shape.I
    meta = dict(device="meta")
    bf16 = dict(dtype=torch.bfloat16, **meta)
    pairs = m * k

    def alignment(block_m: int) -> dict:
        max_padded = pairs + E * (block_m - 1)
        return dict(sorted_ids=torch.empty(max_padded, dtype=torch.int32, **meta),
                    expert_ids=torch.empty(triton.cdiv(max_padded, block_m), dtype=torch.int32, **meta),
                    num_post_padded=torch.empty(1, dtype=torch.int32, **meta))

    x = torch.empty(m, H, **bf16)
    w13, w2 = torch.empty(E, 2 * inter, H, **bf16), torch.empty(E, H, inter, **bf16)
    act, out = torch.empty(pairs, inter, **bf16), torch.empty(pairs, H, **bf16)
    weights = torch.empty(pairs, dtype=torch.float32, **meta)
    rb, slots = lora_rank_block(rank), 8
    common = dict(token_slots=torch.empty(m, dtype=torch.int32, **meta),
                  slot_ranks=torch.empty(slots, dtype=torch.int32, **meta),
                  slot_scalings=torch.empty(slots, dtype=torch.float32, **meta),
                  top_k=k, rank_block=rb, num_adapters=adapters)
    gate_up = LoRAOperands(lora_a=torch.empty(slots, E, 2 * rank, H, **bf16),
                           lora_b=torch.empty(slots, E, 2 * inter, rank, **bf16), **common)
    down = LoRAOperands(lora_a=torch.empty(slots, E, rank, inter, **bf16),
                        lora_b=torch.empty(slots, E, H, rank, **bf16), **common)
    split_gate_up = replace(gate_up, shrunk=torch.empty(pairs, splits, 2 * rb, dtype=torch.float32, **meta))
    split_down = replace(down, shrunk=torch.empty(pairs, splits, rb, dtype=torch.float32, **meta))
    ext_gate_up = replace(gate_up, packed=torch.empty(pairs, 2 * rb, **bf16))
    ext_down = replace(down, packed=torch.empty(pairs, rb, **bf16))
    fused_cfg = _with_lora_tiles(cfg, rank_block=rb)
    split_cfg = cfg.for_lora(rb, adapters)
    variants = [
        ("gemm1 base", cfg.gemm1, None), ("gemm2 base", cfg.gemm2, None),
        ("gemm1 split", split_cfg.gemm1, split_gate_up), ("gemm2 split", split_cfg.gemm2, split_down),
        ("gemm1 ext", split_cfg.gemm1, ext_gate_up), ("gemm2 ext", split_cfg.gemm2, ext_down),
        ("gemm1 fused", fused_cfg.gemm1, gate_up), ("gemm2 fused", fused_cfg.gemm2, down),
    ]
    if pairs <= SINGLE_PROGRAM_MAX_PAIRS:  # decode: GEMM1's epilogue may also write GEMM2's shrink
        tiles = triton.cdiv(inter, split_cfg.gemm1.block_n)
        with_down = replace(split_gate_up, down_a=down.lora_a,
                            down_shrunk=torch.empty(pairs, tiles, rb, dtype=torch.float32, **meta))
        variants.insert(3, ("gemm1 split+down", split_cfg.gemm1, with_down))
    caught = _CaughtLaunch(fused_moe._fused_moe_kernel)
    real, fused_moe._fused_moe_kernel = fused_moe._fused_moe_kernel, caught
    real_wave, plan._fits_one_wave = plan._fits_one_wave, lambda programs, device: (
        programs <= HOPPER_SMS)
    try:
        out_launches = []
        for name, gemm, lora in variants:
            align = alignment(gemm.block_m)
            if name.startswith("gemm1"):
                invoke_fused_moe_kernel(x, w13, act, topk_weights=None, a_row_div=k, config=gemm,
                                        activation="silu", lora=lora, **align)
            else:
                invoke_fused_moe_kernel(act, w2, out, topk_weights=weights, a_row_div=1, config=gemm,
                                        lora=lora, **align)
            out_launches.append((name, caught.launches[-1]))
    finally:
        fused_moe._fused_moe_kernel = real
        plan._fits_one_wave = real_wave
    return out_launches


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("resource_report.py compiles kernels for the GPU: unset TRITON_INTERPRET")
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--M", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="LoRA variants whose name contains one of "
                        "these (e.g. fused, split+down); the base GEMMs are always compiled, for comparison")
    parser.add_argument("--splits", type=int, default=4, help="shrink partials the split variants read "
                        "(1: reduced once by reduce_shrink_splits)")
    parser.add_argument("--device-name", default="NVIDIA_H200",
                        help="whose tuned JSON to read (triton_ops/configs); 'none' for the heuristic")
    args = parser.parse_args()
    failures = 0
    base_blocks: dict[str, int] = {}
    variant_names = {value.value: name.removeprefix("LORA_").lower()
                     for name, value in vars(lora_epilogues).items()
                     if name.startswith("LORA_") and isinstance(value, tl.constexpr)}
    for model in args.model:
        shape = MODELS[model]
        for m in args.M:
            cfg = None if args.device_name == "none" else tuned_moe_config(
                m, shape.E, shape.I, torch.bfloat16, args.device_name)
            cfg = cfg or default_moe_config(m, shape.E, shape.H, shape.I, shape.top_k, torch.bfloat16)
            for name, kwargs in gemm_launches(model, m, args.rank, args.adapters, cfg, args.splits):
                if args.only and not name.endswith("base") and not any(o in name for o in args.only):
                    continue
                report = compile_launch(fused_moe._fused_moe_kernel, kwargs)
                fits = report["shared"] <= MAX_SHARED_BYTES
                failures += not fits
                blocks = blocks_per_sm(report["shared"], report["regs"], kwargs["num_warps"])
                gemm = name.split()[0]
                if name.endswith("base"):
                    base_blocks[gemm] = blocks
                # A LoRA variant resident fewer times per SM than its base runs more waves at prefill.
                fewer = blocks < base_blocks.get(gemm, 0)
                block_m, block_n, block_k = kwargs["TILE"][:3]
                print(f"{model:17s} M={m:5d} {name:16s} {block_m:3d}x{block_n:3d}x"
                      f"{block_k:3d} w{kwargs['num_warps']} s{kwargs['num_stages']} "
                      f"{variant_names[kwargs['LORA_PLAN'][0]]:11s}"
                      f"smem {report['shared'] / 1024:6.1f} KiB{'' if fits else ' > 227 KiB!'}  "
                      f"regs {report['regs']:3d}  spill {report['spill_bytes']:4d} B  "
                      f"{blocks} blocks/SM{f' (base: {base_blocks[gemm]})' if fewer else ''}", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    main()
