"""The CUDA model runner: Triton paged decode attention, SDPA prefill, CUDA graphs for decode.

Decode-only steps (every sequence adds one token) run the Triton kernel; a step with a prefill
chunk runs the torch path (SDPA on the gathered blocks; a fresh single prompt goes straight to
flash attention). Decode steps are captured once per padded batch size of ``GRAPH_SIZES`` and
replayed: the graph reads ids, positions, slots, block tables and lengths from static buffers,
and padding rows write into a scratch block past the pool, with length 1.
"""

from __future__ import annotations

import torch

from kiln.llm.attention import TorchPagedAttention
from kiln.llm.runner import ModelRunner
from kiln.llm.triton_attention import paged_decode

GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeMeta:
    """The decode step's tensors (static buffers when replayed in a graph)."""

    def __init__(self, slots, tables, lens):
        self.slots, self.tables, self.lens = slots, tables, lens


class CudaAttention:
    def __init__(self, cache: torch.Tensor, num_heads: int):
        self.torch_path = TorchPagedAttention(cache, num_heads)
        self.cache, self.num_heads = cache, num_heads
        self.scale = cache.shape[-1] ** -0.5

    def __call__(self, layer, q, k, v, meta):
        if not isinstance(meta, DecodeMeta):
            return self.torch_path(layer, q, k, v, meta)
        kc, vc = self.cache[layer, 0], self.cache[layer, 1]
        flat_k = kc.view(-1, *kc.shape[2:])
        flat_v = vc.view(-1, *vc.shape[2:])
        flat_k.index_copy_(0, meta.slots, k)
        flat_v.index_copy_(0, meta.slots, v)
        o = paged_decode(q, kc, vc, meta.tables, meta.lens, self.scale)
        return o.reshape(q.shape[0], -1)


class CudaModelRunner(ModelRunner):
    def __init__(self, model, num_blocks: int, block_size: int, cuda_graphs: bool = True,
                 max_batch: int = 256, max_model_len: int | None = None):
        # one more block than the pool: the scratch block that padding rows write into
        super().__init__(model, num_blocks + 1, block_size)
        self.num_blocks = num_blocks
        self.scratch = num_blocks
        self.max_blocks = -(-(max_model_len or model.cfg.max_position) // block_size)
        self.sizes = [s for s in GRAPH_SIZES if s <= max(max_batch, 1)] if cuda_graphs else []
        self.graphs: dict[int, tuple] = {}
        self.pool = None

    def _make_attention(self):
        return CudaAttention(self.cache, self.model.cfg.num_heads)

    def forward(self, ids, positions, entries, rows):
        if all(n == 1 for _, n, _ in entries):
            logits = self._decode(ids, positions, entries)
            if rows != list(range(len(entries))):  # a 1-token prefill chunk does not sample
                logits = logits[torch.tensor(rows, device=logits.device)]
            return logits
        return super().forward(ids, positions, entries, rows)

    def _decode(self, ids, positions, entries):
        b = len(entries)
        size = next((s for s in self.sizes if s >= b), None)
        width = max(len(t) for _, _, t in entries)
        if size is None or width > self.max_blocks:
            return self._run_decode(*self._host_inputs(ids, positions, entries, b, width), b)
        if size not in self.graphs:
            self.graphs[size] = self._capture(size)
        graph, bufs, logits = self.graphs[size]
        host = self._host_inputs(ids, positions, entries, size, self.max_blocks)
        for buf, val in zip(bufs, host):
            buf.copy_(val, non_blocking=True)
        graph.replay()
        return logits[:b]

    def _host_inputs(self, ids, positions, entries, size, width):
        bs = self.block_size
        ids_t = torch.zeros(size, dtype=torch.long)
        pos_t = torch.zeros(size, dtype=torch.long)
        slots = torch.full((size,), self.scratch * bs, dtype=torch.long)
        tables = torch.full((size, width), self.scratch, dtype=torch.int32)
        lens = torch.ones(size, dtype=torch.int32)
        for i, ((start, _, table), tok, p) in enumerate(zip(entries, ids, positions)):
            ids_t[i], pos_t[i] = tok, p
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
            slots[i] = table[start // bs] * bs + start % bs
            lens[i] = start + 1
        dev = self.model.device
        host = (ids_t, pos_t, slots, tables, lens)
        if dev.type != "cuda":  # the Triton interpreter (tests)
            return host
        return tuple(t.pin_memory().to(dev, non_blocking=True) for t in host)

    def _run_decode(self, ids, pos, slots, tables, lens, b=None):
        meta = DecodeMeta(slots, tables, lens)
        logits = self.model.forward(ids, pos, self.attn, meta, None)
        return logits if b is None else logits[:b]

    def _capture(self, size):
        dev = self.model.device
        bufs = (torch.zeros(size, dtype=torch.long, device=dev),
                torch.zeros(size, dtype=torch.long, device=dev),
                torch.full((size,), self.scratch * self.block_size, dtype=torch.long, device=dev),
                torch.full((size, self.max_blocks), self.scratch, dtype=torch.int32, device=dev),
                torch.ones(size, dtype=torch.int32, device=dev))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: Triton compiles, cuBLAS picks its kernels
                self._run_decode(*bufs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._run_decode(*bufs)
        self.pool = graph.pool()
        return graph, bufs, logits

    @torch.inference_mode()
    def warmup(self):
        """Capture every graph size now instead of at first use."""
        for s in self.sizes:
            if s not in self.graphs:
                self.graphs[s] = self._capture(s)

