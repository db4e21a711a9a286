"""The sampling kernels' random numbers: Philox4x32-10 against Random123's known-answer vectors.

The sampling tests check distributions; this pins the generator itself, so a
change to it (which would change every seeded sample) cannot pass unnoticed.
"""

import pytest
import torch

from kernels import PHILOX_KAT

# (counter, key) -> output, from Random123's kat_vectors (Salmon et al., SC'11).
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.all_tiers  # three tiny calls: the generator as each tier's build compiles it
@pytest.mark.parametrize("counter, key, expected", KNOWN_ANSWERS, ids=["zeros", "ones", "pi"])
def test_philox_known_answers(counter, key, expected, tier, test_templates):
    words = torch.tensor([*counter, *key], dtype=torch.int64).to(torch.uint32)
    PHILOX_KAT.variant().kernel().run(words.data_ptr())
    assert tuple(int(w) for w in words[:4].to(torch.int64)) == expected
