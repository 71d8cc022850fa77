"""fuse_matmul_layernorm (CPU builds): FusedMatMul -> LayerNormalization -> FusedMatMulLayerNorm.

The product is first made a FusedMatMul (with its bias and residual) by fuse_matmul_add and
fuse_conv_bias_act, as the pipeline does; each test runs those and then the pass under test,
and `apply` checks the outputs before and after."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln import native
from kiln.kernels.registry import Call
from kiln.kernels.torch import fused_conv as FCK
from kiln.ops import fused_conv as FC
from kiln.passes.fusion.conv_bias_act import fuse_conv_bias_act
from kiln.passes.fusion.matmul_add import fuse_matmul_add
from kiln.passes.fusion.matmul_norm import fuse_matmul_layernorm
from kiln.passes.pipeline import _passes
from tests.passes.transformer_util import RNG, apply, c, feeds, model, node

K, N = 6, 8


def _fused_then(fn):
    """fuse_matmul_add + fuse_conv_bias_act (quietly), then ``fn`` (logged)."""
    def run(g, log):
        fuse_matmul_add(g, lambda m: None)
        fuse_conv_bias_act(g, lambda m: None)
        return fn(g, log)
    return run


def _block(*, residual=True, ln_bias=True, axis=-1, outputs=("y",), scale_input=False,
           mean_output=False, scale=None):
    """x @ W + b (+ r) -> LayerNormalization(scale, bias): a BERT post-norm block."""
    inits = {"W": c(RNG.standard_normal((K, N))), "b": c(RNG.standard_normal(N)),
             "s": c(RNG.standard_normal(N)) if scale is None else scale,
             "lb": c(RNG.standard_normal(N))}
    inputs = {"x": ["batch", 5, K]}
    if residual:
        inputs["r"] = ["batch", 5, N]
    if scale_input:
        inputs["s"] = [N]
        del inits["s"]
    nodes = [node("MatMul", ["x", "W"], "t", name="mm"), node("Add", ["t", "b"], "u", name="add")]
    last = "u"
    if residual:
        nodes.append(node("Add", ["u", "r"], "v", name="res"))
        last = "v"
    ln_outs = ["y", "mean"] if mean_output else ["y"]
    nodes.append(node("LayerNormalization", [last, "s"] + (["lb"] if ln_bias else []), ln_outs,
                      name="ln", axis=axis, epsilon=1e-6))
    return model(nodes, inputs, list(outputs), inits)


def _feeds(residual=True, scale_input=False):
    shapes = {"x": [3, 5, K]}
    if residual:
        shapes["r"] = [3, 5, N]
    if scale_input:
        shapes["s"] = [N]
    return feeds(**shapes)


def test_fuses_post_norm_block_structure():
    g, before, after, n, logs = apply(_block(), _fused_then(fuse_matmul_layernorm), _feeds())
    (f,) = g.nodes
    assert n == 1 and logs == ["fused mm + add + res + ln -> FusedMatMulLayerNorm"]
    assert f.op is FC.FusedMatMulLayerNorm and f.name == "mm + add + res + ln"
    assert f.attrs.has_residual == 1 and f.attrs.epsilon == pytest.approx(1e-6)
    x, w, b, r, s, lb = f.inputs
    assert x is g.inputs[0] and r is g.inputs[1] and w.name == "W"
    assert b.const.shape == (N,) and s.name == "s" and lb.name == "lb"
    assert f.outputs[0] is g.outputs[0]
    assert before == {"Add": 2, "LayerNormalization": 1, "MatMul": 1}
    assert after == {"FusedMatMulLayerNorm": 1}


def test_fuses_without_residual_or_norm_bias_counts():
    m = _block(residual=False, ln_bias=False)
    g, _, after, n, _ = apply(m, _fused_then(fuse_matmul_layernorm), _feeds(residual=False))
    assert n == 1 and after == {"FusedMatMulLayerNorm": 1}
    f = g.nodes[0]
    assert len(f.inputs) == 5 and f.inputs[3] is None and f.attrs.has_residual == 0


def test_fuses_last_axis_given_positively():
    m = _block(axis=2)
    _, _, after, n, _ = apply(m, _fused_then(fuse_matmul_layernorm), _feeds())
    assert n == 1 and after == {"FusedMatMulLayerNorm": 1}


@pytest.mark.parametrize("case", ["product_is_output", "norm_not_last_axis", "mean_wanted",
                                  "scale_not_constant"])
def test_no_fuse(case):
    kw = {"product_is_output": dict(outputs=("y", "v")),
          "norm_not_last_axis": dict(axis=1),
          "mean_wanted": dict(mean_output=True, outputs=("y", "mean")),
          "scale_not_constant": dict(scale_input=True)}[case]
    m = _block(**kw)
    fd = _feeds(scale_input=case == "scale_not_constant")
    _, _, after, n, _ = apply(m, _fused_then(fuse_matmul_layernorm), fd)
    assert n == 0 and "FusedMatMulLayerNorm" not in after
    assert after.get("LayerNormalization") == 1


def test_pipeline_runs_it_on_cpu_only():
    """CPU builds, after the epilogue fusions whose FusedMatMul it takes; CUDA builds not yet
    (their kernel awaits a GPU run: see kiln.passes.pipeline)."""
    cpu = [name for name, _ in _passes("cpu")]
    cuda = [name for name, _ in _passes("cuda")]
    assert "fuse_matmul_layernorm" in cpu and "fuse_matmul_layernorm" not in cuda
    assert cpu.index("fuse_conv_bias_act") < cpu.index("fuse_matmul_layernorm")


def test_cuda_builds_fuse_it_with_the_setting(monkeypatch):
    """KILN_CUDA_MATMUL_NORM=1 (Settings.cuda_matmul_norm): CUDA builds run the pass too, after
    the epilogue fusions, and none of the CPU-only ones with it (act_affine, packed_qkv)."""
    import dataclasses

    from kiln import settings

    assert settings.Settings.from_env({"KILN_CUDA_MATMUL_NORM": "1"}).cuda_matmul_norm
    assert not settings.Settings.from_env({}).cuda_matmul_norm
    default = {name for name, _ in _passes("cuda")}
    monkeypatch.setattr(settings, "SETTINGS",
                        dataclasses.replace(settings.SETTINGS, cuda_matmul_norm=True))
    cuda = [name for name, _ in _passes("cuda")]
    assert cuda.index("fuse_conv_bias_act") < cuda.index("fuse_matmul_layernorm")
    assert set(cuda) - default == {"fuse_matmul_layernorm"}
    from kiln.frontend import import_onnx
    from kiln.passes.pipeline import optimize

    on = optimize(import_onnx(_block()), device="cuda")
    assert [nd.op for nd in on.nodes] == [FC.FusedMatMulLayerNorm]
    monkeypatch.setattr(settings, "SETTINGS",
                        dataclasses.replace(settings.SETTINGS, cuda_matmul_norm=False))
    off = optimize(import_onnx(_block()), device="cuda")
    assert sorted(nd.op.name for nd in off.nodes) == ["FusedMatMul", "LayerNormalization"]


# ---------------------------------------------------------------- the kernel


def _call(**attrs):
    return Call(FC.FusedMatMulLayerNorm.Attrs(**attrs), n_out=1, n_in=6)


@pytest.mark.parametrize("tactic", ["linear", "kiln"])
@pytest.mark.parametrize("ln_bias", [True, False])
def test_kernel_matches_torch(monkeypatch, tactic, ln_bias):
    monkeypatch.setattr(FCK, "_choices", {})
    monkeypatch.setattr(FCK, "_FORCED", tactic)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 40, generator=g)
    w = torch.randn(40, 30, generator=g) / 40 ** 0.5
    b, r = torch.randn(30, generator=g), torch.randn(2, 9, 30, generator=g)
    s, lb = torch.randn(30, generator=g), (torch.randn(30, generator=g) if ln_bias else None)
    n = _call(activation="", has_residual=1, epsilon=1e-5)
    got = FCK.fused_matmul_layernorm(n, x, w, b, r, s, lb)
    want = F.layer_norm((x.double() @ w.double() + b.double() + r.double()), (30,), s.double(),
                        None if lb is None else lb.double(), 1e-5)
    assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())


@pytest.mark.skipif(not native.available, reason=native.why_not or "native library present")
def test_native_layer_norm_in_place_and_bad_input():
    g = torch.Generator().manual_seed(1)
    y = torch.randn(4, 7, 100, generator=g) * 3 + 2
    s, b = torch.randn(100, generator=g), torch.randn(100, generator=g)
    want = F.layer_norm(y.double(), (100,), s.double(), b.double(), 1e-5)
    out = native.layer_norm_(y, s, b, 1e-5)
    assert out is y
    assert float((y.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())
    with pytest.raises(ValueError, match=r"y \(7, 4\)"):
        native.layer_norm_(torch.randn(4, 7).t(), torch.ones(4), None, 1e-5)  # not contiguous
    with pytest.raises(ValueError, match=r"scale \(5,\)"):
        native.layer_norm_(torch.randn(3, 4), torch.ones(5), None, 1e-5)


def test_epsilon_defaults_to_onnx():
    # LayerNormalization without epsilon: ONNX's default 1e-5 goes into the fused node
    m = _block()
    for n in m.graph.node:
        if n.op_type == "LayerNormalization":
            del n.attribute[:]
    g, _, _, n, _ = apply(m, _fused_then(fuse_matmul_layernorm), _feeds())
    assert n == 1 and g.nodes[0].attrs.epsilon == pytest.approx(1e-5)
