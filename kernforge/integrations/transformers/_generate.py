"""A small generation loop on the paged cache, sampling with kernforge's sampling op.

It takes the arguments of transformers' ``generate`` that greedy and top-k/top-p sampling use,
with the same defaults (read from ``model.generation_config``), and returns what ``generate``
returns by default: the prompts followed by the new tokens, ``[batch, prompt + new]``.
"""

from __future__ import annotations

import warnings

import torch

from kernforge.integrations.transformers import _compat
from kernforge.integrations.transformers import _kernels as kf
from kernforge.integrations.transformers._cache import new_cache


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int | None = None,
    max_length: int | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id=None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    streamer=None,
) -> torch.Tensor:
    """Greedy or sampled generation for a model :func:`optimize` prepared.

    ``attention_mask`` marks left padding in a batch of prompts of uneven lengths (0: padding).
    Sampling applies ``temperature``, then top-k, then top-p to the remaining mass (transformers'
    order), drawing from ``generator``; a sequence that emits ``eos_token_id`` is finished and
    continues with ``pad_token_id``; the loop stops when every sequence is finished or after
    ``max_new_tokens``. ``streamer.put()`` receives the prompts, then each step's tokens, and
    ``streamer.end()`` is called at the end, as transformers' streamers expect. Running past the
    config's ``max_position_embeddings`` warns once, as transformers' ``generate`` does.
    """
    config = model.generation_config
    batch, prompt_len = _checked_prompt(input_ids, attention_mask)
    if max_new_tokens is None:
        max_new_tokens = _setting(max_length, config, "max_length") - prompt_len
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    sample = _sampler(model, config, do_sample, temperature, top_k, top_p, generator)
    eos = _token_set(config.eos_token_id if eos_token_id is None else eos_token_id)
    pad = pad_token_id if pad_token_id is not None else config.pad_token_id
    if pad is None:
        pad = int(eos[0]) if eos is not None and len(eos) else 0  # eos_token_id=[]: no stop token

    if attention_mask is not None and bool(attention_mask.all()):
        attention_mask = None
    position_ids = None
    if attention_mask is not None:
        attention_mask = attention_mask.to(torch.long)
        position_ids = (attention_mask.cumsum(-1) - 1).masked_fill_(attention_mask == 0, 1)
    cache, cache_argument = new_cache(model), _compat.cache_argument(model.forward)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    tokens, finished = [], torch.zeros(batch, dtype=torch.bool)
    step_ids = input_ids
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    # the first step whose forward feeds a position >= the context (the prefill, for a longer prompt)
    past_context = None if context is None else max(context + 1 - prompt_len, 0)
    for step in range(max_new_tokens):
        if step == past_context:
            _warn_past_context(context)
        outputs = model(
            input_ids=step_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{cache_argument: cache},
        )
        next_tokens = sample(outputs.logits[:, -1])
        if eos is not None:
            next_tokens = next_tokens.masked_fill(finished, pad)
            finished |= torch.isin(next_tokens, eos)
        tokens.append(next_tokens)
        if streamer is not None:
            streamer.put(next_tokens.cpu())
        if bool(finished.all()) or step + 1 == max_new_tokens:
            break
        step_ids = next_tokens[:, None]
        if attention_mask is not None:
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], dim=1)
            position_ids = position_ids[:, -1:] + 1
    if streamer is not None:
        streamer.end()
    return torch.cat([input_ids, torch.stack(tokens, dim=1)], dim=1)


def _warn_past_context(context: int | None) -> None:
    """transformers' generate warns when a sequence grows past the model's context (its
    MaxLengthCriteria, as a logged warning): so does this loop, as a UserWarning."""
    warnings.warn(
        f"the current text generation call has exceeded the model's predefined maximum length "
        f"(max_position_embeddings={context}). Depending on the model, you may observe exceptions, performance "
        "degradation, or nothing at all",
        UserWarning,
        stacklevel=4,  # this function, generate, torch.no_grad's wrapper, the caller
    )


def _checked_prompt(input_ids, attention_mask) -> tuple[int, int]:
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.dim() != 2
        or input_ids.dtype not in (torch.int64, torch.int32)
    ):
        raise ValueError(
            f"input_ids must be a 2-D integer tensor [batch, prompt_len], got "
            f"{getattr(input_ids, 'shape', type(input_ids).__name__)}"
        )
    if input_ids.shape[1] < 1:
        raise ValueError("input_ids must hold at least one token per prompt")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}"
        )
    return input_ids.shape


# transformers' GenerationConfig defaults, for settings neither the call nor the model's config gives
_DEFAULTS = {"max_length": 20, "do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}


def _setting(value, config, name: str):
    """The call's value, else the model's generation_config's, else transformers' default."""
    if value is None:
        value = getattr(config, name, None)
    return _DEFAULTS[name] if value is None else value


def _token_set(eos_token_id) -> torch.Tensor | None:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def _sampler(model, config, do_sample, temperature, top_k, top_p, generator):
    """``logits [batch, vocab] -> tokens [batch]`` (int64): argmax, or kernforge's top-k/top-p sampler."""
    if not _setting(do_sample, config, "do_sample"):
        return lambda logits: torch.argmax(logits, dim=-1)
    temperature = float(_setting(temperature, config, "temperature"))
    top_k = _setting(top_k, config, "top_k")
    top_p = float(_setting(top_p, config, "top_p"))
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    vocab = model.config.get_text_config().vocab_size
    top_k = vocab if not top_k else min(int(top_k), vocab)  # 0 or None: no top-k filter, as in transformers

    def sample(logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if temperature != 1.0:
            logits.div_(temperature)
        return kf.top_k_top_p_sampling_from_logits(logits, top_k, top_p, generator=generator).long()

    return sample
