"""One decode step of a GQA attention stack over a paged KV cache, as a serving engine runs it.

Per step: plan the batch once (BatchDecodeWithPagedKVCacheWrapper.plan), then per layer rotate
q and k (apply_rope_pos_ids_inplace), append k and v to the layer's cache (append_paged_kv_cache)
and attend (run). The result is checked against plain PyTorch attention on the gathered pages.

    python examples/decode_step.py
"""

import math

import torch

import kernforge

LAYERS, HEADS, KV_HEADS, HEAD_DIM, PAGE = 4, 32, 8, 128, 16
DTYPE = torch.bfloat16


def paged_batch(past_lens: list[int]):
    """A page table for requests that already hold `past_lens` tokens and get one more."""
    pages_per_request = [(n + 1 + PAGE - 1) // PAGE for n in past_lens]
    num_pages = sum(pages_per_request)
    indices = torch.randperm(num_pages, dtype=torch.int32)  # pages scattered, as an allocator leaves them
    indptr = torch.tensor([0, *torch.tensor(pages_per_request).cumsum(0).tolist()], dtype=torch.int32)
    last_page_len = torch.tensor([(n + 1 - 1) % PAGE + 1 for n in past_lens], dtype=torch.int32)
    return num_pages, indices, indptr, last_page_len


def reference(q, cache, indices, indptr, last_page_len):
    """Attention of each request's query over its gathered pages, in fp32."""
    out = []
    for b in range(q.shape[0]):
        pages = indices[indptr[b] : indptr[b + 1]].long()
        length = (len(pages) - 1) * PAGE + int(last_page_len[b])
        k, v = (cache[pages, i].reshape(-1, KV_HEADS, HEAD_DIM)[:length].float() for i in (0, 1))
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
        scores = torch.einsum("hd,thd->ht", q[b].float(), k) / math.sqrt(HEAD_DIM)
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def main():
    torch.manual_seed(0)
    past_lens = [5, 130, 1000]  # an uneven batch: the planner splits the long request across threads
    batch = len(past_lens)
    num_pages, indices, indptr, last_page_len = paged_batch(past_lens)
    caches = [torch.randn(num_pages, 2, PAGE, KV_HEADS, HEAD_DIM).to(DTYPE) for _ in range(LAYERS)]

    decode = kernforge.BatchDecodeWithPagedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8), "NHD")
    decode.plan(indptr, indices, last_page_len, HEADS, KV_HEADS, HEAD_DIM, PAGE, q_data_type=DTYPE)
    positions = torch.tensor(past_lens, dtype=torch.int32)  # the new token's position in each request
    batch_indices = torch.arange(batch, dtype=torch.int32)

    for layer, cache in enumerate(caches):
        qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(DTYPE)  # a fused qkv projection
        q = qkv[:, : HEADS * HEAD_DIM].view(batch, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(batch, KV_HEADS, HEAD_DIM)
        v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(batch, KV_HEADS, HEAD_DIM)
        kernforge.apply_rope_pos_ids_inplace(q, k, positions)  # writes through the views into qkv
        kernforge.append_paged_kv_cache(k, v, batch_indices, positions, cache, indices, indptr, last_page_len)
        out = decode.run(q, cache)
        error = (out.float() - reference(q, cache, indices, indptr, last_page_len)).abs().max().item()
        print(f"layer {layer}: out {tuple(out.shape)} {out.dtype}, max |error| vs torch {error:.1e}")
        assert error < 2e-2, error


if __name__ == "__main__":
    main()
