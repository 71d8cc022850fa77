"""Python's cyclic garbage collector held off while kiln builds long-lived structures.

Loading an engine and the first run's trace and plan (kiln.engine.program) create thousands
of objects that live as long as the engine. Each allocation counts towards the collector's
thresholds, and where the process has made garbage before (a build, a model conversion), the
first run is where a full collection fires: it walks every tracked object of the process (~230
thousand with torch and kiln imported, 100-250 ms on the 2-core test VM), though nothing the
load or trace made is garbage. :func:`paused` turns the collector off for such a stretch and
back on after it (only if it was on, so nesting and a caller's own ``gc.disable()`` are kept).
Nothing is leaked: reference counting still frees every acyclic object at once, and cycles are
found by the next collection after the stretch. That next collection is the usual kind: the
objects made meanwhile enter the youngest generation together, so the first collection after
it (a young one) finds them there."""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def paused():
    """The collector off for the ``with`` block, then as it was."""
    was = gc.isenabled()
    if was:
        gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
