"""Sampling parameters and the sampler: logits [rows, vocab] -> one token per row.

Order, per row: repetition penalty (prompt and output tokens: positive logits / p, negative
* p), frequency and presence penalties (output tokens: - f * count - p * [count > 0]); then
temperature 0 -> argmax; else logits / T, top-k, top-p (smallest set of tokens whose
probability reaches p, the most likely always kept), min-p (drop tokens below min_p times the
top probability), and a draw from the rest with the request's own generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.errors import KilnError


@dataclass
class SamplingParams:
    """What to generate and when to stop (vLLM's names and defaults).

    Args:
        max_tokens: most tokens to generate (16).
        temperature: 0 is greedy (1.0).
        top_p, top_k, min_p: nucleus (1.0 = off), top-k (0 or -1 = off), min-p (0 = off).
        repetition_penalty, presence_penalty, frequency_penalty: 1.0 / 0 / 0 are off.
        seed: per-request seed; the same seed and prompt give the same tokens.
        stop: strings that end the output (not included unless ``include_stop_str_in_output``).
        stop_token_ids: token ids that end the output (included in ``token_ids``).
        ignore_eos: keep going past the end-of-sequence token.
        skip_special_tokens: leave special tokens out of ``text``.
    Raises:
        KilnError: a value out of range, naming the parameter.
    """
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        checks = [("max_tokens", self.max_tokens >= 1, "at least 1"),
                  ("temperature", self.temperature >= 0, ">= 0"),
                  ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
                  ("top_k", self.top_k >= -1, "-1, 0 (off) or positive"),
                  ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
                  ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
                  ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
                  ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]")]
        for name, ok, want in checks:
            if not ok:
                raise KilnError(f"SamplingParams.{name}={getattr(self, name)!r}: must be {want}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0
                or self.frequency_penalty != 0)


def apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt: list[int],
                    output: list[int]) -> torch.Tensor:
    """One row's logits with the repetition/frequency/presence penalties (in place)."""
    dev = logits.device
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=dev)
        if seen.numel():
            v = logits[seen]
            logits[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if output and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(torch.tensor(output, device=dev), minlength=logits.shape[-1])
        counts = counts[: logits.shape[-1]].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row's logits / temperature with top-k, top-p and min-p applied (-inf = dropped)."""
    x = logits / p.temperature
    if p.top_k > 0 and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = sorted_x.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the tokens strictly more likely
        drop = before >= p.top_p
        drop[0] = False
        x = x.scatter(0, order, sorted_x.masked_fill(drop, float("-inf")))
    if p.min_p > 0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return x


def filter_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``filter_logits`` for every row of ``logits`` [rows, V] at once, each row with its own
    temperature, top-k, top-p and min-p (the same order and ties: top-k keeps what is >= the
    k-th value, top-p the most likely tokens until the mass before them reaches p, the first
    always, min-p what is >= min_p times the top probability)."""
    rows, vocab = logits.shape
    dev = logits.device

    def col(values):
        return torch.tensor(values, dtype=logits.dtype, device=dev)[:, None]

    x = logits / col([p.temperature for p in params])
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        kmax = max(ks)
        top = torch.topk(x, kmax, dim=-1).values  # [rows, kmax], descending
        at = torch.tensor([max(k, 1) - 1 for k in ks], device=dev)[:, None]
        kth = top.gather(1, at)
        kth = torch.where(torch.tensor(ks, device=dev)[:, None] > 0, kth,
                          torch.full_like(kth, float("-inf")))
        x = x.masked_fill(x < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        before = probs.cumsum(-1) - probs
        drop = before >= col([p.top_p for p in params])
        drop[:, 0] = False
        drop &= col([p.top_p < 1.0 for p in params]).bool()
        x = x.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
    if any(p.min_p > 0 for p in params):
        probs = x.softmax(-1)
        mp = col([p.min_p for p in params])
        x = x.masked_fill((probs < mp * probs.amax(-1, keepdim=True)) & (mp > 0), float("-inf"))
    return x


def draw_rows(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of ``probs`` [rows, V], row i drawn with ``generators[i]``: one
    uniform number per row from the row's own generator (so a request's tokens do not depend
    on the rows beside it), then the inverse CDF of all rows at once: the first token whose
    cumulative probability reaches (1 - u) times the row's total (never a token of
    probability 0: the target is above 0 and at most the total)."""
    dev = probs.device
    u = torch.cat([torch.rand(1, generator=g, device=dev) for g in generators])
    cdf = probs.float().cumsum(-1)
    target = ((1.0 - u) * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=probs.shape[-1] - 1)


class Sampler:
    """Samples one token per row; keeps one ``torch.Generator`` per request."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.generators: dict[str, torch.Generator] = {}

    def generator(self, request_id: str, seed: int | None) -> torch.Generator:
        g = self.generators.get(request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            if seed is None:
                g.seed()
            else:
                g.manual_seed(seed)
            self.generators[request_id] = g
        return g

    def forget(self, request_id: str):
        self.generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, reqs) -> list[int]:
        """``reqs``: the Request of each row (params, prompt and output tokens).

        Penalties are applied per row (where asked); then greedy rows take the argmax and the
        others are filtered and drawn together (``filter_rows``, ``draw_rows``): the same
        distributions as ``filter_logits`` row by row, a few batched ops per step instead of
        ~10 per row, and one device-to-host copy."""
        if all(r.params.greedy and not r.params.penalized for r in reqs):
            return logits.argmax(-1).tolist()  # the common case in one op
        x = logits
        pen = [i for i, r in enumerate(reqs) if r.params.penalized]
        if pen:
            x = logits.clone()
            for i in pen:
                r = reqs[i]
                apply_penalties(x[i], r.params, r.prompt_token_ids, r.output_token_ids)
        out = x.argmax(-1)
        drawn = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if drawn:
            rows = [reqs[i] for i in drawn]
            probs = filter_rows(x[drawn], [r.params for r in rows]).softmax(-1)
            gens = [self.generator(r.request_id, r.params.seed) for r in rows]
            out[drawn] = draw_rows(probs, gens)
        return out.tolist()
