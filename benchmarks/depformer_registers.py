"""The persistent depformer kernel compiled for sm_90 without a GPU: registers, spills, shared memory.

    python benchmarks/depformer_registers.py [--kind moshi|personaplex] [--batches 1,128]
        [--launch 64,32,64,64,64,1,8 ...]

Triton compiles the kernel of models/depformer_kernel.py at the model's depformer shapes for each
B's default launch (and each `--launch`), then its bundled `cuobjdump` reads the cubin's resource
use. 255 registers a thread is the limit at 8 warps; a stack or local size above 0 means spills.
It also counts the grid barrier's instructions in the PTX (one release add and one acquire
load a barrier). Needs Triton (the test extra), not a GPU.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent))

from frame_setup import model_configs  # noqa: E402

from parley.models import depformer_kernel as dk  # noqa: E402
from parley.models import kernels  # noqa: E402
from parley.models.transformer import gated_hidden_dim  # noqa: E402

# Argument types of _depformer_kernel that are not bf16 pointers (the weights and activations).
POINTERS = {"PREV": "*i64", "SQ": "*fp32", "SP": "*i64", "POS": "*i64", "BAR": "*i32"}
FLOATS = {"eps", "qk_scale"}
INTS = {"s_hid", "s_qkv", "s_wo", "s_wi", "s_wf", "s_kl", "s_kb", "s_kh", "s_ks", "s_sp", "B", "phase_lo",
        "phase_hi", "nprog"}


def compile_launch(cfg, launch: dk.DepformerLaunch) -> dict:
    C = cfg.depformer_dim
    nt = triton.cdiv(C, launch.block_n)
    const = dict(CT=cfg.dim, C=C, F=gated_hidden_dim(C, cfg.depformer_dim_feedforward), H=cfg.depformer_num_heads,
                 D=C // cfg.depformer_num_heads, S=cfg.dep_q, S_P2=kernels._pow2(cfg.dep_q),
                 LAYERS=cfg.depformer_num_layers, ZERO_TOKEN=-1, BM=launch.block_m, BN=launch.block_n,
                 BNW=launch.block_n_wide, BK=launch.block_k, BKL=launch.block_k_long, STAGES=launch.stages,
                 IEEE=False, NT=nt, NT_P2=kernels._pow2(nt), PER_LAYER=dk.PHASES_PER_LAYER, BARRIER=True,
                 POLLS=dk.BARRIER_POLLS)
    fn = dk._depformer_kernel
    sig = {n: "constexpr" if n in const else "fp32" if n in FLOATS else "i32" if n in INTS
           else POINTERS.get(n, "*bf16") for n in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": launch.warps, "num_stages": launch.stages})
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", usage))
    ptx = compiled.asm["ptx"]
    return {"registers": int(fields["REG"]), "stack": int(fields["STACK"]), "local": int(fields["LOCAL"]),
            "shared": compiled.metadata.shared, "release_adds": ptx.count("red.global.gpu.release"),
            "acquire_loads": ptx.count("ld.global.gpu.acquire"), "cp_async": ptx.count("cp.async")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=("moshi", "personaplex"), default="moshi")
    parser.add_argument("--batches", default="1,128", help="comma-separated B: each one's default launch")
    parser.add_argument("--launch", action="append", default=[],
                        help="also: block_m,block_n,block_n_wide,block_k,block_k_long,stages,warps (repeatable)")
    args = parser.parse_args()
    cfg = model_configs(args.kind)[0]
    launches = [(f"B={b} default", dk.depformer_launch(int(b))) for b in args.batches.split(",")]
    launches += [("--launch", dk.DepformerLaunch(*(int(v) for v in text.split(",")))) for text in args.launch]
    print(f"Triton {triton.__version__}, sm_90, {args.kind} depformer shapes")
    print("| launch | shape | registers | stack / local bytes | shared bytes | barrier release / acquire | cp.async |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, launch in launches:
        r = compile_launch(cfg, launch)
        print(f"| {name} | {','.join(map(str, launch))} | {r['registers']} | {r['stack']} / {r['local']} | "
              f"{r['shared']} | {r['release_adds']} / {r['acquire_loads']} | {r['cp_async']} |")


if __name__ == "__main__":
    main()
