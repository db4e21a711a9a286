"""Sampling ops with FlashInfer's names, signatures and semantics, sort-free.

Every filter keeps the entries ``x >= t`` of a row for one threshold ``t``,
so the result never depends on how ties are ordered:

* top-k: ``t`` is the k-th largest value; entries tied with it are all kept
  (more than k may survive). ``top_k >= vocab`` keeps every entry.
* top-p: ``t`` is the largest value with ``mass(x >= t) >= top_p * mass(row)``:
  the smallest set of largest entries reaching ``top_p`` of the mass, ties at
  the cut kept. ``top_p = 0`` keeps the largest entry and its ties (as
  FlashInfer's top-p renorm does); ``top_p >= 1`` keeps everything.
* min-p: ``t = min_p * max(row)``; ``min_p <= 0`` keeps everything.
* ``top_k_top_p``: ``filter_apply_order="top_k_first"`` applies top-p to the
  top-k renormalized row; ``"joint"`` keeps the intersection of both filters
  on the full row.

Sampling draws token ``i`` with probability ``x_i / mass(kept)`` by inverse CDF
in index order, from one uniform per output row: Philox4x32-10 keyed by
``seed`` with counter ``(row, offset)``. Without ``seed`` and ``offset`` the
seed is drawn from ``generator`` (torch's default CPU generator when None), so
the generator advances and consecutive calls differ. The kernels are
deterministic whatever the thread count; ``deterministic`` is accepted for
FlashInfer compatibility. A row with a NaN or without positive mass gives
token 0 and ``valid = False``.

Per-row parameters (``top_k``, ``top_p``, ``min_p``, softmax's ``temperature``)
are a Python number or a 1-D CPU tensor with one value per output row; a 0-D,
2-D or wrong-length tensor raises FlashInfer's ValueError, word for word.
``top_k`` / ``top_p`` / ``min_p`` tensors of any dtype are cast by value, as
FlashInfer's ``.int()`` / ``.float()`` (a float ``top_k`` truncates); a
``temperature`` tensor must be floating-point, as in FlashInfer. Values
FlashInfer leaves undefined (a hang, token 0 flagged invalid, NaN) raise
ValueError before any row is touched: ``top_k < 1``, ``top_p < 0``,
``min_p > 1``, NaN, and a temperature that is not finite and > 0.

``*_from_logits`` ops compute exactly :func:`softmax` and then the matching
``*_from_probs`` op, fused per row, so their samples are those of
``softmax`` followed by the ``*_from_probs`` op for the same seed.
"""

from __future__ import annotations

import inspect
from numbers import Integral, Real

import torch

from kernforge.jit.module import Codes, DType, Entry, Module, Struct
from kernforge.ops._common import check_no_overlap, num_threads, readable_rows, variant_for_input, writable_rows
from kernforge.ops._registry import ALL_DTYPES, Traced, export, kernel_op, model_kernels

_I64 = "int64_t"
# One kernel for every sampling op: which op is `action`; per-row parameters are a scalar or an
# array (`*_arr`, 0 when absent); addresses are int64. Filled by name from Python.
SAMPLING_ARGS = Struct(
    "kf_sampling_args",
    (
        ("action", _I64),
        ("input", _I64),
        ("input_stride", _I64),
        ("input_rows", _I64),
        ("vocab", _I64),
        ("from_logits", _I64),
        ("row_index", _I64),
        ("row_index_64", _I64),
        ("batch", _I64),
        ("top_k_arr", _I64),
        ("top_k", _I64),
        ("top_p_arr", _I64),
        ("top_p", "double"),
        ("min_p_arr", _I64),
        ("min_p", "double"),
        ("temperature_arr", _I64),
        ("temperature", "double"),
        ("top_k_first", _I64),
        ("seed_arr", _I64),
        ("seed_len", _I64),
        ("seed", _I64),
        ("offset_arr", _I64),
        ("offset_len", _I64),
        ("offset", _I64),
        ("samples", _I64),
        ("samples_64", _I64),
        ("valid", _I64),
        ("out", _I64),
        ("out_stride", _I64),
        ("num_threads", _I64),
    ),
)
# The contract with sampling/driver.h, declared here once and emitted into the template: which op a
# call is, and the argument errors the kernel reports as (kind << 32) | row before it touches a row.
ACTION = Codes("kf::sampling::Action", (("kSample", 0), ("kRenorm", 1), ("kMaskLogits", 2), ("kSoftmax", 3)))
PARAM_ERROR = Codes(
    "kf::sampling::ParamError",
    (
        ("kBadTopK", 1),
        ("kBadTopP", 2),
        ("kBadMinP", 3),
        ("kBadTemperature", 4),
        ("kBadIndex", 5),
    ),
)
SAMPLING = Module(
    "sampling",
    "sampling.cpp.jinja",
    params={"dtype": DType()},
    structs=[SAMPLING_ARGS],
    codes=[ACTION, PARAM_ERROR],
    entries=[Entry("run", "const kf_sampling_args* args", returns="int64_t")],
)
_FP32 = (torch.float32,)  # probabilities are fp32, as in FlashInfer

_SAMPLE, _RENORM, _MASK_LOGITS, _SOFTMAX = ACTION.kSample, ACTION.kRenorm, ACTION.kMaskLogits, ACTION.kSoftmax
_FILTER_ORDERS = ("top_k_first", "joint")

# Error kinds the kernel reports as (kind << 32) | row, checked before it touches any row.
_PARAM_RULES = {  # PARAM_ERROR -> (argument, its rule)
    "kBadTopK": ("top_k", "must be >= 1"),
    "kBadTopP": ("top_p", "must be >= 0"),
    "kBadMinP": ("min_p", "must be <= 1"),
    "kBadTemperature": ("temperature", "must be finite and > 0"),
    "kBadIndex": ("indices", "must be in [0, number of rows of the input)"),
}


class _Call:
    """The flat kernel arguments of one call; per-row tensors are kept alive here."""

    __slots__ = ("rows", "vocab", "batch", "stride", "args", "keep", "values")

    def __init__(self, x: torch.Tensor, name: str, indices):
        if x.dim() != 2:
            raise ValueError(f"{name} must be 2-D [batch, vocab], got shape {tuple(x.shape)}")
        x, _ = readable_rows(x, x.shape, x.stride())
        self.rows, self.vocab = x.shape
        if self.vocab < 1:
            raise ValueError(f"{name} must have a vocabulary of at least 1 entry, got shape {tuple(x.shape)}")
        self.stride = x.stride(0)
        self.keep = [x]
        self.values = {}  # argument name -> its Python scalar or tensor, for error messages
        self.batch = self.rows if indices is None else _checked_indices(indices, self.rows)
        self.args = {
            "input": x.data_ptr(),
            "input_stride": self.stride,
            "input_rows": self.rows,
            "vocab": self.vocab,
            "batch": self.batch,
            "row_index": 0,
            "row_index_64": 0,
            "top_k_arr": 0,
            "top_k": self.vocab,
            "top_p_arr": 0,
            "top_p": 1.0,
            "min_p_arr": 0,
            "min_p": 0.0,
            "temperature_arr": 0,
            "temperature": 1.0,
            "top_k_first": 1,
            "seed_arr": 0,
            "seed_len": 0,
            "seed": 0,
            "offset_arr": 0,
            "offset_len": 0,
            "offset": 0,
            "samples": 0,
            "samples_64": 0,
            "valid": 0,
            "out": 0,
            "out_stride": 0,
        }
        if indices is not None:
            indices = indices.contiguous()
            self.keep.append(indices)
            self.args["row_index"] = indices.data_ptr()
            self.args["row_index_64"] = int(indices.dtype == torch.int64)
            self.values["indices"] = indices

    def per_row(self, name: str, value, integral: bool) -> None:
        """A per-request parameter: a Python number or a [batch] tensor, checked as FlashInfer does."""
        if value is None:
            return
        self.values[name] = value
        if isinstance(value, torch.Tensor):
            self.args[f"{name}_arr"] = self._row_tensor(name, value, integral).data_ptr()
            return
        if isinstance(value, bool) or not isinstance(value, Integral if integral else Real):
            if name == "temperature":  # FlashInfer's _validate_softmax_temperature
                raise TypeError(
                    "temperature must be None, a real scalar, or a 1D floating-point tensor with one "
                    "value per logits row"
                )
            kind = "an int" if integral else "a float"
            raise TypeError(f"{name} must be {kind} or a [batch] tensor, got {type(value).__name__}")
        if integral:
            value = max(min(int(value), self.vocab), -1)  # k >= vocab means no top-k; keep < 1 an error
        self.args[name] = value

    def _row_tensor(self, name: str, t: torch.Tensor, integral: bool) -> torch.Tensor:
        """``t`` after FlashInfer's checks, cast by value (FlashInfer's ``.int()`` / ``.float()``) to the
        kernel's int64 / fp32; one value per output row."""
        if name == "temperature":
            _check_temperature_tensor(t, self.batch)
        else:
            _check_param_tensor(name, t, self.batch)
        if not t.is_cpu:
            raise ValueError(f"{name} is on device {t.device}; kernforge kernels run on the CPU")
        t = t.to(torch.int64 if integral else torch.float32).contiguous()
        self.keep.append(t)
        return t

    def random_stream(self, generator, seed, offset) -> None:
        """Philox seed and offset: given explicitly, or a fresh seed drawn from the generator."""
        if seed is None or offset is None:
            generator = torch.default_generator if generator is None else generator
            if not isinstance(generator, torch.Generator):
                raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
            if generator.device.type != "cpu":
                raise ValueError(f"generator is on device {generator.device}; kernforge needs a CPU generator")
            seed, offset = int(torch.empty((), dtype=torch.int64).random_(generator=generator)), 0
        for name, value in (("seed", seed), ("offset", offset)):
            if isinstance(value, torch.Tensor):
                if value.dtype not in (torch.int64, torch.uint64) or value.dim() != 1:
                    raise TypeError(
                        f"{name} must be an int or a 1-D int64 tensor, got {value.dtype} {tuple(value.shape)}"
                    )
                if value.numel() not in (1, self.batch) or not value.is_cpu:
                    raise ValueError(
                        f"{name} must be a CPU tensor of length 1 or {self.batch}, got {tuple(value.shape)}"
                    )
                value = value.view(torch.int64).contiguous()
                self.keep.append(value)
                self.args[f"{name}_arr"], self.args[f"{name}_len"] = value.data_ptr(), value.numel()
            elif isinstance(value, Integral) and not isinstance(value, bool):
                self.args[name] = (int(value) + 2**63) % 2**64 - 2**63  # any int, as its low 64 bits
            else:
                raise TypeError(f"{name} must be an int or an int64 tensor, got {type(value).__name__}")

    def run(self, variant, action: int, from_logits: bool) -> None:
        if not self.batch:
            return
        kernel = variant.kernel()
        self.args.update(action=action, from_logits=int(from_logits), num_threads=num_threads())
        status = kernel.run(kernel.new("kf_sampling_args", self.args))
        if status:
            self._raise_param_error(status >> 32, status & 0xFFFFFFFF)

    def _raise_param_error(self, kind: int, row: int) -> None:
        name, rule = _PARAM_RULES[PARAM_ERROR.name_of(kind)]
        value = self.values.get(name)
        if isinstance(value, torch.Tensor):
            raise ValueError(f"{name} {rule}, got {name}[{row}] = {value[row].item()}")
        raise ValueError(f"{name} {rule}, got {value}")


def _checked_out(out, shape, dtype) -> torch.Tensor:
    """The caller's ``out`` after its checks, or a new tensor."""
    if out is None:
        return torch.empty(shape, dtype=dtype)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out.dtype != dtype:
        raise TypeError(f"out must have dtype {dtype}, got {out.dtype}")
    if not out.is_cpu:
        raise ValueError(f"out is on device {out.device}; kernforge kernels run on the CPU")
    if out.shape != shape:
        raise ValueError(f"out must have shape {tuple(shape)}, got {tuple(out.shape)}")
    writable_rows(shape, out.stride(), "out")
    return out


def _param_error(name: str, message: str) -> ValueError:
    """FlashInfer's ValueError, word for word; a note (shown in tracebacks) names the parameter."""
    error = ValueError(message)
    if hasattr(error, "add_note"):  # Python >= 3.11
        error.add_note(f"(kernforge: the sampling parameter is {name})")
    return error


def _check_param_tensor(name: str, t: torch.Tensor, batch: int) -> None:
    """FlashInfer's check_tensor_param (csrc/sampling_utils.h) for a top_k / top_p / min_p tensor.
    Its reference length is the number of output rows (FlashInfer's probs.size(0) without indices)."""
    if t.dim() == 0:
        raise _param_error(
            name,
            "Expected a 1D tensor of shape (batch_size,) or scalar for the sampling "
            "parameter, but got a 0-dimensional tensor.",
        )
    if t.dim() > 1:
        raise _param_error(
            name, f"Expected a 1D tensor or scalar for the sampling parameter, but got a {t.dim()}D tensor."
        )
    if t.shape[0] != batch:
        raise _param_error(
            name,
            f"Sampling parameter tensor batch size mismatch: expected length {batch} to "
            f"match the reference tensor batch size, but got length {t.shape[0]}.",
        )


_TEMPERATURE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_temperature_tensor(t: torch.Tensor, rows: int) -> None:
    """FlashInfer's _validate_softmax_temperature (flashinfer/sampling.py) for a temperature tensor."""
    if t.dim() != 1:
        raise ValueError(f"temperature tensor must be 1D with one value per logits row, got shape {tuple(t.shape)}")
    if t.shape[0] != rows:
        raise ValueError(f"temperature tensor length must equal logits.size(0) ({rows}), got {t.shape[0]}")
    if not t.is_cpu:
        raise ValueError(f"temperature tensor must be on the same device as logits (cpu), got {t.device}")
    if t.dtype not in _TEMPERATURE_DTYPES:
        raise ValueError(f"temperature tensor must have dtype float16, bfloat16, float32, or float64, got {t.dtype}")


def _checked_indices(indices, rows: int) -> int:
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be a torch.Tensor or None, got {type(indices).__name__}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"indices must have dtype torch.int32 or torch.int64, got {indices.dtype}")
    if indices.dim() != 1 or not indices.is_cpu:
        raise ValueError(f"indices must be a 1-D CPU tensor, got shape {tuple(indices.shape)} on {indices.device}")
    return indices.shape[0]


def _input(x, name: str, kernels, check_nan: bool = False):
    """The variant for input ``x`` (one of the op's dtypes), after the type and NaN checks."""
    if isinstance(x, torch.Tensor) and x.dtype in ALL_DTYPES and x.dtype not in kernels.dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(str(d) for d in kernels.dtypes)}, got {x.dtype}")
    variant = variant_for_input(kernels, x, name)
    if check_nan and torch.isnan(x).any():
        raise ValueError(f"{name} contains NaN")
    return variant


def _sample(
    x,
    name,
    kernels,
    *,
    from_logits,
    indices,
    generator,
    check_nan,
    seed,
    offset,
    return_valid,
    top_k=None,
    top_p=None,
    min_p=None,
    filter_apply_order="top_k_first",
):
    variant = _input(x, name, kernels, check_nan)
    if filter_apply_order not in _FILTER_ORDERS:
        raise ValueError(f"filter_apply_order must be 'top_k_first' or 'joint', got {filter_apply_order!r}")
    call = _Call(x, name, indices)
    call.per_row("top_k", top_k, integral=True)
    call.per_row("top_p", top_p, integral=False)
    call.per_row("min_p", min_p, integral=False)
    call.args["top_k_first"] = int(filter_apply_order == "top_k_first")
    call.random_stream(generator, seed, offset)
    samples = torch.empty(call.batch, dtype=torch.int32 if indices is None else indices.dtype)
    valid = torch.empty(call.batch, dtype=torch.bool)
    call.args.update(samples=samples.data_ptr(), samples_64=int(samples.dtype == torch.int64), valid=valid.data_ptr())
    call.run(variant, _SAMPLE, from_logits)
    return (samples, valid) if return_valid else samples


def _rows_out(x, name, kernels, action, out, out_dtype=None, **per_row):
    """Renorm / mask / softmax: one output row per input row, into ``out`` (which may be ``x``)."""
    variant = _input(x, name, kernels)
    call = _Call(x, name, None)
    for param, value in per_row.items():
        call.per_row(param, value, integral=param == "top_k")
    given = out is not None
    out = _checked_out(out, x.shape, out_dtype or x.dtype)
    if given:
        check_no_overlap(out, "out", x, name, same_ok=True)  # in place works: each row is read, then written
    call.args.update(out=out.data_ptr(), out_stride=out.stride(0))
    call.run(variant, action, from_logits=action == _SOFTMAX)
    return out


# --------------------------------------------------------------------------- public ops


@kernel_op(SAMPLING, ALL_DTYPES)
def softmax(
    logits: torch.Tensor,
    temperature: float | torch.Tensor | None = None,
    enable_pdl: bool | None = None,
    out: torch.Tensor | None = None,
):
    """``torch.softmax(logits / temperature, -1)`` in fp32; temperature a float or a [batch] tensor.
    ``enable_pdl`` is a GPU launch option, accepted for FlashInfer compatibility. ``out`` (fp32, an
    addition to FlashInfer's signature, like the renorm ops'): a preallocated result, or fp32
    ``logits`` themselves."""
    return _rows_out(logits, "logits", softmax.kernels, _SOFTMAX, out, torch.float32, temperature=temperature)


@kernel_op(SAMPLING, _FP32)
def sampling_from_probs(
    probs, indices=None, deterministic=True, generator=None, check_nan=False, seed=None, offset=None, return_valid=False
):
    """A token per output row, drawn from the categorical distribution ``probs`` (fp32 [rows, vocab])."""
    return _sample(
        probs,
        "probs",
        sampling_from_probs.kernels,
        from_logits=False,
        indices=indices,
        generator=generator,
        check_nan=check_nan,
        seed=seed,
        offset=offset,
        return_valid=return_valid,
    )


@kernel_op(SAMPLING, ALL_DTYPES)
def sampling_from_logits(
    logits,
    indices=None,
    deterministic=True,
    generator=None,
    check_nan=False,
    seed=None,
    offset=None,
    return_valid=False,
):
    """``sampling_from_probs(softmax(logits))``, fused per row."""
    return _sample(
        logits,
        "logits",
        sampling_from_logits.kernels,
        from_logits=True,
        indices=indices,
        generator=generator,
        check_nan=check_nan,
        seed=seed,
        offset=offset,
        return_valid=return_valid,
    )


@kernel_op(SAMPLING, _FP32)
def top_p_sampling_from_probs(
    probs,
    top_p,
    indices=None,
    deterministic=True,
    generator=None,
    check_nan=False,
    seed=None,
    offset=None,
    return_valid=False,
):
    """Nucleus sampling: draw among the smallest set of largest probabilities holding ``top_p`` of the mass."""
    return _sample(
        probs,
        "probs",
        top_p_sampling_from_probs.kernels,
        from_logits=False,
        indices=indices,
        generator=generator,
        check_nan=check_nan,
        seed=seed,
        offset=offset,
        return_valid=return_valid,
        top_p=top_p,
    )


@kernel_op(SAMPLING, _FP32)
def top_k_sampling_from_probs(
    probs,
    top_k,
    indices=None,
    deterministic=True,
    generator=None,
    check_nan=False,
    seed=None,
    offset=None,
    return_valid=False,
):
    """Draw among the ``top_k`` largest probabilities (and entries tied with the k-th)."""
    return _sample(
        probs,
        "probs",
        top_k_sampling_from_probs.kernels,
        from_logits=False,
        indices=indices,
        generator=generator,
        check_nan=check_nan,
        seed=seed,
        offset=offset,
        return_valid=return_valid,
        top_k=top_k,
    )


@kernel_op(SAMPLING, _FP32)
def min_p_sampling_from_probs(
    probs,
    min_p,
    indices=None,
    deterministic=True,
    generator=None,
    check_nan=False,
    seed=None,
    offset=None,
    return_valid=False,
):
    """Draw among the probabilities >= ``min_p * max(probs)``."""
    return _sample(
        probs,
        "probs",
        min_p_sampling_from_probs.kernels,
        from_logits=False,
        indices=indices,
        generator=generator,
        check_nan=check_nan,
        seed=seed,
        offset=offset,
        return_valid=return_valid,
        min_p=min_p,
    )


@kernel_op(SAMPLING, _FP32)
def top_k_top_p_sampling_from_probs(
    probs,
    top_k,
    top_p,
    indices=None,
    filter_apply_order="top_k_first",
    deterministic=True,
    generator=None,
    check_nan=False,
    seed=None,
    offset=None,
    return_valid=False,
):
    """Top-k then top-p (``"top_k_first"``), or both on the full row (``"joint"``), then sample."""
    return _sample(
        probs,
        "probs",
        top_k_top_p_sampling_from_probs.kernels,
        from_logits=False,
        indices=indices,
        generator=generator,
        check_nan=check_nan,
        seed=seed,
        offset=offset,
        return_valid=return_valid,
        top_k=top_k,
        top_p=top_p,
        filter_apply_order=filter_apply_order,
    )


# The sampler's custom op takes ``top_k``/``top_p`` as ``[batch]`` tensors and the Philox
# ``seed``/``offset`` as int64 tensors, so it is a pure function of its inputs; it always returns
# ``valid`` as well. Traced, the op's Python values become those tensors; without ``seed``, one is
# drawn from the generator by a traced ``randint``, as the op does eagerly.
def _sampler_from_schema(logits, top_k, top_p, seed, offset, indices=None, filter_apply_order="top_k_first"):
    return top_k_top_p_sampling_from_logits(
        logits, top_k, top_p, indices, filter_apply_order, seed=seed, offset=offset, return_valid=True
    )


def _sampler_fake(logits, top_k, top_p, seed, offset, indices=None, filter_apply_order="top_k_first"):
    batch, dtype = (logits.shape[0], torch.int32) if indices is None else (indices.shape[0], indices.dtype)
    return logits.new_empty(batch, dtype=dtype), logits.new_empty(batch, dtype=torch.bool)


def _per_row(value, batch: int, dtype: torch.dtype) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.full((batch,), value, dtype=dtype)


def _int64_tensor(value) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.tensor([value], dtype=torch.int64)


def _sampler_arguments(*args, **kwargs) -> dict:
    bound = inspect.signature(top_k_top_p_sampling_from_logits).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _sampler_to_schema(*args, **kwargs):
    a = _sampler_arguments(*args, **kwargs)
    logits, indices, top_k, seed, offset = a["logits"], a["indices"], a["top_k"], a["seed"], a["offset"]
    if a["check_nan"]:
        raise NotImplementedError("check_nan reads the logits in Python: not available under torch.compile")
    batch = logits.shape[0] if indices is None else indices.shape[0]
    if not isinstance(top_k, torch.Tensor):
        top_k = min(top_k, logits.shape[1])  # as eagerly: k >= vocab means no top-k
    if seed is None or offset is None:  # as eagerly: a fresh seed from the generator, offset 0
        seed, offset = torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64, generator=a["generator"]), 0
    per_row = (_per_row(top_k, batch, torch.int64), _per_row(a["top_p"], batch, torch.float32))
    return (logits, *per_row, _int64_tensor(seed), _int64_tensor(offset), indices, a["filter_apply_order"]), None


def _sampler_result(outputs, *args, **kwargs):
    return outputs if _sampler_arguments(*args, **kwargs)["return_valid"] else outputs[0]


_SAMPLER_TRACED = Traced(
    "(Tensor samples, Tensor valid)",
    fake=_sampler_fake,
    arguments="Tensor logits, Tensor top_k, Tensor top_p, Tensor seed, Tensor offset, Tensor? indices=None, "
    'str filter_apply_order="top_k_first"',
    from_schema=_sampler_from_schema,
    to_schema=_sampler_to_schema,
    result=_sampler_result,
)


@kernel_op(SAMPLING, ALL_DTYPES, traced=_SAMPLER_TRACED)
def top_k_top_p_sampling_from_logits(
    logits,
    top_k,
    top_p,
    indices=None,
    filter_apply_order="top_k_first",
    deterministic=True,
    generator=None,
    check_nan=False,
    seed=None,
    offset=None,
    return_valid=False,
):
    """``top_k_top_p_sampling_from_probs(softmax(logits), ...)``, fused per row."""
    return _sample(
        logits,
        "logits",
        top_k_top_p_sampling_from_logits.kernels,
        from_logits=True,
        indices=indices,
        generator=generator,
        check_nan=check_nan,
        seed=seed,
        offset=offset,
        return_valid=return_valid,
        top_k=top_k,
        top_p=top_p,
        filter_apply_order=filter_apply_order,
    )


# The row-output ops take ``out=`` beyond FlashInfer's signatures: a preallocated result (or the
# input itself, in place) avoids a fresh allocation per call, which for outputs of 32 MiB or more
# page-faults on every call under glibc malloc and can cost more than the kernel.


@kernel_op(SAMPLING, ALL_DTYPES)
def top_p_renorm_probs(probs, top_p, out=None):
    """Zero the entries outside the top-p set and renormalize; same dtype as ``probs``."""
    return _rows_out(probs, "probs", top_p_renorm_probs.kernels, _RENORM, out, top_p=top_p)


@kernel_op(SAMPLING, ALL_DTYPES)
def top_k_renorm_probs(probs, top_k, out=None):
    """Zero the entries below the k-th largest and renormalize; same dtype as ``probs``."""
    return _rows_out(probs, "probs", top_k_renorm_probs.kernels, _RENORM, out, top_k=top_k)


@kernel_op(SAMPLING, ALL_DTYPES)
def top_k_mask_logits(logits, top_k, out=None):
    """Set the logits below the k-th largest to -inf; same dtype as ``logits``."""
    return _rows_out(logits, "logits", top_k_mask_logits.kernels, _MASK_LOGITS, out, top_k=top_k)


# FlashInfer's older singular names, which SGLang still calls.
top_p_renorm_prob = export("top_p_renorm_prob", top_p_renorm_probs)
top_k_renorm_prob = export("top_k_renorm_prob", top_k_renorm_probs)


@model_kernels
def _for_model(spec, kv_cache_dtypes, quant) -> list[dict]:
    return [
        {"op": "top_k_top_p_sampling_from_probs", "dtype": "fp32"},  # the sampler, on fp32 probs
        {"op": "top_k_top_p_sampling_from_logits", "dtype": spec.dtype},  # and on the model's logits
    ]
