"""``from_pretrained(path)``: a model directory (``config.json`` and safetensors files) loaded straight
into a kernforge-optimized transformers model, four-bit checkpoints without ever holding their
weights in bf16.

* The model is built from its config on the meta device (``AutoModelForCausalLM.from_config``), and
  each tensor is read from its file when it is needed, one at a time, into memory of its own (plain
  reads, no mmap: safetensors' own ``safe_open`` hands out views of a mapping of the whole file, whose
  pages count toward the process's resident memory until the last tensor of the file is gone, so a
  checkpoint read through it would sit in memory twice, as the file and as the packed weights).
  Sharded checkpoints (``model.safetensors.index.json``) too.
* Plain (bf16, fp16, fp32) checkpoints: the weights go into the model as they are (cast to
  ``dtype``), then :func:`~kernforge.integrations.transformers.optimize` with ``quant``. A checkpoint
  whose tensor names are not the model's (one that transformers converts as it loads, such as a
  mixture of experts stored expert by expert) is loaded by transformers' ``from_pretrained`` instead.
* Four-bit checkpoints (``quantization_config``; dense Llama-family models, :data:`DENSE_MODEL_TYPES`):
  each quantized linear becomes a :class:`Int4CheckpointLinear` that knows where its tensors are in
  the files, still packed as stored; ``optimize`` reads and packs them for kernforge's kernels layer
  by layer (each one's codes unpacked from the nibble order ``convert_weight_packed_scale_zp`` reads,
  q|k|v and gate|up concatenated along N, then ``pack_int4``), so no more than one fused layer's codes
  are ever unpacked; the heap's freed pages go back to the OS between layers (glibc's
  ``malloc_trim``), so that peak memory is the packed model plus one layer's temporaries.
  ``quant="int4"`` (W4A8, activations quantized per token to int8 in the GEMM: the default) or
  ``"int4_w4a16"``. Taken (:func:`checkpoint_scheme`):

  - AWQ (``quant_method: awq``, ``version: gemm``, ``bits: 4``, zero points): ``qweight [K, N/8]``
    in AWQ's nibble order, ``qzeros [G, N/8]``, ``scales [G, N]``;
  - GPTQ (``quant_method: gptq``, ``bits: 4``, ``checkpoint_format`` ``gptq`` (zero points stored
    minus one) or ``gptq_v2``, symmetric or not): ``qweight [K/8, N]``, ``qzeros [G, N/8]``,
    ``scales [G, N]``; ``desc_act`` only where ``g_idx`` is the trivial ``k // group_size`` (a
    permuted K is refused);
  - compressed-tensors (``quant_method: compressed-tensors``, ``format`` ``pack-quantized``, or
    ``int-quantized`` with 4-bit weights, llm-compressor's W4A8): 4-bit int weights per group or per
    channel, static, without activation reordering; activations none (W4A16) or dynamic symmetric
    int8 per token (W4A8): ``weight_packed [N, K/8]`` (values + 8), ``weight_scale [N, G]``,
    ``weight_zero_point [N/8, G]`` where asymmetric.

  Linears the checkpoint keeps unquantized (AWQ's ``modules_to_not_convert``, compressed-tensors'
  ``ignore``) load as plain weights, and ``optimize`` applies ``quant`` to those in the decoder
  (``lm_head`` stays bf16 unless ``quant_lm_head``). A checkpoint that quantizes ``lm_head`` runs it
  four-bit too (``quant_lm_head=True`` unless given). Anything else (other bit widths, AWQ's GEMV,
  Marlin or exllama layouts, GPTQ's marlin/bitblas formats, act-order, static or fp8 activations,
  quantized KV caches, sparsity, transforms) raises ValueError naming what is not taken.
"""

from __future__ import annotations

import json
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kernforge.memory import trim_heap
from kernforge.nn.linear import Int4LinearWeights
from kernforge.ops.gemm import int4

__all__ = ["Int4CheckpointLinear", "Int4Scheme", "SafetensorsFiles", "checkpoint_scheme", "from_pretrained"]

# Four-bit checkpoints of these model types (dense Llama-family decoders) are taken.
DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8c + j of an AWQ word is its nibble _AWQ_ORDER[j]
_SEQUENTIAL = tuple(range(8))
assert sys.byteorder == "little", "safetensors and the nibble unpacking here read little-endian words"
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # old checkpoints' RoPE buffers (recomputed)


def from_pretrained(path, *, dtype: torch.dtype = torch.bfloat16, quant: str | None = None, **optimize_kwargs):
    """Load the model directory ``path`` (``config.json``, ``*.safetensors``) as a kernforge-optimized
    transformers causal LM in ``dtype``; ``optimize_kwargs`` go to
    :func:`~kernforge.integrations.transformers.optimize` (``kv_cache_pages``, ``page_size``,
    ``quant_lm_head``, ``tp_group``). ``quant``: for a plain checkpoint, optimize's (None, "int8",
    "int4", ...); for a four-bit one, "int4" (W4A8, the default) or "int4_w4a16"."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kernforge.integrations.transformers import optimize

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a transformers model directory")
    config_dict = json.loads(config_file.read_text())
    scheme = checkpoint_scheme(config_dict)
    if scheme is not None:
        quant = _four_bit_quant(quant, scheme)
        model_type = config_dict.get("model_type")
        if model_type not in DENSE_MODEL_TYPES:
            raise ValueError(
                f"four-bit checkpoints of model_type {model_type!r} are not taken: from_pretrained reads "
                f"them for dense Llama-family models ({', '.join(DENSE_MODEL_TYPES)})"
            )
        if optimize_kwargs.get("tp_group") is not None:
            raise ValueError("tensor parallelism (tp_group) is not taken with a four-bit checkpoint")
    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):  # read here; transformers' quantizers must not see it
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with SafetensorsFiles(path) as files:
        if scheme is None:
            if not _load_plain(model, files, skip=()):
                model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        else:
            holders = _load_four_bit(model, files, scheme)
            if not _load_plain(model, files, skip=holders):
                raise ValueError(f"{path}: {_mismatch(model, files, holders)}")
            if isinstance(model.lm_head, Int4LinearWeights):
                optimize_kwargs.setdefault("quant_lm_head", True)
        _materialize_buffers(model)
        _load_generation_config(model, path)
        model = optimize(model.eval(), quant=quant, **optimize_kwargs)  # reads and packs the four-bit layers
    left = [name for name, module in model.named_modules() if isinstance(module, Int4LinearWeights)]
    if left:
        raise ValueError(f"four-bit linears optimize() did not pack (no kernforge path for them): {', '.join(left)}")
    return model


# --------------------------------------------------------------------------- safetensors

_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    nbytes: int


class SafetensorsFiles:
    """The tensors of a model directory's safetensors files (``model.safetensors``, or the shards
    ``model.safetensors.index.json`` names, or every ``*.safetensors``): names, shapes and dtypes from
    the headers; :meth:`read` reads one tensor into memory of its own (no mmap). A context manager."""

    def __init__(self, path):
        self._entries: dict[str, _Entry] = {}
        self._handles: dict[Path, object] = {}
        for file in _safetensors_files(Path(path)):
            for name, entry in _header(file).items():
                if name in self._entries:
                    raise ValueError(f"tensor {name!r} is in both {self._entries[name].file.name} and {file.name}")
                self._entries[name] = entry

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._entries[name].dtype

    def read(self, name: str) -> torch.Tensor:
        entry = self._entries[name]
        out = torch.empty(entry.nbytes, dtype=torch.uint8)
        handle = self._handles.get(entry.file)
        if handle is None:
            handle = self._handles[entry.file] = open(entry.file, "rb", buffering=0)  # noqa: SIM115 (closed in close())
        handle.seek(entry.start)
        view, filled = memoryview(out.numpy()), 0
        while filled < entry.nbytes:
            got = handle.readinto(view[filled:])
            if not got:
                raise ValueError(f"{entry.file} ends inside tensor {name!r}")
            filled += got
        return out.view(entry.dtype).reshape(entry.shape)

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()

    def __enter__(self) -> SafetensorsFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = [path / name for name in sorted(set(weight_map.values()))]
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no safetensors files (from_pretrained reads only safetensors)")
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{file} (named in {index.name}) does not exist")
    return files


def _header(file: Path) -> dict[str, _Entry]:
    """The tensors a safetensors file holds: an 8-byte little-endian header length, the JSON header,
    then the data (offsets relative to its start)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw = f.read(8)
        length = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if not 0 < length <= min(_MAX_HEADER, size - 8):
            raise ValueError(f"{file} is not a safetensors file (header length {length})")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise ValueError(f"{file}: unreadable safetensors header ({exc})") from None
    data, entries = 8 + length, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"{file}: tensor {name!r} has dtype {info.get('dtype')!r}, which is not read here")
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(o) for o in info["data_offsets"])
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        if end - begin != nbytes or begin < 0 or data + end > size:
            raise ValueError(f"{file}: tensor {name!r} ({info}) does not fit its shape or the file")
        entries[name] = _Entry(file, dtype, shape, data + begin, nbytes)
    return entries


# --------------------------------------------------------------------------- schemes


@dataclass(frozen=True)
class Int4Scheme:
    """A checkpoint's four-bit quantization as from_pretrained reads it."""

    method: str  # "awq", "gptq", "compressed-tensors"
    gptq_v1: bool = False  # GPTQ's checkpoint_format "gptq": zero points stored minus one
    activations: str = "W4A16"  # what the checkpoint declares (compressed-tensors' W4A8: dynamic int8 per token)


def checkpoint_scheme(config: dict) -> Int4Scheme | None:
    """The four-bit scheme of a ``config.json`` (as a dict), None without ``quantization_config``;
    ValueError naming what is not taken."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        return _awq_scheme(qc)
    if method == "gptq":
        return _gptq_scheme(qc)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc)
    raise ValueError(
        f"quantization_config quant_method {qc.get('quant_method')!r} is not taken: from_pretrained reads "
        "four-bit AWQ (GEMM), GPTQ and compressed-tensors (pack-quantized) checkpoints"
    )


def _refuse(what: str) -> ValueError:
    return ValueError(f"{what} is not taken: from_pretrained reads four-bit AWQ (GEMM), GPTQ (gptq, gptq_v2, no "
                      "act-order) and compressed-tensors pack-quantized checkpoints")  # fmt: skip


def _awq_scheme(qc: dict) -> Int4Scheme:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _refuse(f"AWQ with bits {bits!r}")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(
            f"AWQ version {qc.get('version')!r} (only GEMM's packing; not GEMV, GEMV_fast, Marlin, exllama, IPEX)"
        )
    if qc.get("zero_point", True) is False:
        raise _refuse("AWQ without zero points (zero_point: false)")
    return Int4Scheme("awq")


def _gptq_scheme(qc: dict) -> Int4Scheme:
    bits = qc.get("bits")
    if bits != 4:
        raise _refuse(f"GPTQ with bits {bits!r}")
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"GPTQ checkpoint_format {fmt!r} (gptq and gptq_v2 are; marlin, bitblas, ... are not)")
    if qc.get("is_marlin_format"):
        raise _refuse("GPTQ in Marlin's format (is_marlin_format)")
    pack_dtype = str(qc.get("pack_dtype", "int32")).removeprefix("torch.")
    if pack_dtype != "int32":
        raise _refuse(f"GPTQ pack_dtype {pack_dtype!r} (words of int32 are)")
    if qc.get("dynamic"):
        raise _refuse("GPTQ with per-module overrides (dynamic)")
    return Int4Scheme("gptq", gptq_v1=fmt == "gptq")


def _compressed_tensors_scheme(qc: dict) -> Int4Scheme:
    top_format = qc.get("format")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _refuse("a compressed-tensors config without config_groups")
    for key in ("kv_cache_scheme", "transform_config"):
        if qc.get(key):
            raise _refuse(f"compressed-tensors {key}")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format") not in (None, "dense"):
        raise _refuse(f"compressed-tensors sparsity (format {sparsity.get('format')!r})")
    status = qc.get("quantization_status")
    if status not in (None, "compressed"):
        raise _refuse(f"compressed-tensors quantization_status {status!r} (weights not compressed)")
    activations = set()
    for name, group in groups.items():
        fmt = group.get("format") or top_format
        if fmt not in ("pack-quantized", "int-quantized"):
            raise _refuse(f"compressed-tensors format {fmt!r} (group {name})")
        w = group.get("weights") or {}
        if w.get("num_bits") != 4 or w.get("type", "int") != "int":
            raise _refuse(
                f"compressed-tensors weights of {w.get('num_bits')} bits, type {w.get('type')!r} (group {name})"
            )
        if w.get("strategy") not in ("group", "channel"):
            raise _refuse(
                f"compressed-tensors weight strategy {w.get('strategy')!r} (group {name}; group and channel are)"
            )
        if w.get("dynamic"):
            raise _refuse(f"compressed-tensors dynamic weight quantization (group {name})")
        if w.get("actorder") not in (None, False, "weight", "static"):
            raise _refuse(f"compressed-tensors actorder {w.get('actorder')!r} (act-order, a permuted K; group {name})")
        if fmt == "int-quantized" and not w.get("symmetric", True):
            raise _refuse(f"compressed-tensors int-quantized asymmetric 4-bit weights (group {name})")
        if group.get("output_activations"):
            raise _refuse(f"compressed-tensors output_activations (group {name})")
        a = group.get("input_activations")
        if a:
            dynamic_int8 = (
                a.get("num_bits") == 8
                and a.get("type", "int") == "int"
                and a.get("strategy") == "token"
                and a.get("dynamic") in (True, "true")
                and a.get("symmetric", True)
            )
            if not dynamic_int8:
                raise _refuse(
                    f"compressed-tensors input_activations {a} (group {name}; dynamic symmetric int8 per token is)"
                )
            activations.add("W4A8")
        else:
            activations.add("W4A16")
    return Int4Scheme("compressed-tensors", activations="W4A8" if activations == {"W4A8"} else "W4A16")


def _four_bit_quant(quant: str | None, scheme: Int4Scheme) -> str:
    if quant is None:
        return "int4"
    if quant not in int4.QUANTS:
        raise ValueError(
            f"a four-bit {scheme.method} checkpoint runs as quant='int4' (W4A8, the default) or 'int4_w4a16', "
            f"not quant={quant!r}"
        )
    return quant


# --------------------------------------------------------------------------- four-bit linears

# per layout: the tensors of a quantized linear (name -> whether required)
_LAYOUT_TENSORS = {
    "awq": {"qweight": True, "qzeros": True, "scales": True, "bias": False},
    "gptq": {"qweight": True, "qzeros": True, "scales": True, "g_idx": False, "bias": False},
    "pack-quantized": {
        "weight_packed": True,
        "weight_scale": True,
        "weight_zero_point": False,
        "weight_shape": False,
        "weight_g_idx": False,
        "bias": False,
    },
    "int-quantized": {
        "weight": True,
        "weight_scale": True,
        "weight_zero_point": False,
        "weight_g_idx": False,
        "bias": False,
    },
}


class Int4CheckpointLinear(Int4LinearWeights):
    """A quantized linear of a checkpoint, where an ``nn.Linear`` would be, until ``optimize`` packs
    it: the names of its tensors in :class:`SafetensorsFiles` (read when packed, never kept), its
    layout (``awq``, ``gptq``, ``pack-quantized``, ``int-quantized``) and its bias."""

    def __init__(self, files: SafetensorsFiles, prefix: str, layout: str, scheme: Int4Scheme, layer: nn.Linear):
        names = {suffix: f"{prefix}.{suffix}" for suffix in _LAYOUT_TENSORS[layout] if f"{prefix}.{suffix}" in files}
        for suffix, required in _LAYOUT_TENSORS[layout].items():
            if required and suffix not in names:
                raise ValueError(f"{prefix} ({layout}) has no {suffix} tensor")
        bias = files.read(names["bias"]) if "bias" in names else None
        super().__init__(None, bias, layer.in_features, layer.out_features)
        self.files, self.prefix, self.layout, self.scheme, self.names = files, prefix, layout, scheme, names
        self.group_count = self._check_shapes()
        if "g_idx" in names or "weight_g_idx" in names:
            self._check_g_idx(files.read(names.get("g_idx") or names["weight_g_idx"]))

    def _check_shapes(self) -> int:
        """The checkpoint's shapes against the model's [N, K]; returns G."""
        files, names, n, k = self.files, self.names, self.out_features, self.in_features
        shape = {suffix: files.shape(name) for suffix, name in names.items()}
        scale = "scales" if "scales" in names else "weight_scale"
        words = (8 * (-(-n // 8)), 8 * (-(-k // 8)))
        if self.layout in ("awq", "gptq"):
            groups = shape["scales"][0] if len(shape["scales"]) == 2 else -1
            expected = {
                "qweight": (k, n // 8) if self.layout == "awq" else (k // 8, n),
                "qzeros": (groups, n // 8),
                "scales": (groups, n),
                "g_idx": (k,),
            }
            exact = n % 8 == 0 and k % 8 == 0
        else:
            groups = shape["weight_scale"][1] if len(shape["weight_scale"]) == 2 else -1
            expected = {
                "weight_packed": (n, words[1] // 8),
                "weight": (n, k),
                "weight_scale": (n, groups),
                "weight_zero_point": (words[0] // 8, groups),
                "weight_g_idx": (k,),
            }
            exact = True
        expected["bias"] = (n,)
        wrong = [f"{s} {shape[s]} (expected {expected[s]})" for s in names if s in expected and shape[s] != expected[s]]
        if not exact or wrong or groups < 1:
            raise ValueError(
                f"{self.prefix} ({self.layout}) does not match the model's linear [N, K] = [{n}, {k}]: "
                + ("; ".join(wrong) or f"N and K must be multiples of 8, scales {shape[scale]}")
            )
        if "weight_shape" in names:
            stored = tuple(int(d) for d in files.read(names["weight_shape"]).tolist())
            if stored != (n, k):
                raise ValueError(f"{self.prefix}.weight_shape is {stored}; the model's linear is [{n}, {k}]")
        for suffix in ("qweight", "qzeros", "weight_packed", "weight_zero_point"):
            if suffix in names and files.dtype(names[suffix]) is not torch.int32:
                raise ValueError(f"{names[suffix]} has dtype {files.dtype(names[suffix])}; expected int32 words")
        if "weight" in names and files.dtype(names["weight"]) is not torch.int8:
            raise ValueError(f"{names['weight']} has dtype {files.dtype(names['weight'])}; expected int8")
        if not files.dtype(names[scale]).is_floating_point:
            raise ValueError(f"{names[scale]} has dtype {files.dtype(names[scale])}; expected a floating dtype")
        int4.check_group_size(k, groups)
        return groups

    def _check_g_idx(self, g_idx: torch.Tensor) -> None:
        group_size = self.in_features // self.group_count
        trivial = torch.arange(self.in_features, dtype=torch.int64) // group_size
        if not torch.equal(g_idx.to(torch.int64), trivial):
            raise ValueError(
                f"{self.prefix}: g_idx is not k // group_size: act-order (GPTQ desc_act / compressed-tensors actorder "
                "group) permutes K, which is not taken (the activations would have to be gathered to match)"
            )

    def _read(self, suffix: str) -> torch.Tensor | None:
        name = self.names.get(suffix)
        return None if name is None else self.files.read(name)

    def codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(codes uint8 [N, K], zeros uint8 [G, N], scales [G, N])`` from the checkpoint's tensors."""
        trim_heap()  # the previous layer's temporaries, freed, back to the OS before this layer's
        n, k, groups = self.out_features, self.in_features, self.group_count
        if self.layout == "awq":
            codes = _nibbles(self._read("qweight"), _AWQ_ORDER).t()
            zeros = _nibbles(self._read("qzeros"), _AWQ_ORDER)
            scales = self._read("scales")
        elif self.layout == "gptq":
            codes = _nibbles(self._read("qweight").t(), _SEQUENTIAL)
            zeros = _nibbles(self._read("qzeros"), _SEQUENTIAL)
            if self.scheme.gptq_v1:
                zeros += 1  # stored z - 1 (up to 16 where z - 1 wrapped to 15)
            scales = self._read("scales")
        else:
            if self.layout == "pack-quantized":
                codes = _nibbles(self._read("weight_packed"), _SEQUENTIAL)[:, :k]
            else:
                codes = self._read("weight").to(torch.int16).add_(8)  # pack_int4 checks [0, 15]
            zero_point = self._read("weight_zero_point")
            if zero_point is None:
                zeros = torch.full((groups, n), 8, dtype=torch.uint8)
            elif self.layout == "pack-quantized":
                zeros = _nibbles(zero_point.t(), _SEQUENTIAL)[:, :n]
            else:
                zeros = zero_point.t().to(torch.int16).add_(8)
            scales = self._read("weight_scale").t()
        return codes, zeros, scales

    def int4(self) -> int4.PackedInt4Weight:
        """The weight packed for kernforge (``pack_int4`` of :meth:`codes`: what
        ``convert_weight_packed_scale_zp`` computes for AWQ, GPTQ v1 and pack-quantized, with one
        nibble's int32 temporary at a time where it unpacks all eight at once)."""
        return int4.pack_int4(*self.codes())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, layout={self.layout}, groups={self.group_count}, tensors={self.prefix}.*"


def _nibbles(words: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int32 ``[R, C]`` -> uint8 ``[R, 8 C]``: element ``8c + j`` is nibble ``order[j]`` of word ``c``
    (through the words' little-endian bytes: byte ``b`` holds nibbles ``2b`` and ``2b + 1``; no int32
    temporaries)."""
    data = words.contiguous().view(torch.uint8).view(*words.shape, 4)
    nibbles = torch.stack((data & 0xF, data >> 4), dim=-1).view(*words.shape, 8)  # sequential order
    if order != _SEQUENTIAL:
        nibbles = nibbles[..., list(order)]
    return nibbles.flatten(-2)


def _quantized_layers(files: SafetensorsFiles, scheme: Int4Scheme) -> dict[str, str]:
    """prefix -> layout of every quantized linear the files hold."""
    layers = {}
    for name in files.names():
        prefix, _, suffix = name.rpartition(".")
        if scheme.method in ("awq", "gptq"):
            if suffix == "qweight":
                layers[prefix] = scheme.method
        elif suffix == "weight_packed":
            layers[prefix] = "pack-quantized"
        elif suffix == "weight" and files.dtype(name) is torch.int8 and f"{prefix}.weight_scale" in files:
            layers[prefix] = "int-quantized"
    return layers


def _load_four_bit(model: nn.Module, files: SafetensorsFiles, scheme: Int4Scheme) -> set[str]:
    """Put a Int4CheckpointLinear where each quantized linear is; returns the names of their tensors."""
    layers = _quantized_layers(files, scheme)
    if not layers:
        raise ValueError(f"the checkpoint says {scheme.method} but holds no four-bit linear's tensors")
    taken = set()
    for prefix, layout in layers.items():
        try:
            layer = model.get_submodule(prefix)
        except AttributeError:
            layer = None
        if type(layer) is not nn.Linear:
            raise ValueError(f"{prefix} holds {layout} tensors but the model has no nn.Linear there")
        parent, _, attr = prefix.rpartition(".")
        holder = Int4CheckpointLinear(files, prefix, layout, scheme, layer)
        setattr(model.get_submodule(parent) if parent else model, attr, holder)
        stray = [
            name
            for name in files.names()
            if name.startswith(prefix + ".") and name not in holder.names.values() and not _IGNORED.search(name)
        ]
        if stray:
            raise ValueError(f"tensors of the quantized linear {prefix} that are not taken: {', '.join(stray)}")
        taken.update(name for name in files.names() if name.startswith(prefix + "."))
    return taken


# --------------------------------------------------------------------------- plain tensors


def _load_plain(model: nn.Module, files: SafetensorsFiles, skip) -> bool:
    """Read every parameter and persistent buffer of ``model`` from ``files`` (cast to the model's
    dtype for it), ties kept; False (nothing read) if the names do not match."""
    targets = _targets(model)
    names = {name for name in files.names() if name not in skip and not _IGNORED.search(name)}
    aliases = {name: group for group in targets for name in group}
    if any(name not in aliases for name in names) or any(not names.intersection(group) for group in targets):
        return False
    for group, (kind, meta) in targets.items():
        source = next(name for name in group if name in names)
        tensor = files.read(source)
        if tuple(tensor.shape) != tuple(meta.shape):
            raise ValueError(f"{source} has shape {tuple(tensor.shape)}; the model's is {tuple(meta.shape)}")
        if tensor.is_floating_point() and tensor.dtype != meta.dtype:
            tensor = tensor.to(meta.dtype)
        value = nn.Parameter(tensor, requires_grad=False) if kind == "parameter" else tensor
        for name in group:  # tied names share one tensor
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner)
            (module._parameters if kind == "parameter" else module._buffers)[attr] = value
    return True


def _targets(model: nn.Module) -> dict[tuple[str, ...], tuple[str, torch.Tensor]]:
    """The model's parameters and persistent buffers, tied names grouped: (names) -> (kind, tensor)."""
    groups: dict[int, list] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), ["parameter", parameter, []])[2].append(name)
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, buffer in module._buffers.items():
            if buffer is not None and attr not in module._non_persistent_buffers_set:
                name = f"{module_name}.{attr}" if module_name else attr
                groups.setdefault(id(buffer), ["buffer", buffer, []])[2].append(name)
    return {tuple(dict.fromkeys(names)): (kind, tensor) for kind, tensor, names in groups.values()}


def _mismatch(model: nn.Module, files: SafetensorsFiles, skip) -> str:
    targets = _targets(model)
    names = {name for name in files.names() if name not in skip and not _IGNORED.search(name)}
    known = {name for group in targets for name in group}
    missing = [group[0] for group in targets if not names.intersection(group)]
    unexpected = sorted(names - known)
    parts = []
    if missing:
        parts.append(f"the checkpoint lacks {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
    if unexpected:
        parts.append(f"the model has no {', '.join(unexpected[:8])}" + (" ..." if len(unexpected) > 8 else ""))
    return "; ".join(parts)


def _materialize_buffers(model: nn.Module) -> None:
    """The buffers the checkpoint does not hold (RoPE's inv_freq), computed on the CPU as transformers
    computes them after a meta-device build (``_init_weights``)."""
    for module in model.modules():
        meta = [name for name, buffer in module._buffers.items() if buffer is not None and buffer.is_meta]
        if not meta:
            continue
        for name in meta:
            module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
        model._init_weights(module)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"not loaded from the checkpoint, nor computed: {', '.join(left[:8])}")


def _load_generation_config(model: nn.Module, path: Path) -> None:
    if (path / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path)
