"""One launch record of the executor, and what the executor and native chains both do with it."""

from __future__ import annotations

from kiln.errors import KernelError


class Step:
    __slots__ = ("fn", "call", "ins", "outs", "free", "node", "upload")

    def __init__(self, fn, call, ins, outs, free, node):
        self.fn, self.call, self.ins, self.outs, self.free, self.node = (
            fn, call, ins, outs, free, node)
        self.upload: tuple[int, ...] = ()  # input positions copied host -> device (CUDA)


def store_outputs(st: Step, env: list, out) -> None:
    """A kernel returns one output or a tuple; write them into the step's output slots."""
    if len(st.outs) == 1:
        env[st.outs[0]] = out[0] if isinstance(out, tuple) else out
    else:
        for s, o in zip(st.outs, out):
            env[s] = o


def kernel_error(st: Step, e: Exception) -> KernelError:
    return KernelError(f"node '{st.node.name}' ({st.node.op.qualname}) failed: "
                       f"{type(e).__name__}: {e}")
