"""Two engines' greedy generations compared token by token (tests/vllm, tests/sglang): any difference fails
but a near-tie, where a prompt's comparison stops (reported).

Two bf16 implementations round differently, and the tiny random models' bf16 logits (magnitude ~10-16)
are spaced 0.0625 apart, so two tokens often tie within an ulp or two. A run is
``{"outputs": [{"ids": [token, ...], "logprobs": [{str(token): logprob, ...} per step]}, ...]}``, the
logprobs being each step's top candidates."""

import pytest

BF16_LOGIT_ULP = 0.0625  # at the tiny model's logit magnitudes
LOGPROB_ATOL = 2.5 * BF16_LOGIT_ULP  # nats, on the tokens both runs chose
NEAR_TIE = 2.5 * BF16_LOGIT_ULP  # nats between the two runs' choices, in the stock run's own logprobs
MIN_COMPARED = 0.35  # of all generated tokens, compared before their prompt's near-tie


def _tied(logprobs: dict, best: int, other: int, near_tie: float) -> bool:
    """Whether ``other`` may tie ``best`` within ``near_tie`` in one run's top logprobs (a token
    outside them is no likelier than the last one listed)."""
    top = logprobs[str(best)]
    return top - logprobs.get(str(other), min(logprobs.values())) <= near_tie


def compare_greedy(stock: dict, kernforge: dict, atol=LOGPROB_ATOL, near_tie=NEAR_TIE) -> tuple[list[str], float]:
    """Fail on any difference but a near-tie; the near-ties found (one line each) and the share of
    generated tokens compared before them."""
    near_ties, compared, total = [], 0, 0
    for prompt, (ours, theirs) in enumerate(zip(kernforge["outputs"], stock["outputs"])):
        total += len(theirs["ids"])
        for step, (mine, expected) in enumerate(zip(ours["ids"], theirs["ids"])):
            stock_logprobs, our_logprobs = theirs["logprobs"][step], ours["logprobs"][step]
            assert our_logprobs[str(mine)] == pytest.approx(stock_logprobs[str(expected)], abs=atol), (
                f"prompt {prompt}, step {step}: top logprob {our_logprobs[str(mine)]} vs stock's "
                f"{stock_logprobs[str(expected)]}"
            )
            if mine == expected:
                compared += 1
                continue
            assert _tied(stock_logprobs, expected, mine, near_tie) and _tied(our_logprobs, mine, expected, near_tie), (
                f"prompt {prompt}, step {step}: kernforge chose {mine} {our_logprobs}, stock {expected} "
                f"{stock_logprobs}: not a near-tie"
            )
            near_ties.append(f"prompt {prompt} step {step}: {mine} vs {expected}")
            break
    return near_ties, compared / total
