"""Fuzz targets: the RMSNorm family (plain and Gemma, out of place and fused with the residual add)."""

from __future__ import annotations

import random

import torch
from fuzzing import FLOAT_DTYPES, Target, laid_out, randn, size

import kernforge


def draw(rng: random.Random) -> dict:
    return {
        "seed": rng.getrandbits(31),
        "rows": size(rng, 67),
        "hidden": size(rng, 5000, zero=False),
        "dtype": rng.choice(FLOAT_DTYPES),
        "eps": rng.choice([1e-6, 1e-5, 0.1]),
        "layout": rng.choice(["contiguous", "padded"]),  # rows strided apart; the last dim stays dense
        "scale": rng.choice([1e-3, 1.0, 30.0]),  # large rows overflow fp16 if squares were summed in fp16
    }


def inputs(case: dict):
    shape, dtype = (case["rows"], case["hidden"]), case["dtype"]
    x = laid_out(randn(shape, case, dtype=dtype, scale=case["scale"]), case["layout"])
    residual = randn(shape, case, dtype=dtype, salt=1)
    weight = randn((case["hidden"],), case, dtype=dtype, scale=0.5, salt=2)
    return x, residual, weight


def normed(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    x = x.double()
    scale = (1.0 + weight.double()) if gemma else weight.double()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * scale


def plain(gemma: bool) -> Target:
    op = kernforge.gemma_rmsnorm if gemma else kernforge.rmsnorm

    def run(case, tensors):
        x, _, weight = tensors
        return {"out": op(x, weight, case["eps"])}

    def reference(case, tensors):
        x, _, weight = tensors
        return {"out": normed(x, weight, case["eps"], gemma)}

    return Target(op.__name__, draw, inputs, run, reference)


def fused(gemma: bool) -> Target:
    op = kernforge.gemma_fused_add_rmsnorm if gemma else kernforge.fused_add_rmsnorm

    def run(case, tensors):
        x, residual, weight = (t.clone() for t in tensors)
        op(x, residual, weight, case["eps"])
        return {"input": x, "residual": residual}

    def reference(case, tensors):
        x, residual, weight = tensors
        # The kernel rounds the sum to the residual's dtype before normalizing it, as FlashInfer does.
        added = (x.double() + residual.double()).to(case["dtype"])
        return {"input": normed(added, weight, case["eps"], gemma), "residual": added.double()}

    return Target(op.__name__, draw, inputs, run, reference)


TARGETS = [plain(False), plain(True), fused(False), fused(True)]
