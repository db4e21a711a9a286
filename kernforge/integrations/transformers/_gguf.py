"""``from_gguf(path)``: a llama.cpp GGUF file (what llama.cpp, Ollama and LM Studio run) loaded as a
kernforge-optimized transformers model whose linears multiply the file's quantized blocks as they are
(``kernforge.ops.gemm.gguf``: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K; each tensor at its own type).

* Parsing, metadata and tensor types are llama.cpp's own Python reader (the ``gguf`` package); the
  config and the tokenizer are transformers' GGUF conversion (``AutoConfig`` / ``AutoTokenizer`` with
  ``gguf_file=``); tensor names map through ``gguf``'s tables (``get_tensor_name_map``).
* The model is built on the meta device, then every tensor is read from the file once (``pread``
  into memory of its own, not through the reader's mapping, whose touched pages would stay resident
  beside the packed copies) and either packed (quantized linears and the embedding) or kept as a
  parameter (F32 / F16 / BF16 tensors: norms, biases, unquantized weights). No dequantized copy of a
  quantized tensor ever exists: the embedding's rows are decoded on lookup, from the packed weight a
  tied lm_head multiplies by.
* llama.cpp stores a Llama's (and Mistral's) q/k rows permuted for its RoPE; they are permuted back
  (whole rows of blocks: no value changes).
* Before anything is built, every tensor is checked: its type (quantized ones kernforge reads, or
  plain), that it lies within the file (a truncated download) and that the model has a place for it;
  architectures other than :data:`ARCHITECTURES` are refused naming the ones taken.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from kernforge.memory import trim_heap
from kernforge.model_spec import ModelSpec
from kernforge.nn.gguf import GGUFEmbedding, GGUFLinear
from kernforge.ops._registry import DTYPE_NAMES
from kernforge.ops.gemm import gguf as gguf_ops

__all__ = ["ARCHITECTURES", "from_gguf", "gguf_manifest", "gguf_tokenizer"]

# GGUF general.architecture values taken (llama.cpp writes Mistral and SmolLM as "llama")
ARCHITECTURES = ("llama", "qwen2", "qwen3")
PLAIN_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_PERMUTED_ROPE_ARCHITECTURES = ("llama",)  # convert_hf_to_gguf permutes q/k rows for these


def _require_gguf() -> ModuleType:
    try:
        import gguf
    except ImportError:  # pragma: no cover - the extra is part of the tested environment
        raise ImportError("reading GGUF files needs the gguf package: pip install 'kernforge[gguf]'") from None
    return gguf


class GGUFFile:
    """A GGUF file's metadata and tensors (``gguf.GGUFReader``), each tensor's bytes read on demand."""

    def __init__(self, path: str | Path):
        gguf = _require_gguf()
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such GGUF file")
        try:
            self.reader = gguf.GGUFReader(self.path)
        except Exception as error:  # the reader raises ValueError, IndexError, ... on a damaged file
            raise ValueError(
                f"{self.path}: not a readable GGUF file, truncated or damaged ({type(error).__name__}: {error})"
            ) from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.architecture = self.field("general.architecture")
        self._check_tensors()

    def field(self, name: str, default: Any = None) -> Any:
        field = self.reader.fields.get(name)
        return default if field is None else field.contents()

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def _check_tensors(self) -> None:
        size = self.path.stat().st_size
        for name, tensor in self.tensors.items():
            kind = tensor.tensor_type.name
            if kind not in PLAIN_TYPES and kind not in gguf_ops.TYPES:
                raise ValueError(
                    f"{self.path.name}: tensor {name} has type {kind}; kernforge reads "
                    f"{', '.join(gguf_ops.TYPES)} and {', '.join(PLAIN_TYPES)}"
                )
            if tensor.data_offset + tensor.n_bytes > size:
                raise ValueError(
                    f"{self.path.name}: tensor {name} ends at byte {tensor.data_offset + tensor.n_bytes} of a "
                    f"{size}-byte file: the file is truncated"
                )

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape as torch sees it (GGUF lists dimensions fastest first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def read(self, name: str) -> torch.Tensor:
        """The tensor's bytes (uint8 ``[rows, row bytes]`` for a quantized type) or values (plain types)."""
        tensor = self.tensors[name]
        data = bytearray(int(tensor.n_bytes))
        with open(self.path, "rb", buffering=0) as file:
            view, offset = memoryview(data), int(tensor.data_offset)
            while view:
                count = os.preadv(file.fileno(), [view], offset)
                if count <= 0:
                    raise ValueError(f"{self.path.name}: tensor {name} is truncated")
                view, offset = view[count:], offset + count
        raw = torch.frombuffer(data, dtype=torch.uint8)
        shape = self.shape(name)
        kind = self.type_name(name)
        if kind in PLAIN_TYPES:
            return raw.view(PLAIN_TYPES[kind]).view(shape)
        return raw.view(shape[0] if len(shape) > 1 else 1, -1)


def from_gguf(path: str | Path, *, dtype: torch.dtype = torch.bfloat16, **optimize_kwargs: Any) -> nn.Module:
    """Load the GGUF file ``path`` as a kernforge-optimized transformers causal LM computing in
    ``dtype``; ``optimize_kwargs`` go to :func:`~kernforge.integrations.transformers.optimize`
    (``kv_cache_pages``, ``page_size``). The quantized tensors run at their own types; ``quant`` is not
    taken (the file chose)."""
    from transformers import AutoModelForCausalLM

    from kernforge.integrations.transformers import UnsupportedModelError, optimize
    from kernforge.integrations.transformers._checkpoints import _materialize_buffers

    for refused in ("quant", "quant_lm_head", "tp_group"):
        if optimize_kwargs.get(refused) is not None:
            raise ValueError(f"{refused} is not taken by from_gguf: a GGUF file's tensors run at the types it stores")
    file = GGUFFile(path)
    if file.architecture not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{file.path.name}: GGUF architecture {file.architecture!r} is not taken; kernforge reads "
            f"{', '.join(ARCHITECTURES)} (Llama, Mistral and SmolLM files are 'llama')"
        )
    config = gguf_config(file)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _place_tensors(model, file, config, dtype)
    _materialize_buffers(model)
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.gguf_file = str(file.path)  # what optimize (and pre-warm) read the GEMMs' types from
    model = optimize(model.eval(), **optimize_kwargs)
    trim_heap()  # what building and fusing freed: resident memory is the packed model's
    return model


def gguf_config(file: GGUFFile | str | Path) -> Any:
    """The transformers config of a GGUF file (transformers' GGUF metadata conversion)."""
    from transformers import AutoConfig

    path = file.path if isinstance(file, GGUFFile) else Path(file)
    return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)


def gguf_manifest(path: str | Path, kv_cache_dtypes: tuple[str, ...] = (), dtype: str = "bfloat16") -> dict[str, Any]:
    """Pre-warm's manifest for the model of a GGUF file (``from_gguf``) computing in ``dtype``: the
    model's (its config as transformers' GGUF conversion reads it; ``kernforge.prewarm.manifest_from_spec``)
    with the GGUF GEMM for each tensor type the file stores in place of the bf16 GEMMs (kept where some
    linear weight is stored unquantized). ``python -m kernforge prewarm --gguf PATH`` builds it."""
    from kernforge.prewarm import manifest_from_spec

    file = GGUFFile(path)
    spec = ModelSpec.from_config({**gguf_config(file).to_dict(), "dtype": dtype})
    manifest = manifest_from_spec(spec, kv_cache_dtypes)
    if quantized_linears_only(file):
        manifest["kernels"] = [entry for entry in manifest["kernels"] if entry.get("module") != "gemm"]
    manifest["kernels"] += gemm_kernels(file, dtype)
    manifest["model"]["gguf_file"] = str(file.path)
    return manifest


def gemm_kernels(file: GGUFFile, dtype: str) -> list[dict[str, Any]]:
    """The GGUF GEMM variants a model of ``file`` runs (one per block type among its 2-D weights), as
    pre-warm manifest entries."""
    kinds = sorted({file.type_name(name) for name in file.tensors if len(file.shape(name)) == 2})
    return [
        {"module": gguf_ops.GEMM_GGUF.name, "params": {"dtype": DTYPE_NAMES[_TORCH_DTYPES[dtype]], "qtype": kind}}
        for kind in kinds
        if kind in gguf_ops.BLOCK_TYPES
    ]


def quantized_linears_only(file: GGUFFile) -> bool:
    """Whether every 2-D weight of the file is block-quantized (then no bf16 GEMM runs)."""
    return all(file.type_name(name) not in PLAIN_TYPES for name in file.tensors if len(file.shape(name)) == 2)


def gguf_tokenizer(path: str | Path) -> Any:
    """The file's tokenizer, through transformers' GGUF conversion (``AutoTokenizer``, ``gguf_file=``)."""
    from transformers import AutoTokenizer

    path = Path(path)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _place_tensors(model: nn.Module, file: GGUFFile, config: Any, dtype: torch.dtype) -> None:
    """Every tensor of ``file`` into ``model`` (built on the meta device); checks all the names first."""
    gguf = _require_gguf()
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == file.architecture)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    places = _places(model, names)
    unplaced = sorted(set(file.tensors) - set(places.values()))
    missing = [hf for hf, name in places.items() if name not in file.tensors and hf != "lm_head.weight"]
    if unplaced or missing:
        raise ValueError(
            f"{file.path.name} does not match the {file.architecture} model its metadata describes: "
            + "; ".join(
                part
                for part in (
                    f"tensors with no place in it: {', '.join(unplaced[:8])}" if unplaced else "",
                    f"tensors it lacks: {', '.join(missing[:8])}" if missing else "",
                )
                if part
            )
        )
    embedding = _embedding(model, file, places["model.embed_tokens.weight"], dtype)
    for hf_name, name in places.items():
        if hf_name == "model.embed_tokens.weight":
            continue
        owner_name, _, attr = hf_name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if type(owner) is nn.Linear and attr == "weight":
            bias_name = places.get(f"{owner_name}.bias")  # Qwen2's q/k/v
            linear = _linear(owner, hf_name, file, name, config, dtype, embedding, bias_name)
            parent, _, child = owner_name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, linear)
        elif attr == "weight" or not isinstance(owner, GGUFLinear):
            _set_parameter(owner, attr, _plain(file, name, hf_name, tuple(getattr(owner, attr).shape), dtype))
    if hasattr(model.config, "tie_word_embeddings"):
        model.config.tie_word_embeddings = False  # two modules over one packed weight: nothing to tie


def _places(model: nn.Module, names: Any) -> dict[str, str]:
    """HF parameter name -> GGUF tensor name, for every parameter of ``model``."""
    places = {}
    for hf_name, _ in model.named_parameters(remove_duplicate=False):
        module_name, _, suffix = hf_name.rpartition(".")
        name = names.get_name(module_name)
        if name is None:
            raise ValueError(f"no GGUF tensor name for the model's {hf_name}")
        places[hf_name] = f"{name}.{suffix}"
    return places


def _embedding(model: Any, file: GGUFFile, name: str, dtype: torch.dtype) -> gguf_ops.PackedGGUFWeight | nn.Parameter:
    """The embedding as a GGUFEmbedding over its packed weight, or a plain parameter; returns what a tied
    lm_head multiplies by (the packed weight, or the parameter)."""
    embed = model.get_submodule("model.embed_tokens")
    if file.type_name(name) in PLAIN_TYPES:
        weight = _plain(file, name, "model.embed_tokens.weight", tuple(embed.weight.shape), dtype)
        _set_parameter(embed, "weight", weight)
        return weight
    vocab, hidden = embed.weight.shape
    packed = _packed(file, name, (vocab, hidden))
    model.model.embed_tokens = GGUFEmbedding(packed, dtype, getattr(embed, "embed_scale", 1.0))
    return packed


def _linear(
    owner: nn.Linear,
    hf_name: str,
    file: GGUFFile,
    name: str,
    config: Any,
    dtype: torch.dtype,
    embedding: gguf_ops.PackedGGUFWeight | nn.Parameter,
    bias_name: str | None,
) -> nn.Module:
    """What replaces the nn.Linear ``owner``: a GGUFLinear over its packed tensor (the embedding's for a
    tied lm_head) and the file's ``bias_name``, or ``owner`` with a plain weight."""
    shape = (owner.out_features, owner.in_features)
    if name not in file.tensors:  # lm_head tied to the embedding
        if isinstance(embedding, nn.Parameter):
            _set_parameter(owner, "weight", embedding)
            return owner
        return GGUFLinear([embedding], None, dtype)
    if file.type_name(name) in PLAIN_TYPES:
        _set_parameter(owner, "weight", _plain(file, name, hf_name, shape, dtype))
        return owner
    hf_bias = hf_name.removesuffix("weight") + "bias"
    bias = None if bias_name is None else _plain(file, bias_name, hf_bias, (owner.out_features,), torch.float32)
    return GGUFLinear([_packed(file, name, shape, _rope_heads(hf_name, file, config))], bias, dtype)


def _rope_heads(hf_name: str, file: GGUFFile, config: Any) -> int | None:
    """Heads whose q/k rows llama.cpp permuted (None: rows as stored)."""
    if file.architecture not in _PERMUTED_ROPE_ARCHITECTURES:
        return None
    if hf_name.endswith("self_attn.q_proj.weight"):
        return config.num_attention_heads
    if hf_name.endswith("self_attn.k_proj.weight"):
        return config.num_key_value_heads
    return None


def _packed(
    file: GGUFFile, name: str, shape: tuple[int, int], rope_heads: int | None = None
) -> gguf_ops.PackedGGUFWeight:
    n, k = shape
    if file.shape(name) != (n, k):
        raise ValueError(f"{file.path.name}: tensor {name} has shape {file.shape(name)}; the model's is {(n, k)}")
    data = file.read(name)
    if rope_heads is not None:  # llama.cpp's (head, pair, half) row order back to (head, half, pair)
        data = data.view(rope_heads, n // rope_heads // 2, 2, -1).transpose(1, 2).reshape(n, -1)
    packed = gguf_ops.pack_gguf(data, file.type_name(name), n, k)
    del data
    trim_heap()  # the tensor's bytes and temporaries, freed, back to the OS before the next is read
    return packed


def _plain(file: GGUFFile, name: str, hf_name: str, shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    if file.type_name(name) not in PLAIN_TYPES:
        raise ValueError(
            f"{file.path.name}: tensor {name} ({hf_name}) is {file.type_name(name)}; expected a plain type"
        )
    values = file.read(name)
    if tuple(values.shape) != tuple(shape):
        raise ValueError(f"{file.path.name}: tensor {name} has shape {tuple(values.shape)}; the model's is {shape}")
    return nn.Parameter(values.to(dtype), requires_grad=False)


def _set_parameter(module: nn.Module, attr: str, value: nn.Parameter) -> None:
    module._parameters[attr] = value
