"""PyTorch kernel: com.microsoft DynamicQuantizeLSTM, computed the way onnxruntime computes it,
so that results agree with it to float32 rounding rather than to quantization error.

Per direction: X (its first max(sequence_lens) steps, one set of parameters for all of them)
is quantized to uint8 with a dynamic scale and zero point (the range of the data widened to
hold 0, as DynamicQuantizeLinear), multiplied by the 8-bit W in exact integer arithmetic, and
scaled back by x_scale * W_scale (per direction or per gate column). Each step then does the
same for the previous step's output rows (h0 at step 0) against R, adds the biases and runs
the LSTM gates in float32. A reverse direction reverses each sequence within its length first,
as onnxruntime does, so every step quantizes the same rows."""

from __future__ import annotations

import numpy as np
import torch

from kiln.kernels.registry import register
from kiln.kernels.torch.quant_linear import exact_chunks
from kiln.kernels.torch.rnn import _activations, _clip
from kiln.ops import dynamic_quantize_lstm as D

_F32 = np.float32


def dynamic_params(a: torch.Tensor) -> tuple[np.float32, int]:
    """uint8 scale and zero point of ``a``'s range widened to include 0 (all float32)."""
    lo = _F32(min(float(a.min()), 0.0)) if a.numel() else _F32(0)
    hi = _F32(max(float(a.max()), 0.0)) if a.numel() else _F32(0)
    scale = _F32(1) if hi == lo else _F32((hi - lo) / _F32(255))
    zp = np.round(np.clip(_F32(0) - lo / scale, _F32(0), _F32(255)))  # half to even
    return scale, int(zp)


def _qmatmul(a: torch.Tensor, bq, mult_b: torch.Tensor) -> torch.Tensor:
    """a [M, K] float32 quantized on the fly, times bq (integers minus their zero points
    [K, N] as float32, the chunks of K over which float32 sums are exact, or float64 and
    None; and FBGEMM's packed int8 weight or None), scaled back: float32(int result) *
    (a_scale * b_scale)."""
    from kiln import native

    w, chunks, packed = bq
    packed = None if packed is None else packed()
    if packed is not None and native.available and a.dtype == torch.float32 and \
            a.is_contiguous() and a.numel():  # the codes' values in one C pass
        qa, scale, zp = native.dynamic_qdq(a)
        return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            qa, scale, zp, packed)
    scale, zp = dynamic_params(a)
    q = (torch.round(a / float(scale)) + zp).clamp_(0, 255) - zp
    if packed is not None:
        # onnxruntime's u8 x s8 product: int16 pair sums that saturate on AVX2, as FBGEMM's.
        # FBGEMM quantizes its input by multiplying with 1 / scale, which can round a tie the
        # other way: it is given the codes' own values, from which it gets the codes back
        return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            q.mul_(float(scale)), float(scale), zp, packed)
    if chunks is None:  # exact: every product and partial sum is an integer
        return (q.double() @ w).float() * (mult_b * scale)
    if len(chunks) == 1:  # one exact float32 product
        return (q @ w) * (mult_b * scale)
    acc = sum((q.narrow(1, i, size) @ w.narrow(0, i, size)).to(torch.int32)
              for i, size in chunks)
    return acc.float() * (mult_b * scale)


def _exact_f32(t: np.ndarray, codes: torch.Tensor, zp: torch.Tensor, scale: torch.Tensor):
    """Integer weights [K, N] (codes minus zero point, an int16 array) as float32 with their
    exact chunks (float64 where none), and FBGEMM's packed weight where the codes are int8
    with zero point 0 (onnxruntime's saturating u8 x s8 GEMM; exact u8 x u8 otherwise, as
    here): a function that packs it at its first call (:func:`_qmatmul`'s), as kiln's native
    recurrence and input projection do not use it (its packing was 12-30 ms of the first run)."""
    from kiln.kernels.torch import int8 as K

    chunks = exact_chunks(torch.from_numpy(np.abs(t)))
    packed = None
    if codes.dtype == torch.int8 and not bool(zp.any()) and K._HAS_FBGEMM:
        packed = _once(lambda: K._fbgemm_pack(codes, scale, None))
    return (torch.from_numpy(t.astype(_F32)), chunks, packed) if chunks else \
        (torch.from_numpy(t.astype(np.float64)), None, packed)


def _once(make):
    """``make`` as a function that calls it the first time and returns that result after."""
    got = []

    def get():
        if not got:
            got.append(make())
        return got[0]
    return get


def _weights(n, w, r, w_scale, w_zp, r_scale, r_zp):
    """(W, R) per direction as integers minus zero points [K, 4H] (float32 with exact chunks,
    see :func:`_exact_f32`) and their float32 scales [dirs, 4H], made once per node (at the
    first run: the integers are worked on in numpy, where torch's int32 and float64 widening of
    a [2, 512, 2048] pair took 20+ ms)."""
    key = (w, r, w_scale, w_zp, r_scale, r_zp)
    got = n.cache.get("dq_lstm")
    if got is None or any(a is not b for a, b in zip(got[0], key)):
        dirs, cols = w.shape[0], w.shape[2]

        def per_col(t, dtype):
            t = torch.zeros(dirs, dtype=dtype) if t is None else t.to(dtype)
            return (t.reshape(dirs, 1) if t.numel() == dirs else t.reshape(dirs, cols)).expand(
                dirs, cols)

        def ints(codes, zp):  # codes - zp, [dirs, K, 4H] int16 (8-bit codes and zero points)
            return codes.contiguous().numpy().astype(np.int16) - \
                per_col(zp, torch.int16).numpy()[:, None, :]

        ws, rs = per_col(w_scale, torch.float32), per_col(r_scale, torch.float32)
        wz, rz = per_col(w_zp, torch.int32), per_col(r_zp, torch.int32)
        wi, ri = ints(w, w_zp), ints(r, r_zp)
        wq = [_exact_f32(wi[d], w[d], wz[d], ws[d]) for d in range(dirs)]
        rq = [_exact_f32(ri[d], r[d], rz[d], rs[d]) for d in range(dirs)]
        got = n.cache["dq_lstm"] = (key, (wq, rq, ws, rs))
    return got[1]


def _reverse_within(x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """x [T, B, ...] with each batch row's first lens[b] steps reversed (an involution)."""
    if lens.numel() and bool((lens == x.shape[0]).all()):
        return x.flip(0)  # every row full length: the whole time axis
    t = torch.arange(x.shape[0])[:, None]
    idx = torch.where(t < lens[None, :], lens[None, :] - 1 - t, t)
    idx = idx.reshape(idx.shape + (1,) * (x.dim() - 2)).expand_as(x)
    return x.gather(0, idx)


@register(D.DynamicQuantizeLSTM)
def dynamic_quantize_lstm(n, x, w, r, b=None, seq_lens=None, h0=None, c0=None, p=None,
                          w_scale=None, w_zp=None, r_scale=None, r_zp=None):
    """Both directions' input projections first; then the recurrences, the native ones of a
    bidirectional layer in one C call (a direction per thread), the others one by one."""
    if w_scale is None or r_scale is None:
        raise ValueError(f"DynamicQuantizeLSTM '{n.node_name}': W_scale and R_scale are required")
    seq, batch = x.shape[0], x.shape[1]
    dirs, hid = w.shape[0], r.shape[1]
    wq, rq, ws, rs = _weights(n, w, r, w_scale, w_zp, r_scale, r_zp)
    x = x.float()
    lens = (torch.full((batch,), seq, dtype=torch.int64) if seq_lens is None
            else seq_lens.reshape(-1).long())
    steps = int(lens.max()) if batch else 0
    bias = (torch.zeros(dirs, 4 * hid) if b is None
            else b.float()[:, :4 * hid] + b.float()[:, 4 * hid:])
    acts = _activations(n.a, "LSTM", dirs)
    native_acts = _native_acts(n.a, dirs)
    y = x.new_zeros((seq, dirs, batch, hid))
    yh, yc = x.new_zeros((dirs, batch, hid)), x.new_zeros((dirs, batch, hid))
    results, native_jobs, revs = {}, {}, []
    both = _both_projections(n, x, w, w_zp, ws, lens, steps) if dirs == 2 else None
    for d in range(dirs):
        rev = d == 1 or (dirs == 1 and n.a.direction == "reverse")
        h = x.new_zeros((batch, hid)) if h0 is None else h0[d].float()
        c = x.new_zeros((batch, hid)) if c0 is None else c0[d].float()
        pd = None if p is None else p[d].float()
        if both is not None:
            xw = both[d]
        else:
            xd = _reverse_within(x, lens) if rev else x
            xw = _qmatmul(xd[:steps].reshape(-1, xd.shape[2]), wq[d], ws[d])
            xw = xw.reshape(steps, batch, 4 * hid)
        if native_acts is not None and _native_fits(n, rq[d], x):
            native_jobs[d] = _native_job(n, native_acts[d], xw, rq[d], rs[d], bias[d], pd, h,
                                         c, lens, steps)
        else:
            results[d] = _run(n, acts[d], xw, rq[d], rs[d], bias[d], pd, h, c, lens, steps)
        revs.append(rev)
    if len(native_jobs) > 1:  # both directions at once, one per thread (rnn.c)
        results.update(zip(native_jobs, _run_native_dirs(list(native_jobs.values()))))
    else:
        results.update({d: _run_native(job) for d, job in native_jobs.items()})
    for d in range(dirs):
        yd, hd, cd = results[d]
        y[:steps, d] = _reverse_within(yd, lens) if revs[d] else yd
        yh[d], yc[d] = hd, cd
    outs = (y, yh, yc)
    return outs[:max(n.n_out, 1)] if n.n_out > 1 else y


def _both_projections(n, x, w, w_zp, ws, lens, steps):
    """A bidirectional layer's two input projections as one qgemm.c call where it computes
    onnxruntime's integers (int8 W with zero point 0, on a CPU whose u8 x s8 GEMMs are exact):
    X's DynamicQuantizeLinear codes once, times [W_forward | W_backward]. The backward
    direction's rows are then put in its order: reversing a sequence within its length only
    permutes X's rows (the same range, so the same codes), so the product of the reversed X is
    the product reversed. Returns (forward, backward) [steps, B, 4H], or None."""
    from kiln import native
    from kiln.kernels.torch import int8 as K

    if not native.available or x.device.type != "cpu" or x.dtype != torch.float32 or \
            w.dtype != torch.int8 or (w_zp is not None and bool(w_zp.any())) or \
            K.u8s8_saturates() or not steps or not x.shape[1]:
        return None
    key = (w, w_zp, ws)
    got = n.cache.get("dq_lstm_both")
    if got is None or any(a is not b for a, b in zip(got[0], key)):
        wcat = torch.cat([w[0], w[1]], dim=1).contiguous()  # [in, 2 * 4H]
        scale = torch.cat([ws[0], ws[1]]).float().contiguous()
        got = n.cache["dq_lstm_both"] = (key, (native.QGemmWeight(wcat), scale))
    qw, scale = got[1]
    xs = x[:steps].reshape(-1, x.shape[2]).contiguous()
    y = native.qgemm_f32(xs, 0.0, 0, qw, scale).reshape(steps, x.shape[1], -1)
    g = y.shape[-1] // 2
    return y[..., :g], _reverse_within(y[..., g:], lens)


def _native_acts(a, dirs: int):
    """rnn.c's activation codes per direction, or None (no C library, an activation it
    lacks)."""
    from kiln import native
    from kiln.native import rnn as NR

    if not native.available:
        return None
    return NR.activation_codes(a, "LSTM", dirs)


def _native_fits(n, rq, x: torch.Tensor) -> bool:
    """Whether kiln_dq_lstm computes this R product's integers: one exact float32 chunk (see
    :func:`_exact_f32`), codes minus zero point within int16's pair sums (+-255), and no int16
    pair saturation to reproduce (uint8 codes, or a CPU whose u8 x s8 GEMMs are exact, or
    codes too small to saturate). Decided once per weight."""
    from kiln.kernels.torch import int8 as K

    w, chunks, packed = rq
    if x.device.type != "cpu" or chunks is None or len(chunks) != 1 or \
            w.dtype != torch.float32:
        return False
    per_weight = n.cache.setdefault("dq_lstm_fits", {})
    got = per_weight.get(id(w))
    if got is None or got[0] is not w:
        top = float(w.abs().max())
        ok = top <= 255 and (packed is None or not K.u8s8_saturates() or top <= 64)
        got = per_weight[id(w)] = (w, ok)
    return got[1]


def _pairs_i16(n, w: torch.Tensor) -> torch.Tensor:
    """R's integers [H, 4H] as kiln_dq_lstm reads them: int16, rows in pairs (an odd H padded
    with a zero row), each pair's two values side by side per column; made once per weight."""
    per_weight = n.cache.setdefault("dq_lstm_i16", {})  # one per direction
    got = per_weight.get(id(w))
    if got is None or got[0] is not w:
        k, cols = w.shape
        rows = torch.zeros((k + (k & 1), cols), dtype=torch.int16)
        rows[:k] = w.to(torch.int16)
        packed = rows.reshape(-1, 2, cols).transpose(1, 2).contiguous()
        got = per_weight[id(w)] = (w, packed)
    return got[1]


def _vnni_r(n, w: torch.Tensor):
    """R's integers [H, 4H] as kiln_dq_lstm's VNNI step reads them (int8 panels, half the
    bytes of :func:`_pairs_i16`'s pairs) where the CPU has AVX512-VNNI and they fit int8, else
    None; made once per weight."""
    from kiln import native
    from kiln.native import rnn as NR

    per_weight = n.cache.setdefault("dq_lstm_vnni", {})  # one per direction
    got = per_weight.get(id(w))
    if got is None or got[0] is not w:
        fits = native.qconv_available() and w.numel() and float(w.min()) >= -128 and \
            float(w.max()) <= 127
        got = per_weight[id(w)] = (w, NR.vnni_weight(w) if fits else None)
    return got[1]


def _native_job(n, acts, xw, rq, rs, bias, p, h, c, lens, steps) -> tuple:
    """kiln_dq_lstm's arguments for one direction (:func:`kiln.native.rnn.dq_lstm`)."""
    from kiln.native import rnn as NR

    batch, hid = h.shape
    flags = (NR.INPUT_FORGET if n.a.input_forget else 0) | (NR.CLIP if n.a.clip else 0)
    r = _vnni_r(n, rq[0])
    if r is None:
        r = _pairs_i16(n, rq[0])
    else:
        flags |= NR.VNNI
    return ((steps, batch, hid, flags), acts, float(n.a.clip or 0.0), xw.contiguous(), r,
            rs.contiguous(), bias.contiguous(), None if p is None else p.contiguous(),
            h.contiguous(), c.contiguous(), lens.to(torch.int64).contiguous())


def _run_native(job: tuple):
    """One direction's recurrence in one C call (kiln/native/rnn.c's kiln_dq_lstm)."""
    from kiln.native import rnn as NR

    return NR.dq_lstm(*job)


def _run_native_dirs(jobs: list) -> list:
    """Several directions' recurrences in one C call, a direction per thread of kiln's team
    (kiln_dq_lstm_dirs): the same values as :func:`_run_native` of each."""
    from kiln.native import rnn as NR

    return NR.dq_lstm_dirs(jobs)


def _run(n, acts, xw, rq, rs, bias, p, h, c, lens, steps):
    """The forward recurrence over ``steps`` steps; returns (Y [steps, B, H], Y_h, Y_c)."""
    f, g, hf = acts
    hid = h.shape[1]
    clip, forget = n.a.clip, n.a.input_forget
    prev = h  # the rows the next step quantizes: last step's output (0 past a row's length)
    ys = []
    y_h, y_c = h.clone(), c.clone()
    for t in range(steps):
        gates = xw[t] + _qmatmul(prev, rq, rs) + bias
        gi, go, gf, gc = gates.split(hid, -1)
        if p is not None:
            gi, gf = gi + p[:hid] * c, gf + p[2 * hid:] * c
        it = f(_clip(gi, clip))
        ft = 1 - it if forget else f(_clip(gf, clip))
        c = ft * c + it * g(_clip(gc, clip))
        if p is not None:
            go = go + p[hid:2 * hid] * c
        h = f(_clip(go, clip)) * hf(c)
        live = (t < lens)[:, None]
        out = torch.where(live, h, torch.zeros_like(h))
        ending = (t + 1 == lens)[:, None]
        y_h, y_c = torch.where(ending, h, y_h), torch.where(ending, c, y_c)
        ys.append(out)
        prev = out
    y = torch.stack(ys) if ys else xw.new_zeros((0, h.shape[0], hid))
    empty = (lens == 0)[:, None]  # no step: zero final states, as onnxruntime gives
    return y, y_h.masked_fill(empty, 0), y_c.masked_fill(empty, 0)
