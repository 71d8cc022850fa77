"""Compile the paged decode kernels for an H100/H200 (sm90) without a GPU and report what each
form became: ``python -m tests.llm.decode_compile_check`` (run by test_decode_compile_sm90.py
in a fresh process, where Triton compiles instead of interpreting). One JSON line per form:
``{"kernel", "form", "wgmma", "mma", "pipelined", "shared"}`` or ``"error"``. The 7B shape:
32 heads, head_dim 128, blocks of 16, FP16 queries, an FP16 or FP8 cache.
"""

from __future__ import annotations

import json
import os
import re

os.environ["TRITON_INTERPRET"] = "0"

ALIGNED = ["q_ptr", "k_ptr", "v_ptr", "tables_ptr", "lens_ptr", "acc_ptr", "ml_ptr",
           "kv_scale_ptr", "stride_qb", "stride_qh", "stride_kb", "stride_kt", "stride_kh"]


def _sig(fp8: bool, direct: bool) -> dict:
    kv, out = "*fp8e4nv" if fp8 else "*fp16", "*fp16" if direct else "*fp32"
    return dict(q_ptr="*fp16", k_ptr=kv, v_ptr=kv, tables_ptr="*i32", lens_ptr="*i32",
                acc_ptr=out, ml_ptr=out, kv_scale_ptr="*fp32", stride_qb="i32",
                stride_qh="i32", stride_kb="i32", stride_kt="i32", stride_kh="i32",
                stride_tb="i32", scale="fp32", SPLITS="i32", stride_ob="i32", stride_oh="i32")


def forms():
    """(kernel name, form, jit function, constexprs, fp8, direct) of every form timed."""
    from kiln.llm import triton_attention as A

    out = []
    for fp8 in (False, True):
        for direct in (False, True):
            tag = f"{'fp8' if fp8 else 'fp16'}{' direct' if direct else ''}"
            for name, fn in (("dot", A._decode_split), ("kq", A._decode_split_kq)):
                for tile in (64, 128):
                    out.append((name, f"{tile} {tag}", fn, dict(
                        HEADS=32, GROUP=1, GROUP_PAD=16, D=128, BS=16, FP8_KV=fp8, TILE=tile,
                        DIRECT=direct), fp8, direct))
            for pf in (False, True):
                out.append(("tile", f"128{' pf' if pf else ''} {tag}", A._decode_split_tiles,
                            dict(HEADS=32, D=128, BS=16, FP8_KV=fp8, TILE=128, DIRECT=direct,
                                 PREFETCH=pf), fp8, direct))
    return out


def main():
    from tests.kernels.q8_compile_check import _compile

    for name, form, fn, consts, fp8, direct in forms():
        try:
            k = _compile(fn, _sig(fp8, direct), consts, ALIGNED, 4, 3)
        except Exception as e:  # the innermost cause names the line
            while e.__cause__ or e.__context__:
                e = e.__cause__ or e.__context__
            print(json.dumps({"kernel": name, "form": form,
                              "error": f"{type(e).__name__}: {str(e)[-300:]}"}), flush=True)
            continue
        ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
        print(json.dumps({"kernel": name, "form": form, "wgmma": "wgmma" in ptx,
                          "mma": "mma.sync" in ptx,
                          "pipelined": bool(re.search("async_copy|async_tma", ttgir)),
                          "shared": k.metadata.shared}), flush=True)


if __name__ == "__main__":
    main()
