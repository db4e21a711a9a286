"""A Llama generating with tensor parallelism: each rank (a process) holds a slice of every layer
and of the vocabulary, and the ranks sum their partial results with kernforge's shared-memory
all-reduce (``kernforge.distributed``) on a ``torch.distributed`` gloo group.

    torchrun --nproc-per-node 2 examples/tp_generate.py                 # Llama-3.2-1B shape, random weights
    torchrun --nproc-per-node 2 examples/tp_generate.py /path/to/llama  # a local checkpoint (nothing is downloaded)
    torchrun --nproc-per-node 2 examples/tp_generate.py --layers 2 --prompt-len 64 --new-tokens 8

Every rank builds the same model (the same seed, or the checkpoint), binds its threads to its share
of the cores, and calls ``optimize(model, tp_group=...)``; rank 0 prints the binding of each rank,
TTFT, TPOT and the tokens (every rank generates the same ones).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import kernforge.distributed as kd
from kernforge.integrations import transformers as kft
from kernforge.integrations.random_llama import random_llama


def build_model(checkpoint: str | None, layers: int | None) -> torch.nn.Module:
    if checkpoint:
        overrides = {"num_hidden_layers": layers} if layers else {}
        return AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.bfloat16, local_files_only=True, **overrides
        ).eval()
    return random_llama("llama-3.2-1b", 0, layers, max_position_embeddings=131072)


def timed_generate(model, ids: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float]:
    dist.barrier()
    start = time.perf_counter()
    out = kft.generate(model, ids, max_new_tokens=new_tokens)  # greedy
    return out, time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", nargs="?", help="a local checkpoint directory (default: random weights)")
    p.add_argument("--layers", type=int, help="decoder layers (default: the model's)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()

    dist.init_process_group("gloo")
    binding = kd.bind_threads()  # LOCAL_RANK's share of the cores (torchrun sets it)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = kft.optimize(build_model(args.checkpoint, args.layers), kv_cache_pages=1024, tp_group=dist.group.WORLD)
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(1))
    kft.generate(model, ids[:, :8], max_new_tokens=2)  # compile (first run only) and warm the kernels
    _, ttft = timed_generate(model, ids, 1)
    out, total = timed_generate(model, ids, args.new_tokens)
    bindings = [None] * world
    dist.all_gather_object(bindings, binding)
    comm = model._kernforge.comm
    if rank == 0:
        for r, line in enumerate(bindings):
            print(f"rank {r}: {line}")
        path = "shared memory" if comm is None or comm.uses_shared_memory else "the gloo group"
        print(f"tensor parallel over {world} ranks, collectives through {path}")
        print(f"TTFT {ttft * 1e3:.1f} ms ({args.prompt_len}-token prompt)")
        print(f"TPOT {(total - ttft) / max(1, args.new_tokens - 1) * 1e3:.1f} ms")
        print(f"tokens: {out[0, args.prompt_len :].tolist()}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
