import math

from kiln.ops import math as M
from kiln.passes.fusion.gelu import fuse_gelu
from tests.passes.transformer_util import apply, c, feeds, model, node

INITS = {"sqrt2": c(math.sqrt(2)), "one": c(1.0), "half": c(0.5), "k": c(0.044715),
         "s": c(math.sqrt(2 / math.pi)), "three": c(3.0), "inv_sqrt2": c(1 / math.sqrt(2))}
X = {"x": ["n", 8]}


def erf_nodes(order="x_first"):
    ns = [node("Div", ["x", "sqrt2"], "u"), node("Erf", ["u"], "e"),
          node("Add", ["e", "one"], "a")]
    if order == "x_first":  # (x * a) * 0.5, as torch exports F.gelu
        return ns + [node("Mul", ["x", "a"], "xa"), node("Mul", ["xa", "half"], "y")]
    if order == "half_x":  # (0.5 * x) * a
        return ns + [node("Mul", ["half", "x"], "hx"), node("Mul", ["hx", "a"], "y")]
    return ns + [node("Mul", ["a", "half"], "ah"), node("Mul", ["x", "ah"], "y")]  # x*(a*0.5)


def tanh_nodes(cube="mul"):
    if cube == "mul":
        ns = [node("Mul", ["x", "x"], "x2"), node("Mul", ["x", "x2"], "x3")]
    else:
        ns = [node("Pow", ["x", "three"], "x3")]
    return ns + [node("Mul", ["k", "x3"], "kx3"), node("Add", ["x", "kx3"], "inner"),
                 node("Mul", ["s", "inner"], "si"), node("Tanh", ["si"], "t"),
                 node("Add", ["one", "t"], "a"), node("Mul", ["x", "a"], "xa"),
                 node("Mul", ["half", "xa"], "y")]


def test_gelu_erf_structure_counts_numerics():
    m = model(erf_nodes(), X, ["y"], INITS)
    g, before, after, n, logs = apply(m, fuse_gelu, feeds(x=(3, 8)))
    assert n == 1 and after == {"Gelu": 1}
    assert before == {"Add": 1, "Div": 1, "Erf": 1, "Mul": 2}
    (ge,) = g.nodes
    assert ge.op is M.Gelu and ge.attrs.approximate == "none"
    assert ge.inputs == [g.inputs[0]] and ge.outputs[0] is g.outputs[0]
    assert ge.name == "u + e + a + xa + y" and logs == [f"fused {ge.name} -> Gelu"]


def test_gelu_erf_other_orderings():
    for order in ("half_x", "a_half"):
        m = model(erf_nodes(order), X, ["y"], INITS)
        _, _, after, n, _ = apply(m, fuse_gelu, feeds(x=(3, 8)))
        assert n == 1 and after == {"Gelu": 1}, order


def test_gelu_erf_mul_by_inverse_sqrt2():
    ns = erf_nodes()
    ns[0] = node("Mul", ["x", "inv_sqrt2"], "u")
    _, _, after, n, _ = apply(model(ns, X, ["y"], INITS), fuse_gelu, feeds(x=(3, 8)))
    assert n == 1 and after == {"Gelu": 1}


def test_gelu_tanh_structure_counts_numerics():
    for cube in ("mul", "pow"):
        m = model(tanh_nodes(cube), X, ["y"], INITS)
        g, before, after, n, _ = apply(m, fuse_gelu, feeds(x=(3, 8)))
        assert n == 1 and after == {"Gelu": 1} and before["Tanh"] == 1
        assert g.nodes[0].attrs.approximate == "tanh"


def test_no_fuse_gelu_intermediate_used_elsewhere():
    m = model(erf_nodes(), X, ["y", "e"], INITS)  # erf(x/√2) is also an output
    _, before, after, n, _ = apply(m, fuse_gelu, feeds(x=(3, 8)))
    assert n == 0 and before == after


def test_no_fuse_gelu_wrong_constant():
    inits = dict(INITS, half=c(0.25))  # 0.25 * x * (1 + erf(x/√2)) is not GELU
    _, before, after, n, _ = apply(model(erf_nodes(), X, ["y"], inits), fuse_gelu,
                                   feeds(x=(3, 8)))
    assert n == 0 and before == after


def test_no_fuse_gelu_times_other_tensor():
    ns = erf_nodes()
    ns[3] = node("Mul", ["z", "a"], "xa")  # z * Φ(x): not GELU of anything
    m = model(ns, {"x": ["n", 8], "z": ["n", 8]}, ["y"], INITS)
    _, before, after, n, _ = apply(m, fuse_gelu, feeds(x=(3, 8), z=(3, 8)))
    assert n == 0 and before == after
