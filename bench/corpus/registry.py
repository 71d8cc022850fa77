"""Every corpus spec, in one list (explicit, no discovery)."""

from __future__ import annotations

from bench.corpus import derived, recurrent, shipped, text, vision
from bench.corpus.spec import Spec


def all_specs() -> list[Spec]:
    return [*vision.specs(), *text.specs(), *recurrent.specs(), *shipped.specs(), *derived.specs()]


def select(names: list[str] | None) -> list[Spec]:
    specs = all_specs()
    if not names:
        return specs
    by_name = {s.name: s for s in specs}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown corpus models {unknown}; known: {sorted(by_name)}")
    return [by_name[n] for n in names]


def get(name: str) -> Spec:
    return select([name])[0]
