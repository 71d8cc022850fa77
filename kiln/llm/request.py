"""One generation request as the scheduler and KV cache see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kiln.llm.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the model's context
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        # _value_ is a plain attribute (name goes through enum's descriptor): this runs a few
        # times per request per step
        return self._value_ in _FINISHED_VALUES


_FINISHED_VALUES = frozenset(s.value for s in Status if s.name.startswith("FINISHED"))


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first schedule
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its full blocks
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens(self, start: int, stop: int) -> list[int]:
        """Tokens ``start:stop`` of prompt + output (slices only: a decode step's one token
        does not copy the whole sequence)."""
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n:stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - n]

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.params.max_tokens
