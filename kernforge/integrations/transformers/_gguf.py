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
* Gemma 3 (``gemma3``): the converter stores every norm weight plus 1 (llama.cpp's norms scale by the
  stored weight, transformers' Gemma norms by ``1 + weight``): read minus 1, in fp32. Its q/k rows are
  as stored. The config gains what transformers' conversion leaves out (:func:`_gemma3_config`).
* Mixtures of experts (Qwen3-MoE, ``qwen3moe``; Mixtral, a ``llama`` file with ``llama.expert_count``):
  a layer's experts are stacked ``[experts, out, in]`` tensors (``ffn_gate_exps``, ``ffn_up_exps``,
  ``ffn_down_exps``); each expert's slice is read and packed apart (its gate|up and down are
  GGUFLinears of :class:`~kernforge.nn.gguf.GGUFExperts`, which ``SparseMoE`` runs per expert), the
  router (``ffn_gate_inp``, F32 as llama.cpp keeps it) is a plain weight. Plain (F16 / BF16 / F32)
  experts are stacked parameters, packed by SparseMoE as a checkpoint's.
* Before anything is built, every tensor is checked: its type (quantized ones kernforge reads, or
  plain), that it lies within the file (a truncated download) and that the model has a place for it;
  architectures other than :data:`ARCHITECTURES` are refused naming the ones taken.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from kernforge.memory import trim_heap
from kernforge.model_spec import ModelSpec
from kernforge.nn.gguf import GGUFEmbedding, GGUFExperts, GGUFLinear
from kernforge.ops._registry import DTYPE_NAMES
from kernforge.ops.gemm import gguf as gguf_ops

__all__ = ["ARCHITECTURES", "from_gguf", "gguf_manifest", "gguf_tokenizer"]

# GGUF general.architecture values taken (llama.cpp writes Mistral, SmolLM and Mixtral as "llama")
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3")
PLAIN_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_PERMUTED_ROPE_ARCHITECTURES = ("llama",)  # convert_hf_to_gguf permutes q/k rows for these
# convert_hf_to_gguf stores these norm weights plus 1 (Gemma's norms scale by 1 + weight; llama.cpp's by
# the stored weight): minus 1 here, into transformers' Gemma RMSNorms
_NORM_SHIFTED_ARCHITECTURES = ("gemma3",)


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

    def read(self, name: str, expert: int | None = None) -> torch.Tensor:
        """The tensor's bytes (uint8 ``[rows, row bytes]`` for a quantized type) or values (plain types);
        with ``expert``, only that slice ``[rows, cols]`` of a stacked ``[experts, rows, cols]`` tensor."""
        tensor, shape = self.tensors[name], self.shape(name)
        size, start = int(tensor.n_bytes), int(tensor.data_offset)
        if expert is not None:
            if len(shape) != 3 or not 0 <= expert < shape[0]:
                raise ValueError(f"{self.path.name}: tensor {name} of shape {shape} has no expert {expert}")
            size //= shape[0]  # the experts' blocks one after another
            start, shape = start + expert * size, shape[1:]
        data = bytearray(size)
        with open(self.path, "rb", buffering=0) as file:
            view, offset = memoryview(data), start
            while view:
                count = os.preadv(file.fileno(), [view], offset)
                if count <= 0:
                    raise ValueError(f"{self.path.name}: tensor {name} is truncated")
                view, offset = view[count:], offset + count
        raw = torch.frombuffer(data, dtype=torch.uint8)
        kind = self.type_name(name)
        if kind in PLAIN_TYPES:
            return raw.view(PLAIN_TYPES[kind]).view(shape)
        return raw.view(math.prod(shape[:-1]), -1)


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
    """The transformers config of a GGUF file (transformers' GGUF metadata conversion), with what that
    conversion leaves out of a mixture of experts: Qwen3-MoE's expert width, and Mixtral altogether
    (:func:`_mixtral_config`)."""
    from transformers import AutoConfig

    file = file if isinstance(file, GGUFFile) else GGUFFile(file)
    config = AutoConfig.from_pretrained(file.path.parent, gguf_file=file.path.name)
    if file.architecture == "llama" and file.field("llama.expert_count", 0):
        return _mixtral_config(config, file)
    if file.architecture == "qwen3moe":  # transformers maps no expert_feed_forward_length (its default is 768)
        config.moe_intermediate_size = int(_required_field(file, "qwen3moe.expert_feed_forward_length"))
    if file.architecture == "gemma3":
        _gemma3_config(config, file)
    return config


def _gemma3_config(config: Any, file: GGUFFile) -> None:
    """What transformers' conversion leaves out of a Gemma 3 file, read as llama.cpp reads it: the
    global layers' linear RoPE scaling (``gemma3.rope.scaling.*``: Gemma 3 4B and up) and the softmax
    scale, ``query_pre_attn_scalar`` (no field: head_dim, but hidden_size / heads for the 62-layer 27B,
    which llama.cpp knows by its layer count; transformers' default is 256). The sliding layers' RoPE
    base (10000) and the every-6th-layer-global pattern are llama.cpp's constants and transformers'
    defaults alike."""
    scaling = file.field("gemma3.rope.scaling.type")
    if scaling == "linear":
        factor = file.field("gemma3.rope.scaling.factor")
        if factor is None:
            raise ValueError(f"{file.path.name}: gemma3.rope.scaling.type linear without gemma3.rope.scaling.factor")
        config.rope_parameters["full_attention"].update(rope_type="linear", factor=float(factor))
    elif scaling not in (None, "none"):
        raise ValueError(f"{file.path.name}: gemma3.rope.scaling.type {scaling!r}; Gemma 3 files scale RoPE linearly")
    heads = config.num_attention_heads
    config.query_pre_attn_scalar = config.hidden_size // heads if config.num_hidden_layers == 62 else config.head_dim


# what a Mixtral config takes from the LlamaConfig transformers reads a Mixtral file as
_MIXTRAL_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
)


def _mixtral_config(llama: Any, file: GGUFFile) -> Any:
    """A Mixtral file's config. llama.cpp writes Mixtral as a ``llama`` with ``llama.expert_count``
    experts, which transformers' GGUF conversion reads as a dense LlamaConfig (experts dropped): its
    fields, the experts ``feed_forward_length`` wide (as llama.cpp builds a llama's experts), and the
    expert counts from the file's metadata."""
    from transformers import MixtralConfig

    return MixtralConfig(
        **{name: getattr(llama, name) for name in _MIXTRAL_FIELDS},
        num_local_experts=int(_required_field(file, "llama.expert_count")),
        num_experts_per_tok=int(_required_field(file, "llama.expert_used_count")),
    )


def _required_field(file: GGUFFile, name: str) -> Any:
    value = file.field(name)
    if value is None:
        raise ValueError(f"{file.path.name}: metadata field {name} is missing (a {file.architecture} MoE needs it)")
    return value


def gguf_manifest(path: str | Path, kv_cache_dtypes: tuple[str, ...] = (), dtype: str = "bfloat16") -> dict[str, Any]:
    """Pre-warm's manifest for the model of a GGUF file (``from_gguf``) computing in ``dtype``: the
    model's (its config as transformers' GGUF conversion reads it; ``kernforge.prewarm.manifest_from_spec``)
    with the GGUF GEMM for each tensor type the file stores in place of the bf16 GEMMs (kept where some
    linear weight is stored unquantized). ``python -m kernforge prewarm --gguf PATH`` builds it."""
    from kernforge.prewarm import manifest_from_spec

    file = GGUFFile(path)
    spec = ModelSpec.from_config({**gguf_config(file).to_dict(), "dtype": dtype})
    manifest = manifest_from_spec(spec, kv_cache_dtypes)
    experts = {file.type_name(name) in PLAIN_TYPES for name in file.tensors if len(file.shape(name)) == 3}
    kernels = [
        entry
        for entry in manifest["kernels"]
        if entry.get("module") != "gemm" and (entry.get("module") != "moe_experts" or True in experts)
    ]
    if False in experts:  # block-quantized experts: GGUFExperts' GEMMs (below) and its silu_and_mul
        kernels.append({"op": "silu_and_mul", "dtype": dtype})
    manifest["kernels"] = kernels + _plain_gemm_kernels(file, spec) + gemm_kernels(file, dtype)
    manifest["model"]["gguf_file"] = str(file.path)
    return manifest


def gemm_kernels(file: GGUFFile, dtype: str) -> list[dict[str, Any]]:
    """The GGUF GEMM variants a model of ``file`` runs (one per block type among its 2-D weights and
    stacked experts), as pre-warm manifest entries."""
    kinds = sorted({file.type_name(name) for name in file.tensors if len(file.shape(name)) in (2, 3)})
    return [
        {"module": gguf_ops.GEMM_GGUF.name, "params": {"dtype": DTYPE_NAMES[_TORCH_DTYPES[dtype]], "qtype": kind}}
        for kind in kinds
        if kind in gguf_ops.BLOCK_TYPES
    ]


# the GGUF tensors (blk.N.<name>.weight) behind the linears ModelSpec.linear_shapes names
_SPEC_LINEARS = {
    "qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "o_proj": ("attn_output",),
    "gate_up_proj": ("ffn_gate", "ffn_up"),
    "down_proj": ("ffn_down",),
    "router": ("ffn_gate_inp",),
}


def plain_linears(file: GGUFFile, spec: ModelSpec) -> list[str]:
    """The linears of ``spec.linear_shapes()`` that the file stores unquantized in some layer (they run
    the bf16 GEMM: a MoE's F32 router, an F16 file's every linear); one the table does not know counts
    as plain (pre-warm then builds too much, never too little)."""
    plain = {
        name.split(".")[2]
        for name in file.tensors
        if name.startswith("blk.") and len(file.shape(name)) == 2 and file.type_name(name) in PLAIN_TYPES
    }
    head = "output.weight" if "output.weight" in file.tensors else "token_embd.weight"  # a tied head's

    def stored_plain(linear: str) -> bool:
        if linear == "lm_head":
            return file.type_name(head) in PLAIN_TYPES
        parts = _SPEC_LINEARS.get(linear)
        return parts is None or not plain.isdisjoint(parts)

    return [linear for linear in spec.linear_shapes() if stored_plain(linear)]


def _plain_gemm_kernels(file: GGUFFile, spec: ModelSpec) -> list[dict[str, Any]]:
    """The bf16 GEMM variants of the linears the file stores unquantized (those linears' shapes only)."""
    from kernforge.ops.gemm import bf16

    shapes = {name: shape for name, shape in spec.linear_shapes().items() if name in plain_linears(file, spec)}
    return bf16.linear_kernels(shapes, spec.dtype, spec.router_dtype) if shapes else []


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
        owner_name, _, attr = hf_name.rpartition(".")
        if hf_name == "model.embed_tokens.weight" or attr in _EXPERT_PARTS:
            continue
        owner = model.get_submodule(owner_name)
        if type(owner) is nn.Linear and attr == "weight":
            bias_name = places.get(f"{owner_name}.bias")  # Qwen2's q/k/v
            linear = _linear(owner, hf_name, file, name, config, dtype, embedding, bias_name)
            parent, _, child = owner_name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, linear)
        elif attr == "weight" or not isinstance(owner, GGUFLinear):
            shape, offset = tuple(getattr(owner, attr).shape), _norm_offset(file, hf_name)
            _set_parameter(owner, attr, _plain(file, name, hf_name, shape, dtype, offset))
    for owner_name in dict.fromkeys(hf.rpartition(".")[0] for hf in places if hf.rpartition(".")[2] in _EXPERT_PARTS):
        _place_experts(model, owner_name, file, places, dtype)
    if hasattr(model.config, "tie_word_embeddings"):
        model.config.tie_word_embeddings = False  # two modules over one packed weight: nothing to tie


# a MoE layer's stacked expert weights (transformers' experts.gate_up_proj [E, 2I, H] and down_proj
# [E, H, I]) by the GGUF tensors they are (named as gguf's map names experts.gate_proj ...)
_STACKED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")


def _places(model: nn.Module, names: Any) -> dict[str, str]:
    """HF parameter name -> GGUF tensor name, for every parameter of ``model``; a MoE layer's stacked
    experts as ``experts.gate_proj``, ``experts.up_proj`` and ``experts.down_proj`` (a tensor each)."""
    places = {}
    for hf_name, parameter in model.named_parameters(remove_duplicate=False):
        module_name, _, suffix = hf_name.rpartition(".")
        if suffix in _STACKED_EXPERTS and parameter.dim() == 3:
            for part in _STACKED_EXPERTS[suffix]:
                name = names.get_name(f"{module_name}.{part}")
                if name is None:
                    raise ValueError(f"no GGUF tensor name for the model's {module_name}.{part} ({hf_name})")
                places[f"{module_name}.{part}"] = f"{name}.weight"
            continue
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
        # loaded: transformers' init, which _materialize_buffers runs on a module with computed buffers
        # (Gemma's scaled embedding has its scale), skips it
        weight._is_hf_initialized = True  # type: ignore[attr-defined]
        _set_parameter(embed, "weight", weight)
        return weight
    vocab, hidden = embed.weight.shape
    packed = _packed(file, name, (vocab, hidden))
    model.model.embed_tokens = GGUFEmbedding(packed, dtype, _embedding_scale(embed, dtype))
    return packed


def _embedding_scale(embed: nn.Module, dtype: torch.dtype) -> float:
    """The factor a scaled embedding multiplies its rows by (Gemma's sqrt(hidden_size), rounded to the
    model's dtype as transformers' module rounds it; its buffer is on the meta device here); else 1."""
    scale = getattr(embed, "scalar_embed_scale", None)
    return 1.0 if scale is None else float(torch.tensor(float(scale)).to(dtype))


def _norm_offset(file: GGUFFile, hf_name: str) -> float:
    """What to add to the file's values of ``hf_name``: -1 for a norm weight stored plus 1."""
    return -1.0 if file.architecture in _NORM_SHIFTED_ARCHITECTURES and hf_name.endswith("norm.weight") else 0.0


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
    rope_heads = _rope_heads(hf_name, file, config)
    if file.type_name(name) in PLAIN_TYPES:
        weight = _plain(file, name, hf_name, shape, dtype)
        if rope_heads is not None:  # an F16 / F32 Llama's q/k rows are permuted as a quantized one's
            weight.data = _unpermuted_rope_rows(weight.data, rope_heads)
        _set_parameter(owner, "weight", weight)
        return owner
    hf_bias = hf_name.removesuffix("weight") + "bias"
    bias = None if bias_name is None else _plain(file, bias_name, hf_bias, (owner.out_features,), torch.float32)
    return GGUFLinear([_packed(file, name, shape, rope_heads)], bias, dtype)


def _rope_heads(hf_name: str, file: GGUFFile, config: Any) -> int | None:
    """Heads whose q/k rows llama.cpp permuted (None: rows as stored)."""
    if file.architecture not in _PERMUTED_ROPE_ARCHITECTURES:
        return None
    if hf_name.endswith("self_attn.q_proj.weight"):
        return config.num_attention_heads
    if hf_name.endswith("self_attn.k_proj.weight"):
        return config.num_key_value_heads
    return None


def _unpermuted_rope_rows(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's (head, pair, half) row order back to (head, half, pair): whole rows (of values or of
    blocks) move, none changes."""
    n = rows.shape[0]
    return rows.view(heads, n // heads // 2, 2, -1).transpose(1, 2).reshape(n, -1)


def _packed(
    file: GGUFFile, name: str, shape: tuple[int, int], rope_heads: int | None = None, expert: int | None = None
) -> gguf_ops.PackedGGUFWeight:
    """Tensor ``name`` (``expert``'s slice of a stacked one) packed, checked to be ``shape``."""
    n, k = shape
    stored = file.shape(name) if expert is None else file.shape(name)[1:]
    if stored != (n, k):
        raise ValueError(f"{file.path.name}: tensor {name} has shape {file.shape(name)}; the model's is {(n, k)}")
    data = file.read(name, expert)
    if rope_heads is not None:
        data = _unpermuted_rope_rows(data, rope_heads)
    packed = gguf_ops.pack_gguf(data, file.type_name(name), n, k)
    del data
    if expert is None:  # (a layer's experts trim once, after the last)
        trim_heap()  # the tensor's bytes and temporaries, freed, back to the OS before the next is read
    return packed


def _place_experts(
    model: nn.Module, owner_name: str, file: GGUFFile, places: dict[str, str], dtype: torch.dtype
) -> None:
    """A MoE layer's experts (``owner_name``, transformers' stacked experts module) from the file's
    ``ffn_{gate,up,down}_exps``: block-quantized, a :class:`GGUFExperts` of each expert's packed slices
    (no expert dequantized); plain, the stacked parameters as a checkpoint holds them."""
    experts = model.get_submodule(owner_name)
    count, gate_up_width, hidden = experts.get_parameter("gate_up_proj").shape  # [E, 2I, H]
    width = gate_up_width // 2
    gate, up, down = (places[f"{owner_name}.{part}"] for part in _EXPERT_PARTS)
    plain = [name for name in (gate, up, down) if file.type_name(name) in PLAIN_TYPES]
    if len(plain) == 3:
        stacked = (
            _plain(file, name, f"{owner_name}.gate_up_proj", (count, width, hidden), dtype) for name in (gate, up)
        )
        _set_parameter(experts, "gate_up_proj", nn.Parameter(torch.cat(list(stacked), dim=1), requires_grad=False))
        _set_parameter(
            experts, "down_proj", _plain(file, down, f"{owner_name}.down_proj", (count, hidden, width), dtype)
        )
        return
    if plain:
        raise ValueError(
            f"{file.path.name}: {', '.join(plain)} unquantized beside block-quantized experts of the same layer; "
            "kernforge runs a layer's experts all block-quantized or all plain"
        )

    def linear(name: str, shape: tuple[int, int], expert: int) -> GGUFLinear:
        return GGUFLinear([_packed(file, name, shape, expert=expert)], None, dtype)

    gate_up = [
        GGUFLinear.concatenated([linear(gate, (width, hidden), e), linear(up, (width, hidden), e)])
        for e in range(count)
    ]
    downs = [linear(down, (hidden, width), e) for e in range(count)]
    parent, _, child = owner_name.rpartition(".")
    setattr(model.get_submodule(parent), child, GGUFExperts(gate_up, downs))
    trim_heap()


def _plain(
    file: GGUFFile, name: str, hf_name: str, shape: tuple[int, ...], dtype: torch.dtype, offset: float = 0.0
) -> nn.Parameter:
    """A plain tensor's values in ``dtype``, plus ``offset`` (added in fp32, before the rounding)."""
    if file.type_name(name) not in PLAIN_TYPES:
        raise ValueError(
            f"{file.path.name}: tensor {name} ({hf_name}) is {file.type_name(name)}; expected a plain type"
        )
    values = file.read(name)
    if tuple(values.shape) != tuple(shape):
        raise ValueError(f"{file.path.name}: tensor {name} has shape {tuple(values.shape)}; the model's is {shape}")
    if offset:
        values = values.float() + offset
    return nn.Parameter(values.to(dtype), requires_grad=False)


def _set_parameter(module: nn.Module, attr: str, value: nn.Parameter) -> None:
    module._parameters[attr] = value
