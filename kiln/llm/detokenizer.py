"""Streaming detokenization: text deltas that never end inside a UTF-8 sequence or a stop string.

Tokens -> text: decode a short window of the latest tokens twice, up to the previous read point
and up to the newest token; the difference is the new text. A window that decodes to a trailing
U+FFFD is an incomplete byte sequence (byte-level BPE splits characters), so nothing is emitted
until the next token completes it.

Stop strings: the last ``max(len(stop)) - 1`` characters are held back, since they may be the
start of a stop string that the next tokens complete; once a stop string appears, the text is cut
before it (or after it, with ``include_stop_str_in_output``) and the request ends.
"""

from __future__ import annotations

from kiln.llm.sampling import SamplingParams

_WINDOW = 6  # tokens of left context for the decode window (merges of spaces and the like)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams):
        self.tok, self.params = tokenizer, params
        self.ids = list(prompt_ids[-_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # everything decoded so far (output only)
        self.emitted = 0  # characters of self.text already handed out
        self.stop_hold = max((len(s) for s in params.stop), default=1) - 1
        self.stopped_by: str | None = None
        self._one = getattr(tokenizer, "decode_one", None)  # kiln's Tokenizer remembers these

    def _decode(self, ids) -> str:
        if len(ids) == 1 and self._one is not None:
            return self._one(ids[0], self.params.skip_special_tokens)
        return self.tok.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Feed one generated token; return the text that may be shown now."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self._trim()
        return self._release(final=False)

    def _trim(self):
        # keep the window short: everything before prefix_offset is no longer needed
        if self.prefix_offset > 64:
            cut = self.prefix_offset
            self.ids = self.ids[cut:]
            self.prefix_offset, self.read_offset = 0, self.read_offset - cut

    def _release(self, final: bool) -> str:
        if self.stopped_by is None and self.params.stop:
            hit = self._find_stop()
            if hit is not None:
                at, s = hit
                self.stopped_by = s
                end = at + len(s) if self.params.include_stop_str_in_output else at
                self.text = self.text[:end]
                final = True
        limit = len(self.text) if final else max(len(self.text) - self.stop_hold, self.emitted)
        out = self.text[self.emitted:limit]
        self.emitted = limit
        return out

    def _find_stop(self):
        # only text not yet emitted (plus the held tail) can hold a new stop string
        start = max(0, self.emitted - self.stop_hold)
        best = None
        for s in self.params.stop:
            at = self.text.find(s, start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        return best

    def flush(self) -> str:
        """The held-back text, when the request has ended for another reason."""
        if self.ids[self.read_offset:]:  # an incomplete tail: show what decodes
            full = self._decode(self.ids[self.prefix_offset:])
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            self.text += full[len(prefix):]
            self.read_offset = len(self.ids)
        return self._release(final=True)
