"""One inference request as both protocols deliver it, and its checks against the model
version it goes to (names, datatypes, shapes, batch size) before anything is queued."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kiln.serve.errors import invalid


@dataclass
class RequestedOutput:
    name: str
    binary: bool | None = None  # HTTP binary-data extension; None: the request's default
    parameters: dict = field(default_factory=dict)


@dataclass
class InferRequest:
    model: str
    version: str = ""
    id: str = ""
    inputs: dict[str, tuple[str, np.ndarray]] = field(default_factory=dict)  # name: (dtype, x)
    outputs: list[RequestedOutput] | None = None  # None: every output
    parameters: dict = field(default_factory=dict)

    def timeout(self) -> float | None:
        """The request's own queue timeout (Triton's ``timeout`` parameter, microseconds)."""
        t = self.parameters.get("timeout")
        if t is None:
            return None
        if not isinstance(t, (int, float)) or isinstance(t, bool) or t < 0:
            raise invalid(f"parameter 'timeout' must be a number of microseconds, not {t!r}")
        return t * 1e-6 or None


def check_request(mv, req: InferRequest) -> tuple[dict, int, tuple]:
    """The feeds for the engine, the rows the request adds to a batch, and its batch key.
    Raises a 400 :class:`ServeError` naming the input at fault."""
    specs = {s.name: s for s in mv.inputs}
    unknown = [n for n in req.inputs if n not in specs]
    if unknown:
        raise invalid(f"model '{mv.name}' has no input '{unknown[0]}' (inputs: "
                      f"{', '.join(specs)})")
    missing = [n for n, s in specs.items() if n not in req.inputs and not s.optional]
    if missing:
        raise invalid(f"model '{mv.name}' needs input(s) {', '.join(missing)}, which the "
                      f"request does not give")
    rows = None
    feeds, key = {}, []
    for name, (dtype, x) in req.inputs.items():
        s = specs[name]
        if dtype != s.datatype:
            raise invalid(f"input '{name}' of model '{mv.name}': datatype {dtype}, but the "
                          f"model takes {s.datatype}")
        shape = tuple(x.shape)
        if mv.batched:
            if len(shape) != len(s.dims) + 1 or not _fits(shape[1:], s.dims):
                raise invalid(f"input '{name}' of model '{mv.name}': shape {list(shape)}, "
                              f"expected [batch, {', '.join(map(str, s.dims))}] (-1: any size)")
            mb = mv.config.max_batch_size
            if not 1 <= shape[0] <= mb:
                raise invalid(f"input '{name}' of model '{mv.name}': batch size {shape[0]} is "
                              f"outside 1..{mb} (the model's max_batch_size)")
            if rows is not None and shape[0] != rows:
                raise invalid(f"input '{name}' of model '{mv.name}': batch size {shape[0]} "
                              f"differs from the other inputs' {rows}")
            rows = shape[0]
            key.append((name, shape[1:]))
        elif len(shape) != len(s.dims) or not _fits(shape, s.dims):
            raise invalid(f"input '{name}' of model '{mv.name}': shape {list(shape)}, "
                          f"expected {list(s.dims)} (-1: any size)")
        feeds[name] = x
    if req.outputs is not None:
        names = {o.name for o in mv.outputs}
        for o in req.outputs:
            if o.name not in names:
                raise invalid(f"model '{mv.name}' has no output '{o.name}' (outputs: "
                              f"{', '.join(sorted(names))})")
    return feeds, rows or 1, tuple(sorted(key))


def _fits(shape, dims) -> bool:
    return all(d == -1 or d == s for s, d in zip(shape, dims))
