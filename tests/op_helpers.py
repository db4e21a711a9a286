"""Test helpers shared by the op tests: seeded inputs and strided row layouts."""

import zlib
from pathlib import Path

import torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
ROWS = [1, 7, 33, 130]
SHAPES_2D = [1, 7, 33]
SHAPES_3D = [(1, 1), (2, 3), (5, 7)]
# Layouts for out-of-place ops: (input layout, out layout or None, ndim);
# 3-D cases run on SHAPES_3D, 2-D ones on SHAPES_2D.
IN_OUT_LAYOUTS = {
    "2d_strided_rows": ("padded", None, 2),
    "3d": ("contig", None, 3),
    "3d_transposed": ("transposed", None, 3),
    "3d_gap": ("gap", None, 3),
    "2d_out": ("contig", "contig", 2),
    "2d_strided_out": ("padded", "padded", 2),
    "3d_transposed_gap_out": ("transposed", "gap", 3),
}
PAD = 5  # odd: padded rows start at addresses that are not vector-aligned


def seeded(*key):
    """A generator seeded deterministically from the test parameters."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def randn(shape, g, scale=1.0):
    return torch.randn(shape, generator=g, dtype=torch.float32) * scale


def make_rows(values, layout, g, *, pad=PAD, fill=None):
    """Place ``values`` ([..., D]) into a tensor with the requested row layout.

    Returns ``(view, backing, mask)``: ``view`` is the tensor handed to the op,
    ``backing`` the whole storage (pre-filled with random finite values) and
    ``mask`` marks the elements of ``backing`` that belong to ``view``.
    The last dim of ``view`` is always contiguous.

    layouts: "contig"; "padded" (row stride D + pad); "transposed" (3-D only:
    a [H, B, D+pad] buffer viewed as [B, H, D], so row strides are
    (D+pad, B*(D+pad)); "gap" (3-D only: the middle H rows of a [B, H+2, D]
    buffer, so consecutive batches are not contiguous).
    """
    shape = tuple(values.shape)
    D = shape[-1]
    if layout == "contig":
        bshape, fn = shape, (lambda t: t)
    elif layout == "padded":
        bshape, fn = shape[:-1] + (D + pad,), (lambda t: t[..., :D])
    elif layout == "transposed":
        assert len(shape) == 3
        B, H = shape[:2]
        bshape, fn = (H, B, D + pad), (lambda t: t[..., :D].transpose(0, 1))
    elif layout == "gap":
        assert len(shape) == 3
        B, H = shape[:2]
        bshape, fn = (B, H + 2, D), (lambda t: t[:, 1 : H + 1, :])
    else:
        raise AssertionError(layout)
    backing = randn(bshape, g).to(values.dtype)
    view = fn(backing)
    assert view.shape == values.shape and view.stride(-1) == 1
    if fill is None:
        view.copy_(values)
    else:
        view.fill_(fill)
    mask = torch.zeros(bshape, dtype=torch.bool)
    fn(mask).fill_(True)
    return view, backing, mask


def assert_outside_untouched(backing, before, mask, what):
    outside = ~mask
    assert torch.equal(backing[outside], before[outside]), (
        f"{what}: the op wrote to memory outside the tensor's view (row padding / gaps)"
    )


def thp_eligible(address: int) -> bool:
    """Whether the mapping holding ``address`` may be backed by transparent huge pages: what
    /proc/self/smaps says once the memory was advised (``MADV_HUGEPAGE``), or always where THP is."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's header: start-end perms ...
            start, end = (int(x, 16) for x in head.split("-"))
            mapping = start <= address < end
        elif mapping and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_OFF = not THP_SETTING.exists() or "[never]" in THP_SETTING.read_text()  # or not Linux
