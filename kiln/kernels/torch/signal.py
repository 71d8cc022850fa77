"""PyTorch kernels: DFT, STFT, window functions, MelWeightMatrix.

ONNX carries complex signals as real tensors with a trailing dimension of 2 (real, imaginary);
a trailing 1 means a real signal. The kernels convert to torch complex tensors, use torch.fft,
and convert back.
"""

from __future__ import annotations

import math

import torch

from kiln.ir import DType
from kiln.kernels.registry import register
from kiln.kernels.torch.convert import TORCH_DTYPE
from kiln.ops import signal as S


def _compute_dtype(x) -> torch.dtype:
    # torch.fft has no half-precision CPU kernels for arbitrary lengths: widen
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _to_complex(x):
    """[..., 1|2] real tensor -> complex tensor [...]."""
    x = x.to(_compute_dtype(x))
    if x.shape[-1] == 1:
        return torch.complex(x[..., 0], torch.zeros_like(x[..., 0]))
    if x.shape[-1] != 2:
        raise ValueError(f"signal's last dimension must be 1 or 2, got {x.shape[-1]}")
    return torch.complex(x[..., 0], x[..., 1])


def _scalar(t, default=None):
    if t is None or t.numel() == 0:
        return default
    return t.reshape(-1)[0].item()


@register(S.DFT)
def dft(n, x, dft_length=None, axis=None):
    # opset 17 has the axis as an attribute, opset 20 as input 2
    ax = int(_scalar(axis, n.a.axis))
    ax = ax + x.dim() if ax < 0 else ax
    if not 0 <= ax < x.dim() - 1:
        raise ValueError(f"DFT: axis {ax} out of range for rank {x.dim()}")
    inverse, onesided = bool(n.a.inverse), bool(n.a.onesided)
    length = _scalar(dft_length)
    if length is None:
        length = 2 * (x.shape[ax] - 1) if inverse and onesided else x.shape[ax]
    length = int(length)
    if inverse and onesided:  # one-sided spectrum -> real signal
        out = torch.fft.irfft(_to_complex(x), n=length, dim=ax).unsqueeze(-1)
        return out.to(x.dtype)
    if inverse:
        c = torch.fft.ifft(_to_complex(x), n=length, dim=ax)
    elif x.shape[-1] == 1 and onesided:
        c = torch.fft.rfft(x[..., 0].to(_compute_dtype(x)), n=length, dim=ax)
    else:
        c = torch.fft.fft(_to_complex(x), n=length, dim=ax)
        if onesided:
            c = c.narrow(ax, 0, length // 2 + 1)
    return torch.view_as_real(c).to(x.dtype)


@register(S.STFT)
def stft(n, signal, frame_step, window=None, frame_length=None):
    step = int(_scalar(frame_step))
    length = _scalar(frame_length)
    if length is None:
        length = window.shape[0] if window is not None else signal.shape[-2]
    length = int(length)
    c = _to_complex(signal)  # [batch, samples]
    frames = c.unfold(-1, length, step)  # [batch, frames, length]
    if window is not None:
        frames = frames * window.to(frames.real.dtype)
    if n.a.onesided and signal.shape[-1] == 1:
        out = torch.fft.rfft(frames.real, n=length, dim=-1)
    else:
        out = torch.fft.fft(frames, n=length, dim=-1)
        if n.a.onesided:
            out = out[..., :length // 2 + 1]
    return torch.view_as_real(out).to(signal.dtype)


def _out_dtype(code: int) -> torch.dtype:
    return TORCH_DTYPE[DType.from_onnx(code)]


def _window(n, size, coeffs: tuple[float, ...]):
    """Generalised cosine window sum_k (-1)^k a_k cos(2 pi k i / N), with N = size for
    periodic windows and size - 1 for symmetric ones."""
    size = int(_scalar(size))
    denom = size if n.a.periodic else size - 1
    i = torch.arange(size, dtype=torch.float64)
    w = torch.zeros(size, dtype=torch.float64)
    for k, ak in enumerate(coeffs):
        w = w + (-1) ** k * ak * torch.cos(2 * math.pi * k * i / denom)
    return w.to(_out_dtype(n.a.output_datatype))


@register(S.HannWindow)
def hann_window(n, size):
    return _window(n, size, (0.5, 0.5))


@register(S.HammingWindow)
def hamming_window(n, size):
    return _window(n, size, (25 / 46, 21 / 46))


@register(S.BlackmanWindow)
def blackman_window(n, size):
    return _window(n, size, (0.42, 0.5, 0.08))


def _hz_to_mel(hz):
    return 2595 * math.log10(1 + hz / 700)


@register(S.MelWeightMatrix)
def mel_weight_matrix(n, num_mel_bins, dft_length, sample_rate, lower_hz, upper_hz):
    mels, nfft = int(_scalar(num_mel_bins)), int(_scalar(dft_length))
    rate = _scalar(sample_rate)
    lo, hi = _hz_to_mel(float(_scalar(lower_hz))), _hz_to_mel(float(_scalar(upper_hz)))
    step = (hi - lo) / (mels + 2)
    hz = 700 * torch.expm1((torch.arange(mels + 2, dtype=torch.float64) * step + lo)
                           / 2595 * math.log(10))
    edges = torch.div((nfft + 1) * hz, rate, rounding_mode="floor").long()
    left, center, right = edges[:-2], edges[1:-1], edges[2:]
    j = torch.arange(nfft // 2 + 1)[:, None]
    rise_span = (center - left).clamp(min=1).double()
    fall_span = (right - center).clamp(min=1).double()
    rise = torch.where(center > left, (j - left) / rise_span, torch.ones(()).double())
    fall = (right - j) / fall_span
    in_rise = (j >= left) & (j <= center)
    in_fall = (j >= center) & (j < right)
    out = torch.where(in_fall, fall, torch.where(in_rise, rise, torch.zeros(()).double()))
    return out.to(_out_dtype(n.a.output_datatype))


