"""Hugging Face BertModel exported by torch.onnx (TorchScript exporter, opset 17): op counts
after kiln's optimizer, outputs against onnxruntime, and CPU latency of both.

    python -m bench.hf_bert [--layers 12] [--seq 128] [--attn sdpa|eager] [--runs 30]

The model is built from a small config with seeded random weights (nothing is downloaded).
Latency is the median of ``--runs`` runs at batch 1, 2 threads each, in one process; on a
shared machine the ratio is the figure to read, not the milliseconds.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

from bench.corpus.measure import median_s


def export(path: str, layers: int, seq: int, attn: str) -> None:
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(attn_implementation=attn, hidden_size=128, num_hidden_layers=layers,
                     num_attention_heads=4, intermediate_size=256, vocab_size=1000)
    bert = BertModel(cfg).eval()

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, ids, mask, types):
            o = self.bert(input_ids=ids, attention_mask=mask, token_type_ids=types)
            return o.last_hidden_state, o.pooler_output

    ids = torch.randint(0, 1000, (1, seq))
    axes = {0: "batch", 1: "seq"}
    torch.onnx.export(Wrapped().eval(), (ids, torch.ones_like(ids), torch.zeros_like(ids)),
                      path, input_names=["input_ids", "attention_mask", "token_type_ids"],
                      output_names=["last_hidden_state", "pooler_output"],
                      dynamic_axes={k: axes for k in ("input_ids", "attention_mask",
                                                      "token_type_ids")},
                      opset_version=17, dynamo=False)


def feeds(seq: int) -> dict:
    rng = np.random.default_rng(0)
    mask = np.ones((1, seq), np.int64)
    mask[0, seq - seq // 4:] = 0  # padding at the end: the mask matters
    return {"input_ids": rng.integers(0, 1000, (1, seq)), "attention_mask": mask,
            "token_type_ids": np.zeros((1, seq), np.int64)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args()
    import onnxruntime as ort
    import torch

    from kiln.builder import Builder, BuilderConfig
    from kiln.engine.profile import Profile

    torch.set_num_threads(2)
    path = os.path.join(tempfile.mkdtemp(), "bert.onnx")
    export(path, args.layers, args.seq, args.attn)
    f = feeds(args.seq)
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = 2, 1
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    want = sess.run(None, f)
    shapes = {k: v.shape for k, v in f.items()}
    for label, profiles in (("dynamic", []), (f"fixed 1x{args.seq}", [Profile.fixed(shapes)])):
        b = Builder(BuilderConfig(profiles=profiles))
        ctx = b.build(path).create_context()
        got = ctx.run(f)
        err = max(float(np.max(np.abs(g - w)) / (np.max(np.abs(w)) + 1e-12))
                  for g, w in zip(got.values(), want))
        after = b.report["nodes_after"]
        print(f"\n{label}: {sum(b.report['nodes_before'].values())} nodes -> "
              f"{sum(after.values())} layers, max rel err vs onnxruntime {err:.1e}")
        for op, k in sorted(after.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"  {op:<24} {k}")
        t_kiln = 1e3 * median_s(lambda c=ctx: c.run(f), args.runs)
        t_ort = 1e3 * median_s(lambda: sess.run(None, f), args.runs)
        print(f"  median latency: kiln {t_kiln:.2f} ms, onnxruntime {t_ort:.2f} ms, "
              f"ratio {t_kiln / t_ort:.2f}")


if __name__ == "__main__":
    main()
