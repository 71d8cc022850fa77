"""Lazy Triton kernels (kiln.kernels.triton.lazy): importing the kernels, and running them from
installed binaries, imports no Triton; a kernel's call key is the same before and after it
materializes; a materialized kernel finds the helpers it imports from another module, both
interpreted and compiled (to a cubin, which needs no GPU)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import kiln
from kiln.kernels.triton import binary, lazy, norm

ROOT = Path(kiln.__file__).resolve().parents[1]


def _python(code: str, cwd=None, **env) -> str:
    """Run ``code`` in a fresh interpreter (kiln from this checkout); its stdout."""
    path = os.pathsep.join(p for p in (str(ROOT), str(cwd or ""), os.environ.get("PYTHONPATH"))
                           if p)
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd,
                       env=dict(os.environ, PYTHONPATH=path, **env), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip().splitlines()[-1]


_TRITON_MODULES = "sorted(m for m in sys.modules if m.split('.')[0] == 'triton')"


def test_import_kernels_imports_no_triton():
    out = _python(f"""
        import sys
        import kiln, kiln.kernels.triton
        from kiln.kernels.triton import binary
        binary.triton_abi(), binary.usable({{"digest": binary.kernels_digest()}})
        print({_TRITON_MODULES})
    """)
    assert out == "[]"


def test_kernels_run_from_installed_binaries_import_no_triton():
    """Every call answered by an installed binary (faked: nothing runs): the host code of the
    kernels, a generated pointwise kernel's module included, imports no Triton."""
    out = _python(f"""
        import sys
        import torch
        from kiln.kernels.registry import Call
        from kiln.kernels.triton import attention, binary, gemm, norm, pointwise, softmax
        from kiln.ops import nn as N

        launched = []
        fake = binary.Binary(name="k", cubin=b"", num_warps=1, shared=0, args=[])
        fake.launch = lambda k, grid, a, kw: launched.append(binary._info(k)[0].split(":")[0])

        class Every(dict):  # an installed binary for every call
            def get(self, key, default=None):
                return fake

        binary._TABLE = Every(any=fake)
        x, h = torch.randn(4, 32), torch.randn(2, 2, 8, 16).half()
        norm.layer_norm(Call(N.LayerNormalization.make_attrs(axis=-1), 1, 4), x,
                        torch.ones(32), torch.zeros(32))
        softmax.softmax(Call(N.Softmax.make_attrs(axis=-1), 1, 4), x)
        program = pointwise.Program.from_json({{"inputs": 2, "outputs": ["t1"], "ops": [
            {{"op": "Add", "in": ["i0", "i1"]}}, {{"op": "Gelu", "in": ["t0"]}}]}})
        pointwise.run(program, [x, x], [torch.float32])
        gemm.matmul(Call(N.MatMul.make_attrs(), 1, 4), x.half(), x.half().T.contiguous())
        attention.flash_attention(None, h, h, h)
        print(launched, {_TRITON_MODULES})
    """, TRITON_INTERPRET="1")  # the interpreter's on_device: CPU tensors are accepted
    assert out == ("['_norm_kernel', '_softmax_kernel', 'pointwise_kernel', '_gemm_kernel', "
                   "'_attn_kernel'] []")


def test_call_key_same_before_and_after_materializing():
    from triton.runtime.jit import JITFunction

    fn = norm._norm_kernel.fn
    kernel = lazy.jit(fn)
    x = torch.zeros(64, dtype=torch.float16)
    args, kw = (x, x, x, x, 32, 32, 64, 1e-5), dict(HAS_B=True, RMS=False, BLOCK=64,
                                                   ONE_BLOCK=True, num_warps=2)
    before = binary.call_key(kernel, args, kw)
    assert kernel._real is None  # computing the key made nothing
    real = kernel.materialize()
    assert real is not kernel and not isinstance(real, lazy.LazyJIT)
    assert binary.call_key(real, args, kw) == before == binary.call_key(kernel, args, kw)
    assert binary.call_key(norm._norm_kernel, args, kw) == before  # the module's own
    # and the id is what Triton's own JITFunction says of the source and the constexprs
    jf = JITFunction(fn)
    kid, names, constexpr = binary._info(kernel)
    assert kid == f"_norm_kernel:{hashlib.sha1(jf.src.encode()).hexdigest()[:16]}"
    assert names == tuple(jf.arg_names)
    assert constexpr == tuple(p.is_constexpr for p in jf.params)


_HELPER_USER = '''
from __future__ import annotations

from kiln.kernels.triton.common import act, gelu
from kiln.kernels.triton.lazy import jit, tl


@jit
def gelus_kernel(X, Y, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(X + i, mask=m, other=0.0)
    tl.store(Y + i, gelu(x) + act(x, ACT, 0.0, 0.0), mask=m)
'''


def test_kernel_calling_helpers_of_another_module_runs_interpreted(tmp_path):
    """gelu and act (which calls gelu_tanh, which calls tanh) come from common.py, still lazy
    when the kernel first runs."""
    (tmp_path / "helper_user.py").write_text(_HELPER_USER)
    out = _python("""
        import torch
        from kiln.kernels.triton import binary, common, lazy
        import helper_user

        assert isinstance(common.__dict__["gelu"], lazy.LazyJIT)
        x = torch.linspace(-3, 3, 50)
        y = torch.empty_like(x)
        binary.launch(helper_user.gelus_kernel, (2,), x, y, 50, ACT=7, BLOCK=32)
        want = torch.nn.functional.gelu(x) + torch.nn.functional.gelu(x, approximate="tanh")
        torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
        assert not isinstance(common.__dict__["gelu"], lazy.LazyJIT)
        assert type(common.__dict__["tl"]).__name__ == "module"
        print("ok")
    """, cwd=tmp_path, TRITON_INTERPRET="1")
    assert out == "ok"


def test_kernel_calling_helpers_of_another_module_compiles(tmp_path):
    """The same kernel through Triton's compiler, to an sm_90 cubin (no GPU needed): the
    materialized globals are ones Triton's code generator accepts."""
    pytest.importorskip("triton.backends.nvidia", reason="needs Triton's NVIDIA backend")
    (tmp_path / "helper_user.py").write_text(_HELPER_USER)
    (tmp_path / "cache").mkdir()
    out = _python("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        import helper_user

        fn = helper_user.gelus_kernel.materialize()
        src = ASTSource(fn, {"X": "*fp32", "Y": "*fp32", "n": "i32", "ACT": "constexpr",
                             "BLOCK": "constexpr"}, {"ACT": 7, "BLOCK": 128})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32))
        print(k.metadata.name, len(k.asm["cubin"]) > 0)
    """, cwd=tmp_path, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"),
                  TRITON_DEFAULT_FP_FUSION="1")
    assert out == "gelus_kernel True"


def test_every_kernel_materializes_with_globals_triton_accepts():
    """Triton's dependency walk (its cache key) refuses a global that is neither a module, a
    JITFunction nor a constexpr: every kiln kernel, a generated pointwise one too, passes it."""
    out = _python("""
        import importlib, pkgutil
        import kiln.kernels.triton as pkg
        from kiln.kernels.triton import lazy, pointwise

        kernels = {}
        for m in pkgutil.iter_modules(pkg.__path__):
            mod = importlib.import_module(f"kiln.kernels.triton.{m.name}")
            kernels.update({f"{m.name}.{k}": v for k, v in vars(mod).items()
                            if isinstance(v, lazy.LazyJIT)})
        program = pointwise.Program.from_json({"inputs": 1, "outputs": ["t0"], "ops": [
            {"op": "Gelu", "in": ["i0"]}]})
        kernels["generated"] = pointwise.compile_source(
            pointwise.generate(program, ("f",), (False,), 1))
        for name, k in sorted(kernels.items()):
            k.materialize().cache_key  # raises on a global Triton does not accept
        print(len(kernels), [n for n, k in kernels.items() if type(k.materialize()).__name__
                             != "JITFunction"])
    """, TRITON_INTERPRET="0")
    n, odd = out.split(" ", 1)
    assert int(n) >= 15 and odd == "[]"
