"""ONNX RNN, GRU and LSTM on kiln's C kernels (``rnn.c``): the input projection of every step
as one GEMM (``gemm.c``), then the whole recurrence in one C call per direction.

:class:`RecurrentWeights` packs a node's weights once (gates padded to whole 8-float vectors,
R transposed, biases summed where ONNX adds them anyway); :func:`recurrent` runs the node.
Activations the kernel has are the keys of :data:`RNN_ACTIVATIONS`; others, other dtypes and
empty sequences are for the caller's PyTorch path (:func:`fits` says which).
"""

from __future__ import annotations

import ctypes

import torch

from kiln import native

KINDS = {"RNN": 0, "GRU": 1, "LSTM": 2}
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
REVERSE, LINEAR_BEFORE_RESET, INPUT_FORGET, CLIP = 1, 2, 4, 8
VNNI = 16  # kiln_dq_lstm's R as int8 VNNI panels (vnni_weight)
# lower-case ONNX activation name -> (rnn.c's code, default alpha, default beta)
RNN_ACTIVATIONS = {"sigmoid": (0, 0.0, 0.0), "tanh": (1, 0.0, 0.0), "relu": (2, 0.0, 0.0),
                   "leakyrelu": (3, 0.01, 0.0), "hardsigmoid": (4, 0.2, 0.5),
                   "affine": (5, 1.0, 0.0), "scaledtanh": (6, 1.0, 1.0)}
# below this many multiply-adds the input GEMM runs on one thread: a parallel region costs more
GEMM_PARALLEL_WORK = 1 << 20

# kiln_rnn's long array, in rnn.c's P_* order (pointers as integers, 0 for absent)
_FIELDS = ("kind dirs t b h hp i xw xwt xwb x xt xb wt bias rt rbh peep h0 c0 state_row "
           "state_dir lens flags c0_ c1_ c2_ c3_ c4_ c5_ y yt yb ydir yh yc threads").split()
P = {name: k for k, name in enumerate(_FIELDS)}
P_CODES = P["c0_"]
# at most this many (step, batch) rows: the input projection is made step by step inside the
# recurrence instead of one GEMM before it (whose fixed cost is then more than its saving)
DIRECT_ROWS = 8

_lib = native._lib
if _lib is not None:
    _lib.kiln_rnn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    _lib.kiln_rnn.restype = ctypes.c_int
    _lib.kiln_dq_lstm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_float] + \
        [ctypes.c_void_p] * 11
    _lib.kiln_dq_lstm.restype = ctypes.c_int
    _lib.kiln_dq_lstm_dirs.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_int]
    _lib.kiln_dq_lstm_dirs.restype = ctypes.c_int


def available() -> bool:
    return _lib is not None


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


class RecurrentWeights:
    """One node's W [dirs, G*H, I], R [dirs, G*H, H], B [dirs, 2*G*H] (or None) and LSTM's P
    [dirs, 3*H] (or None), packed for :func:`recurrent`."""

    def __init__(self, kind: str, w: torch.Tensor, r: torch.Tensor, b: torch.Tensor | None,
                 p: torch.Tensor | None):
        g = GATES[kind]
        dirs, gh, i = w.shape
        h = r.shape[-1]
        if gh != g * h or tuple(r.shape) != (dirs, g * h, h):
            raise ValueError(f"{kind}: W {tuple(w.shape)} and R {tuple(r.shape)} do not fit "
                             f"{g} gates of hidden size {h}")
        hp = _pad8(h)
        self.kind, self.dirs, self.h, self.hp, self.i, self.n = kind, dirs, h, hp, i, g * hp
        w, r = w.float(), r.float()
        wp = torch.zeros(dirs, g, hp, i)
        wp[:, :, :h] = w.reshape(dirs, g, h, i)
        self.wt = wp.reshape(dirs * self.n, i).t().contiguous()  # [I, dirs * G * HP]
        rp = torch.zeros(dirs, g, hp, h)
        rp[:, :, :h] = r.reshape(dirs, g, h, h)
        self.rt = rp.reshape(dirs, self.n, h).transpose(1, 2).contiguous()  # [dirs, H, G*HP]
        bias = torch.zeros(dirs, g, hp)
        self.rbh = None
        if b is not None:
            wb, rb = b.float().reshape(dirs, 2, g, h).unbind(1)
            if kind == "GRU":  # h's R bias is added inside the reset gate's product
                self.rbh = torch.zeros(dirs, hp)
                self.rbh[:, :h] = rb[:, 2]
                rb = rb.clone()
                rb[:, 2] = 0
            bias[:, :, :h] = wb + rb
        self.bias = bias.reshape(-1).contiguous()
        self.peep = None
        if p is not None and kind == "LSTM" and bool(p.any()):
            pp = torch.zeros(dirs, 3, hp)
            pp[:, :, :h] = p.float().reshape(dirs, 3, h)
            self.peep = pp.reshape(dirs, 3 * hp).contiguous()
        self.packed = native.PackedWeight(self.wt)


def activation_codes(a, kind: str, dirs: int) -> list[tuple[list, list, list]] | None:
    """Per direction, (codes, alphas, betas) of f, g, h for rnn.c; None when one of the
    node's activations is not in the kernel. alpha/beta values are consumed in order by the
    functions that take them, as onnxruntime does."""
    defaults = {"RNN": ("Tanh",), "GRU": ("Sigmoid", "Tanh"),
                "LSTM": ("Sigmoid", "Tanh", "Tanh")}[kind]
    names = list(a.activations or ()) or list(defaults) * dirs
    per = len(defaults)
    if len(names) == per and dirs == 2:
        names = names * 2
    if len(names) == 2 * per and dirs == 1 and names[:per] == names[per:]:
        names = names[:per]  # ONNX's RNN default, ("Tanh", "Tanh"), on a one-way node
    if len(names) != per * dirs:
        return None
    alphas, betas = list(a.activation_alpha or ()), list(a.activation_beta or ())
    out = []
    for name in names:
        key = name.lower()
        if key not in RNN_ACTIVATIONS:
            return None
        code, da, db = RNN_ACTIVATIONS[key]
        takes_alpha = key in ("leakyrelu", "hardsigmoid", "affine", "scaledtanh")
        takes_beta = key in ("hardsigmoid", "affine", "scaledtanh")
        al = (alphas.pop(0) if alphas else da) if takes_alpha else 0.0
        be = (betas.pop(0) if betas else db) if takes_beta else 0.0
        out.append((code, float(al), float(be)))
    dirs_out = []
    for d in range(dirs):
        fns = out[d * per:(d + 1) * per] + [(0, 0.0, 0.0)] * (3 - per)
        dirs_out.append(([c for c, _, _ in fns], [x for _, x, _ in fns], [y for _, _, y in fns]))
    return dirs_out


def fits(x: torch.Tensor, *others) -> bool:
    """Whether :func:`recurrent` takes a node with input ``x`` (and these other tensors)."""
    return (_lib is not None and x.dtype == torch.float32 and x.device.type == "cpu"
            and x.dim() == 3 and min(x.shape) > 0
            and all(t is None or t.device.type == "cpu" for t in others))


class RecurrentCall:
    """A node's packed weights, activations and attributes bound into kiln_rnn's arguments
    once; calling it runs the node on one input."""

    def __init__(self, pw: RecurrentWeights, a, acts, reverse: bool = False):
        self.pw, self.layout = pw, bool(a.layout)
        self.p = (ctypes.c_long * len(_FIELDS))()
        p = self.p
        p[P["kind"]], p[P["dirs"]], p[P["h"]] = KINDS[pw.kind], pw.dirs, pw.h
        p[P["hp"]], p[P["i"]] = pw.hp, pw.i
        p[P["wt"]], p[P["bias"]] = pw.wt.data_ptr(), pw.bias.data_ptr()
        p[P["rt"]] = pw.rt.data_ptr()
        p[P["rbh"]] = 0 if pw.rbh is None else pw.rbh.data_ptr()
        p[P["peep"]] = 0 if pw.peep is None else pw.peep.data_ptr()
        p[P["flags"]] = ((LINEAR_BEFORE_RESET if getattr(a, "linear_before_reset", 0) else 0)
                         | (INPUT_FORGET if getattr(a, "input_forget", 0) else 0)
                         | (CLIP if a.clip is not None else 0)
                         | (REVERSE if reverse and pw.dirs == 1 else 0))
        fl = [float(a.clip) if a.clip is not None else 0.0]
        for d, (codes, alphas, betas) in enumerate(acts):
            for k in range(3):
                p[P_CODES + 3 * d + k] = codes[k]
            fl += list(alphas) + list(betas)
        self.f = (ctypes.c_float * len(fl))(*fl)

    def __call__(self, x: torch.Tensor, seq_lens=None, h0=None, c0=None) -> tuple:
        """(Y, Y_h, Y_c) in ONNX's layouts (Y_c None for RNN and GRU)."""
        pw, layout = self.pw, self.layout
        x = x.contiguous()
        b0, b1, i = x.shape  # (T, B) or (B, T)
        t, b = (b1, b0) if layout else (b0, b1)
        if i != pw.i:
            raise ValueError(f"{pw.kind}: X has {i} features, W has {pw.i}")
        dirs, h, n = pw.dirs, pw.h, pw.n
        p = type(self.p).from_buffer_copy(self.p)
        p[P["t"]], p[P["b"]] = t, b
        p[P["threads"]] = threads = torch.get_num_threads()
        m, row = b0 * b1, dirs * n
        if m <= DIRECT_ROWS:  # rows made inside the recurrence from x and W
            p[P["x"]] = x.data_ptr()
            p[P["xt"]], p[P["xb"]] = (i, t * i) if layout else (b * i, i)
        else:
            xw = torch.empty((m, row), dtype=torch.float32)
            gemm_threads = threads if m * i * row >= GEMM_PARALLEL_WORK else 1
            _lib.kiln_sgemm(m, row, i, x.data_ptr(), i, pw.packed.data.data_ptr(),
                            pw.bias.data_ptr(), None, 0, xw.data_ptr(), row, 0, float("-inf"),
                            float("inf"), gemm_threads)
            p[P["xw"]] = xw.data_ptr()
            p[P["xwt"]], p[P["xwb"]] = (row, t * row) if layout else (b * row, row)
        y = torch.empty((b, t, dirs, h) if layout else (t, dirs, b, h), dtype=torch.float32)
        p[P["y"]] = y.data_ptr()
        p[P["yt"]], p[P["yb"]], p[P["ydir"]] = ((dirs * h, t * dirs * h, h) if layout
                                                else (dirs * b * h, h, b * h))
        st_shape = (b, dirs, h) if layout else (dirs, b, h)
        p[P["state_row"]], p[P["state_dir"]] = (dirs * h, h) if layout else (h, b * h)
        yh = torch.empty(st_shape, dtype=torch.float32)
        p[P["yh"]] = yh.data_ptr()
        yc = None
        if pw.kind == "LSTM":
            yc = torch.empty(st_shape, dtype=torch.float32)
            p[P["yc"]] = yc.data_ptr()
        keep = []
        for name, s in (("h0", h0), ("c0", c0)):
            if s is not None:
                s = s.float().contiguous()
                if tuple(s.shape) != st_shape:
                    raise ValueError(f"{pw.kind}: initial state {name} has shape "
                                     f"{tuple(s.shape)}, expected {st_shape}")
                keep.append(s)
                p[P[name]] = s.data_ptr()
        if seq_lens is not None:
            lens = seq_lens.reshape(-1).to(torch.int64).contiguous()
            if lens.numel() != b:
                raise ValueError(f"{pw.kind}: sequence_lens has {lens.numel()} entries for "
                                 f"batch {b}")
            keep.append(lens)
            p[P["lens"]] = lens.data_ptr()
        if _lib.kiln_rnn(ctypes.addressof(p), ctypes.addressof(self.f)) != 0:
            raise MemoryError(f"{pw.kind}: the kernel could not allocate its scratch memory")
        return y, yh, yc


def dq_lstm(g: tuple, acts: tuple, clip: float, xw, rq, rs, bias, peep, h0, c0, lens):
    """One forward direction of DynamicQuantizeLSTM's recurrence (rnn.c's kiln_dq_lstm):
    ``g`` = (T, B, H, flags), ``acts`` = (codes, alphas, betas) of f, g, h; every tensor a
    contiguous float32 CPU one (``lens`` int64), ``peep``/``h0``/``c0`` may be None. Returns
    (Y [T, B, H], Y_h [B, H], Y_c [B, H])."""
    t, b, h = g[:3]
    y, yh, yc = torch.empty((t, b, h)), torch.empty((b, h)), torch.empty((b, h))
    codes, alphas, betas = acts
    ci = (ctypes.c_int * 3)(*codes)
    fa = (ctypes.c_float * 6)(*alphas, *betas)
    gl = (ctypes.c_long * 4)(*g)

    def ptr(v):
        return None if v is None else v.data_ptr()

    if _lib.kiln_dq_lstm(ctypes.addressof(gl), ctypes.addressof(ci), ctypes.addressof(fa),
                         clip, *map(ptr, (xw, rq, rs, bias, peep, h0, c0, lens, y, yh,
                                         yc))) != 0:
        raise MemoryError("DynamicQuantizeLSTM: no scratch memory")
    return y, yh, yc


def dq_lstm_dirs(jobs: list, nthreads: int | None = None) -> list:
    """:func:`dq_lstm` of several directions in one C call (rnn.c's kiln_dq_lstm_dirs), the
    directions over kiln's team (one per thread): ``jobs`` a list of :func:`dq_lstm`'s
    argument tuples; returns their (Y, Y_h, Y_c) in order."""
    outs, keep, ptrs = [], [], []
    clips = (ctypes.c_float * max(len(jobs), 1))()
    for i, (g, acts, clip, xw, rq, rs, bias, peep, h0, c0, lens) in enumerate(jobs):
        t, b, h = g[:3]
        y, yh, yc = torch.empty((t, b, h)), torch.empty((b, h)), torch.empty((b, h))
        codes, alphas, betas = acts
        ci, fa = (ctypes.c_int * 3)(*codes), (ctypes.c_float * 6)(*alphas, *betas)
        gl = (ctypes.c_long * 4)(*g)
        keep += [ci, fa, gl]
        clips[i] = clip
        ptrs += [ctypes.addressof(gl), ctypes.addressof(ci), ctypes.addressof(fa)]
        ptrs += [None if v is None else v.data_ptr()
                 for v in (xw, rq, rs, bias, peep, h0, c0, lens, y, yh, yc)]
        outs.append((y, yh, yc))
    arr = (ctypes.c_void_p * max(len(ptrs), 1))(*ptrs)
    nt = torch.get_num_threads() if nthreads is None else nthreads
    if _lib.kiln_dq_lstm_dirs(len(jobs), arr, clips, nt) != 0:
        raise MemoryError("DynamicQuantizeLSTM: no scratch memory")
    return outs


def vnni_weight(w: torch.Tensor) -> torch.Tensor:
    """kiln_dq_lstm's R for its VNNI step (flag :data:`VNNI`): integer weights [H, 4H] within
    int8 as one uint8 buffer, their column sums (int32, 4H rounded up to 32) then qgemm.c's
    VNNI panels."""
    wq = w.to(torch.int8)
    packed = native.QGemmWeight(wq, "vnni")
    n = wq.shape[1]
    cs = torch.zeros((n + 31) // 32 * 32, dtype=torch.int32)
    cs[:n] = packed.colsum
    return torch.cat([cs.view(torch.uint8), packed.packed])
