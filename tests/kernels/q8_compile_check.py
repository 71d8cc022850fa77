"""Compile kiln's INT8/FP8 Triton kernels for an H100/H200 (sm90) without a GPU and report
what each became: ``python -m tests.kernels.q8_compile_check`` (run by
test_q8_compile_sm90.py in a fresh process, where the kernels are not interpreted).

Triton's interpreter runs code a compiled kernel refuses (returns of two types from one
function did, in ``quantize8``), so the interpreter tests alone do not show that a kernel
builds for the GPU. Prints one JSON line per kernel form: ``{"kernel", "form", "wgmma",
"pipelined", "shared"}``, or ``"error"``.
"""

from __future__ import annotations

import json
import os
import re

os.environ["TRITON_INTERPRET"] = "0"


def _compile(lazy, sig: dict, consts: dict, aligned, num_warps: int, num_stages: int):
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = lazy.materialize() if hasattr(lazy, "materialize") else lazy
    names = list(inspect.signature(fn.fn).parameters)  # the kernel's order: indices below
    assert set(names) == set(sig) | set(consts), set(names) ^ (set(sig) | set(consts))
    full = {n: sig.get(n, "constexpr") for n in names}
    consts = {n: consts[n] for n in names if n in consts}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn, full, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def _report(name, form, build, *args):
    try:
        k = build(*args)
    except Exception as e:  # the innermost cause names the line
        while e.__cause__ or e.__context__:
            e = e.__cause__ or e.__context__
        return {"kernel": name, "form": form, "error": f"{type(e).__name__}: {str(e)[-300:]}"}
    return {"kernel": name, "form": form, "wgmma": "wgmma" in k.asm["ptx"],
            "pipelined": bool(re.search("async_copy|async_tma", k.asm["ttgir"])),
            "shared": k.metadata.shared}


def gemm(fp8: bool, x_codes: bool, out_codes: bool):
    from kiln.kernels.triton import int8_gemm as G

    code = "*fp8e4nv" if fp8 else "*i8"
    sig = dict(X=code if x_codes else "*fp16", W=code, Y=code if out_codes else "*fp16",
               WS="*fp32", CS="*fp32" if fp8 else "*i32", Bias="*fp16", R="*fp16", M="i32",
               N="i32", K="i32", s_xm="i32", s_wn="i32", s_ym="i32", s_rm="i32",
               x_scale="fp32", zshift="fp32", zint="i32", act_a="fp32", act_b="fp32",
               out_scale="fp32", out_shift="fp32")
    consts = dict(s_xk=1, s_wk=1, s_yn=1, s_rn=1, FP8=fp8, X_CODES=x_codes,
                  OUT_CODES=out_codes, EXACT=False, EVEN_K=True, HAS_BIAS=True,
                  HAS_RES=not out_codes, ACT=6 if out_codes else 0, BLOCK_M=128,
                  BLOCK_N=256, BLOCK_K=128, GROUP_M=8)
    aligned = [n for n, t in sig.items() if t.startswith("*")] + ["M", "N", "K", "s_xm",
                                                                   "s_wn", "s_ym", "s_rm"]
    return _compile(G._q8_gemm_kernel, sig, consts, aligned, 8, 3)


def conv(flat: bool, x_codes: bool, out_codes: bool):
    from kiln.kernels.triton import int8_conv as C

    sig = dict(X="*i8" if x_codes else "*fp16", Wt="*i8", Y="*i8" if out_codes else "*fp16",
               WS="*fp32", CS="*i32", Bias="*fp16", R="*fp16",
               **{n: "i32" for n in ("H", "W", "C", "OH", "OW", "CO", "M", "stride_h",
                                     "stride_w", "pad_h", "pad_w", "dil_h", "dil_w")},
               act_a="fp32", act_b="fp32", x_scale="fp32", zshift="fp32", zint="i32",
               out_scale="fp32", out_shift="fp32")
    k = 7 if flat else 3
    consts = dict(KH=k, KW=k, FLAT=flat, X_CODES=x_codes, OUT_CODES=out_codes, EXACT=False,
                  HAS_BIAS=True, HAS_RES=not out_codes, ACT=1, BLOCK_M=128, BLOCK_N=128,
                  BLOCK_K=64, GROUP_M=8)
    aligned = [n for n, t in sig.items() if t.startswith("*")] + ["C", "CO"]
    return _compile(C._q8_conv_kernel, sig, consts, aligned, 8, 3)


def norm(fp8: bool):
    from kiln.kernels.triton import norm as NM

    sig = dict(X="*fp16", W="*fp32", B="*fp32", Y="*fp16", R="*fp16",
               Q="*fp8e4nv" if fp8 else "*i8", QM="*fp32", stride_x="i32", stride_y="i32",
               stride_r="i32", n_cols="i32", eps="fp32", zshift="i32")
    consts = dict(HAS_B=True, RMS=False, BLOCK=1024, ONE_BLOCK=True, HAS_R=False, QUANT=True,
                  FP8=fp8, EXACT=False)
    return _compile(NM._norm_kernel, sig, consts, ["X", "W", "B", "Y", "R", "Q", "QM"], 4, 1)


def codes(fp8: bool, encode: bool):
    from kiln.kernels.triton import int8_gemm as G

    c = "*fp8e4nv" if fp8 else "*i8"
    sig = dict(X="*fp16", Y=c if encode else "*fp16", n_elems="i32", scale="fp32",
               shift="fp32")
    consts = dict(FP8=fp8, X_CODES=False, ENCODE=encode, EXACT=False, BLOCK=2048)
    return _compile(G._codes_kernel, sig, consts, ["X", "Y"], 4, 1)


def main() -> int:
    rows = []
    for fp8 in (False, True):
        for xc, oc in ((False, False), (True, True), (False, True)):
            rows.append(_report("gemm", dict(fp8=fp8, x_codes=xc, out_codes=oc),
                                gemm, fp8, xc, oc))
    for flat, xc, oc in ((False, False, False), (False, True, True), (True, False, True)):
        rows.append(_report("conv", dict(flat=flat, x_codes=xc, out_codes=oc),
                            conv, flat, xc, oc))
    for fp8 in (False, True):
        rows.append(_report("layernorm_quant", dict(fp8=fp8), norm, fp8))
        rows.append(_report("codes", dict(fp8=fp8, encode=True), codes, fp8, True))
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
