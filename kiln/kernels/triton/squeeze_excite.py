"""kiln::SqueezeExcite on CUDA in three Triton kernels, no CUDA library::

    s[n, c]   = mean over H, W of x[n, c]                       (_se_pool: [N, C] in fp32)
    g[n, c]   = gate(W2 @ act(W1 @ s[n] + b1) + b2)[c]         (_se_mlp: one program a sample)
    y[n, c, h, w] = x[n, c, h, w] * g[n, c]                     (_se_scale)

PyTorch's kernel runs the block as about ten small launches (mean, the two products as
multiply-sums below cuBLAS's size, the biases, the activation, the gate's three steps, the
product); in a fresh process each of those is a first launch of a PyTorch kernel module, and at
batch 1 each a launch of a few microseconds in a MobileNetV3 of eight such blocks. These three
travel in the engine file like every other Triton kernel. x is read through its strides (NCHW or
channels-last; coalesced on channels-last, which CUDA engines use); the output keeps x's layout.
"""

from __future__ import annotations

import torch

from kiln.kernels.registry import register
from kiln.kernels.torch import squeeze_excite as torch_se
from kiln.kernels.triton.common import ACT_CODE, FLOATS, act, launch, next_pow2, on_device
from kiln.kernels.triton.lazy import cdiv, jit, tl
from kiln.ops import fused_conv as FC

_GATES = {"Sigmoid": 0, "HardSigmoid": 1}
_MAX_HIDDEN = 1024  # the reduced width the MLP keeps in registers (MobileNetV3: <= 240)


@jit(do_not_specialize=["HW", "W"])
def _se_pool(X, S, C, HW, W, s_n, s_c, s_h, s_w, inv_hw,
             BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    rc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = rc < C
    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    for p0 in range(0, HW, BLOCK_P):
        rp = p0 + tl.arange(0, BLOCK_P)
        off = (rp // W).to(tl.int64) * s_h + (rp % W).to(tl.int64) * s_w
        x = tl.load(X + n * s_n + off[:, None] + rc[None, :].to(tl.int64) * s_c,
                    mask=(rp < HW)[:, None] & c_ok[None, :], other=0.0)
        acc += x.to(tl.float32)
    tl.store(S + n * C + rc, tl.sum(acc, axis=0) * inv_hw, mask=c_ok)


@jit
def _se_mlp(S, W1, B1, W2, B2, G, C, CR, alpha, beta,
            HAS_B1: tl.constexpr, HAS_B2: tl.constexpr, ACT: tl.constexpr, GATE: tl.constexpr,
            BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    rr = tl.arange(0, BLOCK_R)
    r_ok = rr < CR
    hid = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):  # hid = W1 @ s: W1 [CR, C] row-major
        rc = c0 + tl.arange(0, BLOCK_C)
        c_ok = rc < C
        s = tl.load(S + n * C + rc, mask=c_ok, other=0.0)
        w1 = tl.load(W1 + rr[:, None] * C + rc[None, :], mask=r_ok[:, None] & c_ok[None, :],
                     other=0.0).to(tl.float32)
        hid += tl.sum(w1 * s[None, :], axis=1)
    if HAS_B1:
        hid += tl.load(B1 + rr, mask=r_ok, other=0.0).to(tl.float32)
    hid = tl.where(r_ok, act(hid, ACT, 0.0, 0.0), 0.0)
    for c0 in range(0, C, BLOCK_C):  # g = W2 @ hid: W2 [C, CR] row-major
        rc = c0 + tl.arange(0, BLOCK_C)
        c_ok = rc < C
        w2 = tl.load(W2 + rc[:, None] * CR + rr[None, :], mask=c_ok[:, None] & r_ok[None, :],
                     other=0.0).to(tl.float32)
        g = tl.sum(w2 * hid[None, :], axis=1)
        if HAS_B2:
            g += tl.load(B2 + rc, mask=c_ok, other=0.0).to(tl.float32)
        if GATE == 1:  # HardSigmoid: max(0, min(1, alpha * g + beta))
            g = tl.minimum(tl.maximum(alpha * g + beta, 0.0), 1.0)
        else:
            g = 1.0 / (1.0 + tl.exp(-g))
        tl.store(G + n * C + rc, g, mask=c_ok)


@jit(do_not_specialize=["HW", "W"])
def _se_scale(X, G, Y, C, HW, W, s_n, s_c, s_h, s_w,
              BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    rp = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    rc = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = rc < C
    mask = (rp < HW)[:, None] & c_ok[None, :]
    off = (n * s_n + (rp // W).to(tl.int64) * s_h + (rp % W).to(tl.int64) * s_w)[:, None] \
        + rc[None, :].to(tl.int64) * s_c
    x = tl.load(X + off, mask=mask, other=0.0)
    g = tl.load(G + n * C + rc, mask=c_ok, other=0.0)
    tl.store(Y + off, (x.to(tl.float32) * g[None, :]).to(Y.dtype.element_ty), mask=mask)


def supports(n, inputs) -> bool:
    x, w1 = inputs[0], inputs[1]
    b1 = inputs[2] if len(inputs) > 2 else None
    w2 = inputs[3] if len(inputs) > 3 else None
    b2 = inputs[4] if len(inputs) > 4 else None
    a = n.a
    if w2 is None or not on_device(x, w1, b1, w2, b2) or x.dim() != 4 or x.numel() == 0:
        return False
    if x.dtype not in FLOATS or a.gate not in _GATES or a.activation not in ACT_CODE:
        return False
    c, cr = x.shape[1], w1.shape[0]
    if w1.numel() != cr * c or w2.numel() != c * cr or cr > _MAX_HIDDEN:
        return False
    if any(b is not None and b.numel() != k for b, k in ((b1, cr), (b2, c))):
        return False
    # dense x (NCHW or channels-last): the output is made with the same strides
    return x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)


@register(FC.SqueezeExcite, backend="cuda", name="TritonSqueezeExcite", supports=supports)
def squeeze_excite(n, x, w1, b1=None, w2=None, b2=None):
    if not supports(n, (x, w1, b1, w2, b2)):
        return torch_se.squeeze_excite(n, x, w1, b1, w2, b2)
    a = n.a
    nb, c, h, w = x.shape
    cr = w1.shape[0]
    hw = h * w
    st = x.stride()
    s = torch.empty((nb, c), dtype=torch.float32, device=x.device)
    g = torch.empty((nb, c), dtype=torch.float32, device=x.device)
    y = torch.empty_like(x)  # x's layout and strides
    bc = min(64, next_pow2(c))
    launch(_se_pool, (nb, cdiv(c, bc)), x, s, c, hw, w, st[0], st[1], st[2], st[3], 1.0 / hw,
           BLOCK_P=32, BLOCK_C=bc, num_warps=4)
    w1f = w1.reshape(cr, c).contiguous()
    w2f = w2.reshape(c, cr).contiguous()
    br = max(16, next_pow2(cr))
    launch(_se_mlp, (nb,), s, w1f, w1f if b1 is None else b1.reshape(-1), w2f,
           w2f if b2 is None else b2.reshape(-1), g, c, cr, float(a.alpha or 0.0),
           float(a.beta or 0.0), HAS_B1=b1 is not None, HAS_B2=b2 is not None,
           ACT=ACT_CODE[a.activation], GATE=_GATES[a.gate], BLOCK_R=br,
           BLOCK_C=max(16, min(64, 4096 // br)), num_warps=4)
    bp = 32
    launch(_se_scale, (nb, cdiv(hw, bp), cdiv(c, bc)), x, g, y, c, hw, w, st[0], st[1], st[2],
           st[3], BLOCK_P=bp, BLOCK_C=bc, num_warps=4)
    return y
