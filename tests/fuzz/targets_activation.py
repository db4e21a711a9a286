"""Fuzz targets: the gated activations (``silu_and_mul``, ``gelu_and_mul``, ``gelu_tanh_and_mul``),
``[..., 2d] -> [..., d]``, out of place or into ``out=``.

Inputs of 1 to 4 dims (the kernel sees at most 3: leading dims merge, as views where they can), any
``d`` (vector tails on every tier), read through padded rows, permuted leading dims, a strided last
dim (copied by the op); ``out=`` in padded rows whose padding must stay as it was (NaN here).
"""

from __future__ import annotations

import math
import random

import torch
from fuzzing import FLOAT_DTYPES, TOLERANCES, Target, randn, size, threaded_target

import kernforge

ACT = {
    "silu_and_mul": lambda a: a * torch.sigmoid(a),
    "gelu_and_mul": lambda a: 0.5 * a * (1.0 + torch.erf(a / math.sqrt(2.0))),
    "gelu_tanh_and_mul": lambda a: 0.5 * a * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (a + 0.044715 * a**3))),
}
LAYOUTS = ["contiguous", "contiguous", "padded", "permuted", "strided_last"]


def draw(rng: random.Random) -> dict:
    ndim = rng.choice([1, 2, 2, 2, 3, 3, 4])
    lead = [size(rng, 40) for _ in range(ndim - 1)]
    if ndim == 4:  # keep 4-D cases small
        lead = [min(s, 5) for s in lead]
    return {
        "seed": rng.getrandbits(31),
        "lead": lead,
        "d": size(rng, 700, zero=rng.random() < 0.05),
        "dtype": rng.choice(FLOAT_DTYPES),
        # |x| ~ 4 reaches the activations' tails; 30 is deep in them (fp16 products stay finite: 30 * 30 * 4)
        "scale": rng.choice([1e-3, 1.0, 4.0, 4.0, 30.0]),
        "layout": rng.choice(LAYOUTS) if ndim >= 2 else rng.choice(["contiguous", "strided_last"]),
        "out": rng.choice([None, None, "contiguous", "padded"]),
    }


def placed(x: torch.Tensor, how: str) -> torch.Tensor:
    """``x`` with the same values in ``how``'s memory layout (a view into a larger NaN-filled buffer)."""
    if how == "padded":
        backing = torch.full((*x.shape[:-1], x.shape[-1] + 5), float("nan"), dtype=x.dtype)
        backing[..., : x.shape[-1]] = x
        return backing[..., : x.shape[-1]]
    if how == "permuted":  # leading dims in reverse order in memory
        order = list(range(x.dim() - 1))[::-1] + [x.dim() - 1]
        inverse = [order.index(i) for i in range(x.dim())]
        return x.permute(order).contiguous().permute(inverse)
    if how == "strided_last":
        backing = torch.full((*x.shape[:-1], 2 * x.shape[-1]), float("nan"), dtype=x.dtype)
        backing[..., ::2] = x
        return backing[..., ::2]
    return x.contiguous()


def inputs(case: dict):
    shape = (*case["lead"], 2 * case["d"])
    x = randn(shape, case, dtype=case["dtype"], scale=case["scale"])
    return placed(x, case["layout"])


def out_buffer(case: dict):
    """(out view, its backing buffer) for ``out=``, or (None, None)."""
    if case["out"] is None:
        return None, None
    shape = (*case["lead"], case["d"])
    pad = 3 if case["out"] == "padded" else 0
    backing = torch.full((*shape[:-1], shape[-1] + pad), float("nan"), dtype=case["dtype"])
    return backing[..., : shape[-1]], backing


def gated(name: str) -> Target:
    op = getattr(kernforge, name)

    def run(case, x):
        before = x.clone()
        out, backing = out_buffer(case)
        y = op(x) if out is None else op(x, out=out)
        assert out is None or y is out, "out= was not returned"
        assert y.dtype == case["dtype"], f"output dtype {y.dtype}"
        assert torch.equal(x, before), "the input was modified"
        outputs = {"out": y}
        if backing is not None:
            outputs["out_backing"] = backing  # the padding must still be NaN
        return outputs

    def reference(case, x):
        xd = x.double()
        d = case["d"]
        expected = ACT[name](xd[..., :d]) * xd[..., d:]
        outputs = {"out": expected}
        if case["out"] is not None:
            _, backing = out_buffer(case)
            backing = backing.double()
            backing[..., :d] = expected
            outputs["out_backing"] = backing
        return outputs

    return threaded_target(name, draw, inputs, run, reference, tolerance)


def tolerance(case: dict):
    """The dtype's, with atol grown by the inputs' magnitude squared: act(x) * y carries the activation's
    relative error times |x * y| (the long fuzz run's gelu_and_mul case 2981928564: fp32 at scale 30,
    2.2e-5 off in an output of 1.5e-5 whose factors were ~100)."""
    atol, rtol = TOLERANCES[case["dtype"]]
    return atol * max(1.0, case["scale"]) ** 2, rtol


TARGETS = [gated(name) for name in ACT]
