"""Decode attention over a paged temporal ring through page lists (`paged_kv.decode_pages`): the
host plans each step's lists before the step (outside any CUDA graph), the step's layers run on
them (inside it). Two implementations of the one interface:

    decode = FlashInferDecode(buckets, heads, head_dim, block_size, max_pages, device, kv_heads=heads)  # CUDA, bf16
    decode = TorchPagedDecode(heads, head_dim, block_size, kv_heads=heads)                            # any device
    decode.plan(n, indptr, indices, last_len)     # host int32 arrays for the first n rows
    out = decode.run(q, k_pool, v_pool)           # q [n, H, D] -> [n, H, D]; pools [blocks, Hkv, bs, D]

FlashInfer's `BatchDecodeWithPagedKVCacheWrapper` in HND layout, one wrapper per row count (its
CUDA-graph mode fixes the batch size and the buffers its kernels read), all sharing one float
workspace; `TorchPagedDecode` computes the same sums in PyTorch (the CPU tests' stand-in, and the
meaning of the lists: each row attends to every slot of its pages, the last page's first
`last_len` only). The step's own key and value must already be in the pool (`kernels.rope_write`
writes them before the attention, rotated: the decode applies no RoPE of its own, so RoPE on pairs
and on halves (rope_concat) read alike). Grouped KV heads (`kv_heads` < heads, kv_repeat r = heads /
kv_heads): query head h reads KV head h // r, the grouping of FlashInfer's GQA decode (which takes
r in `GROUP_SIZES`). FlashInfer is no dependency of Parley: `flashinfer_module()`
imports it when installed (flashinfer-python 0.7.2.post1, the version measured).
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's split-KV scratch (its recommended size), shared by the wrappers
GROUP_SIZES = (1, 2, 4, 8)  # query heads per KV head that every FlashInfer release's decode dispatches


def flashinfer_module() -> ModuleType | None:
    try:
        import flashinfer
    except ImportError:
        return None
    return flashinfer


class TorchPagedDecode:
    """The page lists' meaning in PyTorch: per row, softmax(q . k / sqrt(D)) v over its listed slots."""

    def __init__(self, heads: int, head_dim: int, block_size: int, kv_heads: int | None = None) -> None:
        self.heads, self.head_dim, self.block_size = heads, head_dim, block_size
        self.kv_heads = heads if kv_heads is None else kv_heads
        self._plans: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def plan(self, n: int, indptr: np.ndarray, indices: np.ndarray, last_len: np.ndarray) -> None:
        self._plans[n] = (indptr.copy(), indices.copy(), last_len.copy())

    def run(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        indptr, indices, last_len = self._plans[q.shape[0]]
        out = torch.empty_like(q)
        for b in range(q.shape[0]):
            pages = torch.as_tensor(indices[indptr[b]:indptr[b + 1]], dtype=torch.long, device=q.device)
            rep = self.heads // self.kv_heads  # (KV head i serves query heads i * rep .. i * rep + rep - 1)
            keys = k_pool[pages].transpose(0, 1).reshape(self.kv_heads, -1, self.head_dim)  # [Hkv, pages * bs, D]
            values = v_pool[pages].transpose(0, 1).reshape(self.kv_heads, -1, self.head_dim)
            keys, values = keys.repeat_interleave(rep, 0), values.repeat_interleave(rep, 0)
            slots = (len(pages) - 1) * self.block_size + int(last_len[b])
            scores = torch.einsum("hd,hsd->hs", q[b].float(), keys[:, :slots].float()) * self.head_dim ** -0.5
            out[b] = torch.einsum("hs,hsd->hd", scores.softmax(-1), values[:, :slots].float()).to(q.dtype)
        return out


class FlashInferDecode:
    """FlashInfer's paged decode, CUDA-graph safe: a wrapper per row bucket over fixed buffers."""

    def __init__(self, buckets: list[int], heads: int, head_dim: int, block_size: int, max_pages: int,
                 device: torch.device, kv_heads: int | None = None) -> None:
        flashinfer = flashinfer_module()
        if flashinfer is None:
            raise RuntimeError("FlashInfer is not installed (pip install flashinfer-python==0.7.2.post1)")
        self.heads, self.head_dim, self.block_size = heads, head_dim, block_size
        self.kv_heads = heads if kv_heads is None else kv_heads
        if heads % self.kv_heads or heads // self.kv_heads not in GROUP_SIZES:
            raise ValueError(f"{heads} query heads over {self.kv_heads} KV heads: FlashInfer's decode takes "
                             f"{', '.join(map(str, GROUP_SIZES))} query heads per KV head")
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._indices = {n: torch.zeros(n * max_pages, dtype=torch.int32, device=device) for n in buckets}
        self._wrappers = {
            n: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "HND", use_cuda_graph=True,
                paged_kv_indptr_buffer=torch.zeros(n + 1, dtype=torch.int32, device=device),
                paged_kv_indices_buffer=self._indices[n],
                paged_kv_last_page_len_buffer=torch.zeros(n, dtype=torch.int32, device=device))
            for n in buckets}
        # Host lists staged in pinned memory, copied on the stream (plan copies host indices blocking).
        self._pinned = torch.empty(max(buckets) * max_pages, dtype=torch.int32, pin_memory=True)

    def plan(self, n: int, indptr: np.ndarray, indices: np.ndarray, last_len: np.ndarray) -> None:
        staged = self._pinned[:len(indices)]
        staged.numpy()[:] = indices
        on_device = self._indices[n][:len(indices)]
        on_device.copy_(staged, non_blocking=True)
        self._wrappers[n].plan(torch.from_numpy(indptr), on_device, torch.from_numpy(last_len), self.heads,
                               self.kv_heads, self.head_dim, self.block_size, q_data_type=torch.bfloat16,
                               kv_data_type=torch.bfloat16)

    def run(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        return self._wrappers[q.shape[0]].run(q.contiguous(), (k_pool, v_pool))
