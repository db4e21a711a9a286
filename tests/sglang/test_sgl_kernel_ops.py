"""kernforge's ``sgl_kernel`` (integrations/sgl_kernel_shim, kernforge.integrations.sglang): each registered
``torch.ops.sgl_kernel`` op against a float64/fp32 torch reference, called as SGLang 0.5.23 calls it (odd
sizes, batch 1); bad input raising ValueError/TypeError; SGLang's AMX gate reading True with the shim."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernforge.integrations.sglang import ops

REPO = Path(__file__).resolve().parents[2]
sgl = torch.ops.sgl_kernel
BF16 = dict(atol=3e-2, rtol=2e-2)  # a bf16 output's rounding, against a float64 reference


def _bf16(*shape, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(torch.bfloat16)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_registered():
    if ops.SKIPPED:
        pytest.skip(f"nothing registered: {ops.SKIPPED}")
    for name in ("convert_weight_packed", "weight_packed_linear", "rmsnorm_cpu", "fused_add_rmsnorm_cpu"):
        assert name in ops.REGISTERED and hasattr(sgl, name)


# --------------------------------------------------------------------------- packed linear


@pytest.mark.parametrize("n, k, m", [(48, 64, 1), (32, 96, 5), (80, 32, 3), (7, 32, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_weight_packed_linear(n, k, m, with_bias):
    weight = _bf16(n, k, scale=0.1)
    x = _bf16(m, k)
    bias = torch.randn(n, dtype=torch.float32) if with_bias else None  # SGLang keeps it fp32
    # as SGLang's _amx_process_weight_after_loading: an nn.Parameter over the packed tensor
    packed = torch.nn.Parameter(sgl.convert_weight_packed(weight), requires_grad=False)
    assert packed.shape == (n, k) and packed.dtype == torch.bfloat16
    out = sgl.weight_packed_linear(x, packed, bias, True)
    ref = x.double() @ weight.double().T + (0 if bias is None else bias.to(torch.bfloat16).double())
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, **BF16)
    # is_vnni=False packs the plain weight for the call
    torch.testing.assert_close(sgl.weight_packed_linear(x, weight, bias, False), out)


def test_packed_weight_shares_the_packed_buffer():
    weight = _bf16(48, 64)
    packed = sgl.convert_weight_packed(weight)
    parameter = torch.nn.Parameter(packed, requires_grad=False)
    assert parameter.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()
    # the storage is kernforge's padded layout (48 rows -> 2 panels of 32), not a copy of the weight
    assert packed.untyped_storage().nbytes() == 64 * 64 * 2


def test_weight_packed_linear_bad_input():
    weight = _bf16(48, 64)
    packed = sgl.convert_weight_packed(weight)
    with pytest.raises(ValueError, match="K|shape"):
        sgl.weight_packed_linear(_bf16(2, 63), packed, None, True)
    with pytest.raises(ValueError, match="smaller than a packed"):
        sgl.weight_packed_linear(_bf16(2, 64), packed.clone(), None, True)  # a copy lost the padding
    with pytest.raises(TypeError):
        sgl.weight_packed_linear(_bf16(2, 64), packed.float(), None, True)
    with pytest.raises((TypeError, NotImplementedError)):
        sgl.convert_weight_packed(weight.half())


# --------------------------------------------------------------------------- norms, activations, RoPE


def _rms(x, w, eps, gemma=False):
    x = x.double()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * ((1 + w.double()) if gemma else w.double())


@pytest.mark.parametrize(
    "op, gemma", [("rmsnorm_cpu", False), ("gemma_rmsnorm_cpu", True), ("gemma3_rmsnorm_cpu", True)]
)
@pytest.mark.parametrize("tokens, hidden", [(1, 4096 + 64), (3, 72)])
def test_rmsnorm(op, gemma, tokens, hidden):
    x, w = _bf16(tokens, hidden), _bf16(hidden, scale=0.5)
    out = getattr(sgl, op)(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), _rms(x, w, 1e-6, gemma), **BF16)


def test_gemma3_rmsnorm_rounds_once():
    # SGLang's Gemma3RMSNorm.forward_native: x.float() normalized, * (1 + w.float()), one rounding
    x, w = _bf16(5, 40), _bf16(40, scale=0.5)
    xf = x.float()
    native = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.float())).to(x.dtype)
    out = sgl.gemma3_rmsnorm_cpu(x, w, 1e-6)
    # at most one bf16 step apart (fp32 summation order), and equal almost everywhere
    assert ((out.float() - native.float()).abs() <= native.float().abs() * 2**-7 + 1e-6).all()


@pytest.mark.parametrize("op, gemma", [("fused_add_rmsnorm_cpu", False), ("gemma_fused_add_rmsnorm_cpu", True)])
def test_fused_add_rmsnorm_in_place(op, gemma):
    x, residual, w = _bf16(1, 136), _bf16(1, 136), _bf16(136, scale=0.5)
    total = x.double() + residual.double()
    x_in, residual_in = x.clone(), residual.clone()
    assert getattr(sgl, op)(x_in, residual_in, w, 1e-5) is None
    torch.testing.assert_close(residual_in.double(), total, **BF16)
    torch.testing.assert_close(x_in.double(), _rms(total, w, 1e-5, gemma), **BF16)


@pytest.mark.parametrize(
    "op, fn",
    [
        ("silu_and_mul_cpu", torch.nn.functional.silu),
        ("gelu_and_mul_cpu", torch.nn.functional.gelu),
        ("gelu_tanh_and_mul_cpu", lambda t: torch.nn.functional.gelu(t, approximate="tanh")),
    ],
)
@pytest.mark.parametrize("tokens, width", [(1, 2 * 11008), (3, 2 * 37)])
def test_gated_activations(op, fn, tokens, width):
    x = _bf16(tokens, width)
    d = width // 2
    out = getattr(sgl, op)(x)
    assert out.shape == (tokens, d)
    torch.testing.assert_close(out.double(), fn(x[:, :d].double()) * x[:, d:].double(), **BF16)


def _rope_ref(positions, t, head_size, cache, is_neox):
    t = t.double().view(t.shape[0], -1, head_size).clone()
    rotary = cache.shape[1]
    cos, sin = cache[positions].double().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    r = t[..., :rotary]
    if is_neox:
        x1, x2 = r[..., : rotary // 2], r[..., rotary // 2 :]
        r = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = r[..., 0::2], r[..., 1::2]
        r = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    t[..., :rotary] = r
    return t.flatten(1)


def _cos_sin_cache(rows, rotary, dtype):
    freq = 1.0 / (10000 ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary))
    angles = torch.arange(rows, dtype=torch.float64)[:, None] * freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("tokens, q_heads, kv_heads, head_size, rotary", [(1, 3, 1, 64, 64), (5, 4, 2, 80, 32)])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
def test_rotary_embedding(is_neox, tokens, q_heads, kv_heads, head_size, rotary, cache_dtype):
    # SGLang matches the cache's dtype to the query's (bf16) before the call
    cache = _cos_sin_cache(257, rotary, cache_dtype)
    positions = torch.randint(0, 257, (tokens,))
    q, k = _bf16(tokens, q_heads * head_size), _bf16(tokens, kv_heads * head_size)
    q_out, k_out = sgl.rotary_embedding_cpu(positions, q, k, head_size, cache, is_neox)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    torch.testing.assert_close(q_out.double(), _rope_ref(positions, q, head_size, cache, is_neox), **BF16)
    torch.testing.assert_close(k_out.double(), _rope_ref(positions, k, head_size, cache, is_neox), **BF16)


def test_rotary_embedding_bad_input():
    cache = _cos_sin_cache(16, 64, torch.bfloat16)
    with pytest.raises(ValueError):
        sgl.rotary_embedding_cpu(torch.tensor([3]), _bf16(1, 100), _bf16(1, 64), 64, cache, True)


def test_norm_bad_input():
    with pytest.raises(ValueError):
        sgl.rmsnorm_cpu(_bf16(2, 64), _bf16(63), 1e-6)
    with pytest.raises(TypeError):
        sgl.silu_and_mul_cpu(torch.ones(2, 8, dtype=torch.int32))


# --------------------------------------------------------------------------- MoE routing


def _topk_ref(scores, topk, renormalize):
    weights, ids = scores.topk(topk, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


@pytest.mark.parametrize("op, score", [("topk_softmax_cpu", "softmax"), ("topk_sigmoid_cpu", "sigmoid")])
@pytest.mark.parametrize("tokens, experts, topk, renormalize", [(1, 60, 4, True), (3, 7, 2, False)])
def test_topk(op, score, tokens, experts, topk, renormalize):
    hidden = _bf16(tokens, 32)
    gating = torch.randn(tokens, experts, dtype=torch.float32)
    weights, ids = getattr(sgl, op)(
        hidden_states=hidden, gating_output=gating, topk=topk, renormalize=renormalize, correction_bias=None
    )
    scores = gating.double().softmax(-1) if score == "softmax" else gating.double().sigmoid()
    ref_w, ref_ids = _topk_ref(scores, topk, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long().sort(-1).values, ref_ids.sort(-1).values)
    torch.testing.assert_close(weights.double().sort(-1).values, ref_w.sort(-1).values, atol=1e-5, rtol=1e-5)


def test_topk_correction_bias_is_named():
    with pytest.raises(NotImplementedError, match="correction_bias"):
        sgl.topk_sigmoid_cpu(_bf16(1, 8), torch.randn(1, 8), 2, True, torch.zeros(8))


def _grouped_ref(scores, choose, topk, groups, topk_group, renormalize, scale):
    tokens, experts = scores.shape
    per_group = choose.view(tokens, groups, experts // groups)
    if torch.equal(choose, scores):
        group_scores = per_group.max(-1).values
    else:
        group_scores = per_group.topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1).indices, 1)
    mask = keep[:, :, None].expand_as(per_group).reshape(tokens, experts).bool()
    ids = choose.masked_fill(~mask, float("-inf")).topk(topk, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * (scale or 1.0), ids


@pytest.mark.parametrize("biased", [False, True])
def test_grouped_topk(biased):
    tokens, experts, groups, topk_group, topk = 3, 64, 8, 3, 6
    hidden = _bf16(tokens, 32)
    gating = torch.randn(tokens, experts, dtype=torch.float32)
    if biased:
        bias = torch.randn(experts, dtype=torch.float32) * 0.1
        weights, ids = sgl.biased_grouped_topk_cpu(
            hidden, gating, bias, topk, True, groups, topk_group, 0, 2.5, num_token_non_padded=None
        )
        scores = gating.double().sigmoid()
        ref_w, ref_ids = _grouped_ref(scores, scores + bias.double(), topk, groups, topk_group, True, 2.5)
    else:
        weights, ids = sgl.grouped_topk_cpu(
            hidden, gating, topk, True, groups, topk_group, 0, None, num_token_non_padded=None
        )
        scores = gating.double().softmax(-1)
        ref_w, ref_ids = _grouped_ref(scores, scores, topk, groups, topk_group, True, None)
    assert torch.equal(ids.long().sort(-1).values, ref_ids.sort(-1).values)
    torch.testing.assert_close(weights.double().sort(-1).values, ref_w.sort(-1).values, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- Meta (torch.compile's fake tensors)


def test_meta_shapes():
    x = torch.empty(3, 64, dtype=torch.bfloat16, device="meta")
    w = torch.empty(48, 64, dtype=torch.bfloat16, device="meta")
    assert sgl.weight_packed_linear(x, w, None, True).shape == (3, 48)
    assert sgl.silu_and_mul_cpu(x).shape == (3, 32)
    assert sgl.rmsnorm_cpu(x, torch.empty(64, dtype=torch.bfloat16, device="meta"), 1e-6).shape == (3, 64)
    gating = torch.empty(3, 8, device="meta")
    weights, ids = sgl.topk_softmax_cpu(x, gating, 2, True)
    assert weights.shape == ids.shape == (3, 2) and ids.dtype == torch.int32


# --------------------------------------------------------------------------- Python-level names


def test_assign_req_to_token_pool():
    import sgl_kernel

    req_to_token = torch.zeros(4, 16, dtype=torch.int32)
    out_cache_loc = torch.arange(100, 107, dtype=torch.int64)
    sgl_kernel.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]), req_to_token, torch.tensor([3, 0]), torch.tensor([6, 4]), out_cache_loc, 16
    )
    assert req_to_token[2, 3:6].tolist() == [100, 101, 102] and req_to_token[0, :4].tolist() == [103, 104, 105, 106]
    assert req_to_token.count_nonzero() == 7
    with pytest.raises(ValueError):
        sgl_kernel.assign_req_to_token_pool_cpu(
            torch.tensor([0]), req_to_token, torch.tensor([0]), torch.tensor([20]), out_cache_loc, 16
        )


def test_missing_python_names_raise_named():
    import sgl_kernel

    for name in ops.MISSING:
        with pytest.raises(NotImplementedError, match=name):
            getattr(sgl_kernel, name)()


# --------------------------------------------------------------------------- the gate (fresh interpreters)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KERNFORGE_SGLANG")}
    environment.update(SGLANG_USE_CPU_ENGINE="1", **env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )


GATE = """
    import torch
    from sglang.srt.utils import common
    import sglang.srt.layers.quantization.auto_round as early  # froze the gate before sgl_kernel (as one_batch)
    from sglang.kernels import fused_op
    early_key = fused_op._platform_key()  # cached before sgl_kernel: "" where torch sees no AMX
    import sgl_kernel
    import sglang.srt.layers.layernorm as late
    from sglang.srt.runtime_context import get_platform
    from sglang.srt.arg_groups.overrides import _attention_backend_platform_fallbacks
    from types import SimpleNamespace
    fallback = _attention_backend_platform_fallbacks(SimpleNamespace(attention_backend="intel_amx", device="cpu"))
    print("torch", torch.cpu._is_amx_tile_supported())
    print("gate", common.cpu_has_amx_support(), early._is_cpu_amx_available, late._is_cpu_amx_available,
          get_platform().has_amx)
    print("fallback", fallback)
    print("fused_op", repr(fused_op._platform_key()))  # BaseFusedOp layers dispatch to forward_cpu
    print("ops", hasattr(torch.ops.sgl_kernel, "convert_weight_packed"))
"""


def test_gate_reads_true_with_the_shim():
    result = _python(GATE)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines["gate"] == "True True True True", result.stdout
    assert "torch_native" not in lines["fallback"]  # --attention-backend intel_amx stays selected
    assert lines["ops"] == "True"
    assert lines["fused_op"] == "'cpu'"
    # torch's own detection is untouched
    assert lines["torch"] == str(torch.cpu._is_amx_tile_supported())


def test_gate_when_the_shim_is_imported_first():
    result = _python("import sgl_kernel\nfrom sglang.srt.utils import common\nprint(common.cpu_has_amx_support())")
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split()[-1] == "True"


def test_kernforge_sglang_0_registers_nothing():
    result = _python(GATE, KERNFORGE_SGLANG="0")
    assert result.returncode == 0, result.stderr[-4000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines["ops"] == "False"
    if lines["torch"] == "False":  # no AMX: SGLang's baseline (torch-native layers, no intel_amx)
        assert lines["gate"] == "False False False False"
        assert "torch_native" in lines["fallback"]


# --------------------------------------------------------------------------- SGLang's own benchmark on kernforge

ONE_BATCH = """
    import atexit, collections, runpy, sys
    import kernforge
    calls = collections.Counter()

    def counted(name):
        op = getattr(kernforge, name)
        def call(*args, **kwargs):
            calls[name] += 1
            return op(*args, **kwargs)
        setattr(kernforge, name, call)

    for name in COUNTED:
        counted(name)
    from sglang.srt.layers.attention.intel_amx_backend import IntelAMXAttnBackend
    for method in ("forward_decode", "forward_extend"):
        original = getattr(IntelAMXAttnBackend, method)
        def wrapped(self, *args, _original=original, _method=method, **kwargs):
            calls[_method] += 1
            return _original(self, *args, **kwargs)
        setattr(IntelAMXAttnBackend, method, wrapped)
    atexit.register(lambda: print("CALLS", dict(calls)))
    sys.argv = ["one_batch", *ARGS]
    runpy.run_module("sglang.benchmark.one_batch", run_name="__main__")
"""
DENSE_OPS = ("weight_packed_linear", "rmsnorm", "fused_add_rmsnorm", "silu_and_mul", "apply_rope_with_cos_sin_cache")
MOE_OPS = ("weight_packed_linear", "topk_softmax", "fused_experts", "rmsnorm", "apply_rope_with_cos_sin_cache")


@pytest.fixture(scope="module")
def sglang_moe_model_dir(tmp_path_factory):
    from kernforge.integrations import random_llama

    # a tiny Qwen3-MoE; expert width 128 (kernforge's packed gated experts want a multiple of 32)
    path = tmp_path_factory.mktemp("sglang-moe") / "tiny-qwen3-moe-10k"
    model = random_llama.random_llama(
        "tiny-moe", max_position_embeddings=4096, vocab_size=10240, moe_intermediate_size=128
    )
    model.save_pretrained(path)
    random_llama._tokenizer(model.config.vocab_size).save_pretrained(path)
    return path


@pytest.mark.parametrize("model", ["llama", "qwen3-moe"])
def test_one_batch_intel_amx_runs_on_kernforge(model, request, tmp_path):
    # SGLang's benchmark with --attention-backend intel_amx, unmodified, on this machine's tier (AMX or
    # not): the layer ops SGLang's AMX path calls come from kernforge, and the backend is not replaced
    assert "decode_attention_cpu" in ops.REGISTERED and "extend_attention_cpu" in ops.REGISTERED
    model_dir = request.getfixturevalue("sglang_model_dir" if model == "llama" else "sglang_moe_model_dir")
    counted = DENSE_OPS if model == "llama" else MOE_OPS
    args = [
        "--model-path", str(model_dir), "--device", "cpu", "--attention-backend", "intel_amx",
        "--load-format", "dummy", "--max-total-tokens", "4096",
        "--batch-size", "1", "--input-len", "64", "--output-len", "8",
    ]  # fmt: skip
    code = textwrap.dedent(ONE_BATCH).replace("COUNTED", repr(counted)).replace("ARGS", repr(args))
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KERNFORGE_SGLANG")}
    environment["SGLANG_USE_CPU_ENGINE"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "fallback to torch_native" not in output, output[-6000:]
    assert "Unsupported dimension or dtype for prepacking" not in output, output[-6000:]
    benchmark = output.split("Benchmark ...", 1)[-1]
    assert "Decode.  median latency" in benchmark and "Total. latency" in benchmark, output[-6000:]
    calls = eval(output.split("CALLS ", 1)[1].splitlines()[0])  # the counts the child printed
    for name in counted:
        assert calls.get(name, 0) > 0, (name, calls)
    assert calls.get("forward_decode", 0) > 0 and calls.get("forward_extend", 0) > 0, calls


# --------------------------------------------------------------------------- int8 w8a8 (sgl-kernel's quantization)


def _int8_ref(x, weight, scale, bias):
    xf = x.double()
    x_scale = xf.abs().amax(-1, keepdim=True).clamp_min(1e-7) / 127
    x_q = torch.round(xf / x_scale).clamp(-127, 127)
    out = (x_q @ weight.double().T) * x_scale * scale.double().reshape(1, -1)
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("n, k, m", [(80, 96, 1), (16, 32, 3), (130, 64, 2)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_scaled_mm_with_quant(n, k, m, with_bias):
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n, 1, dtype=torch.float32) * 0.01  # SGLang's weight_scale [N, 1]
    bias = torch.randn(n, dtype=torch.float32) if with_bias else None
    x = _bf16(m, k)
    packed = torch.nn.Parameter(sgl.convert_weight_packed(weight), requires_grad=False)
    assert packed.shape == (n, k) and packed.dtype == torch.int8
    out = sgl.int8_scaled_mm_with_quant(x, packed, scale, bias, torch.bfloat16, True)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _int8_ref(x, weight, scale, bias), atol=6e-2, rtol=2e-2)
    torch.testing.assert_close(sgl.int8_scaled_mm_with_quant(x, weight, scale, bias, torch.bfloat16, False), out)


def test_int8_bad_input():
    weight = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    packed = sgl.convert_weight_packed(weight)
    scale = torch.ones(32, 1)
    with pytest.raises(ValueError, match="scales2"):
        sgl.int8_scaled_mm_with_quant(_bf16(1, 64), packed, torch.ones(31), None, torch.bfloat16, True)
    with pytest.raises(ValueError, match="smaller than a packed"):
        sgl.int8_scaled_mm_with_quant(_bf16(1, 64), packed.clone(), scale, None, torch.bfloat16, True)
    with pytest.raises(TypeError, match="out_dtype"):
        sgl.int8_scaled_mm_with_quant(_bf16(1, 64), packed, scale, None, torch.float32, True)


# --------------------------------------------------------------------------- fp8 block-scaled (DeepSeek-V3 style)


@pytest.mark.parametrize("n, k, m", [(256, 384, 1), (160, 200, 3)])
def test_fp8_scaled_mm(n, k, m):
    block = [128, 128]
    weight = (torch.randn(n, k) * 0.5).to(torch.float8_e4m3fn)
    scales = torch.rand(-(-n // 128), -(-k // 128), dtype=torch.float32) + 0.5  # weight_scale_inv
    bias = torch.randn(n, dtype=torch.float32)
    x = _bf16(m, k)
    packed = torch.nn.Parameter(sgl.convert_weight_packed(weight), requires_grad=False)
    assert packed.shape == (n, k) and packed.dtype == torch.float8_e4m3fn
    out = sgl.fp8_scaled_mm_cpu(x, packed, scales, block, bias, torch.bfloat16, True)
    full = scales.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    ref = x.double() @ (weight.double() * full).T + bias.double()
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=6e-2, rtol=2e-2)
    torch.testing.assert_close(sgl.fp8_scaled_mm_cpu(x, weight, scales, block, bias, torch.bfloat16, False), out)
    with pytest.raises(ValueError, match="weight_scale"):
        sgl.fp8_scaled_mm_cpu(x, packed, scales[:, :1], block, bias, torch.bfloat16, True)


# --------------------------------------------------------------------------- int4 (AWQ) W4A8


def _awq_words(codes):  # codes [R, C] (C a multiple of 8) -> int32 [R, C / 8] in AWQ's nibble order
    order = (0, 4, 1, 5, 2, 6, 3, 7)
    words = torch.zeros(codes.shape[0], codes.shape[1] // 8, dtype=torch.int64)
    for j in range(8):
        words |= codes[:, j::8].long() << (4 * order[j])
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("m", [1, 3])
def test_int4_awq(m):
    k, n, group = 128, 64, 64
    codes = torch.randint(0, 16, (k, n))
    zeros = torch.randint(0, 16, (k // group, n))
    scales = (torch.rand(k // group, n) * 0.02 + 0.01).to(torch.bfloat16)
    # as SGLang's _amx_process_weight_after_loading(..., qweight_packed_method="awq"): 0 = CPUQuantAlgo.AWQ
    w, w_zeros, w_scales = sgl.convert_weight_packed_scale_zp(_awq_words(codes), _awq_words(zeros), scales, 0)
    x, bias = _bf16(m, k), torch.randn(n, dtype=torch.float32)
    out = sgl.int4_scaled_mm_cpu(x, w, w_zeros, w_scales, bias)
    weight = (codes - zeros.repeat_interleave(group, 0)).double() * scales.double().repeat_interleave(group, 0)
    ref = _int8_ref(x, weight.T.contiguous(), torch.ones(n), bias)  # activations quantized per token (W4A8)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=6e-2, rtol=3e-2)
    with pytest.raises(ValueError, match="quant_method_4bit"):
        sgl.convert_weight_packed_scale_zp(_awq_words(codes), _awq_words(zeros), scales, 7)


# --------------------------------------------------------------------------- MoE experts (bf16)


def _experts_ref(x, w1, w2, topk_weights, topk_ids):
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w1.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = w1[e].double() @ x[t].double()
            out[t] += float(topk_weights[t, j]) * (w2[e].double() @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


@pytest.mark.parametrize("tokens", [1, 5])
def test_fused_experts(tokens):
    experts, hidden, inter, topk = 6, 96, 64, 2
    w13, w2 = _bf16(experts, 2 * inter, hidden, scale=0.1), _bf16(experts, hidden, inter, scale=0.1)
    x = _bf16(tokens, hidden)
    topk_weights, topk_ids = sgl.topk_softmax_cpu(x, torch.randn(tokens, experts), topk, True)
    # as SGLang's unquantized MoE: both stacks packed by convert_weight_packed, then the call of unquant.py
    p13 = torch.nn.Parameter(sgl.convert_weight_packed(w13), requires_grad=False)
    p2 = torch.nn.Parameter(sgl.convert_weight_packed(w2), requires_grad=False)
    assert p13.shape == w13.shape and p2.shape == w2.shape
    args = (False, 0, None, None, None, None, None, None, None, None, None)
    out = sgl.fused_experts_cpu(x, p13, p2, topk_weights, topk_ids, *args, True, "silu")
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), _experts_ref(x, w13, w2, topk_weights, topk_ids), **BF16)
    torch.testing.assert_close(sgl.fused_experts_cpu(x, w13, w2, topk_weights, topk_ids, *args, False, "silu"), out)
    with pytest.raises(NotImplementedError, match="moe_comp_method"):
        sgl.fused_experts_cpu(x, p13, p2, topk_weights, topk_ids, False, 4, *args[2:], True, "silu")
    with pytest.raises(NotImplementedError, match="gelu"):
        sgl.fused_experts_cpu(x, p13, p2, topk_weights, topk_ids, *args, True, "gelu")


def test_fused_experts_refuses_an_unaligned_gated_packing():
    w13, w2 = _bf16(2, 2 * 48, 64), _bf16(2, 64, 48)  # I = 48
    x = _bf16(1, 64)
    p13, p2 = sgl.convert_weight_packed(w13), sgl.convert_weight_packed(w2)
    ids, weights = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1)
    with pytest.raises(NotImplementedError, match="multiple of 32"):
        sgl.fused_experts_cpu(x, p13, p2, weights, ids, False, 0, None, None, None, None, None, None, None, None, None)


def test_shared_expert():
    tokens, hidden, inter, scale = 3, 96, 64, 2.5
    w1, w2 = _bf16(2 * inter, hidden, scale=0.1), _bf16(hidden, inter, scale=0.1)
    x, routed = _bf16(tokens, hidden), _bf16(tokens, hidden)
    # DeepSeek's shared_experts.gate_up_proj / down_proj: 2-D linears packed by convert_weight_packed
    p1, p2 = sgl.convert_weight_packed(w1), sgl.convert_weight_packed(w2)
    out = sgl.shared_expert_cpu(x, p1, p2, routed, scale, False, False, False, None, None, None, True)
    ones, zeros = torch.ones(tokens, 1), torch.zeros(tokens, 1, dtype=torch.int32)
    ref = _experts_ref(x, w1[None], w2[None], ones, zeros) + scale * routed.double()
    torch.testing.assert_close(out.double(), ref, **BF16)
    with pytest.raises(NotImplementedError, match="use_int8_w8a8"):
        sgl.shared_expert_cpu(x, p1, p2, routed, scale, False, True, False, None, None, None, True)


def test_version_check(monkeypatch):
    import importlib.metadata

    import kernforge.integrations.sglang as integration

    monkeypatch.setattr(integration, "_warned", [])
    assert integration.check_sglang_version() is None  # the installed, pinned 0.5.23
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.6.0")
    with pytest.warns(UserWarning, match=r"sglang 0\.6\.0 is installed") as record:
        message = integration.check_sglang_version()
    assert message is not None and "pip install --no-deps 'sglang>=0.5.23,<0.5.24'" in message
    assert integration.check_sglang_version() == message and len(record) == 1  # once
