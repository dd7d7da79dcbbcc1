"""A small tensor-parallel torch forward for the engine-side tests of vt.parallel: an
embedding, a context read from its paged cache (the mean of the sequence's cached
embeddings, so every token depends on the whole context), a column-then-row parallel MLP
with an all-reduce, and a vocabulary-parallel head gathered whole. Built from a seed, so
every rank (and the one-process reference) starts from the same full weights."""
from __future__ import annotations

import torch
from torch import nn

from vt.step import KVGeometry
from vt.torch import TorchForwardModel, torch_device
from vt.torch.tensor_parallel import TensorParallel

GEO = KVGeometry(max_seqs=8, num_kv_blocks=64, block_size=4, max_context=48)
VOCAB, HIDDEN, INTER = 67, 32, 64     # a vocabulary the ranks do not divide evenly


class ShardedToy(nn.Module):
    def __init__(self, tp: TensorParallel, device, geometry=GEO, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        vocab_padded = -(-VOCAB // tp.size) * tp.size
        embed = torch.randn(VOCAB, HIDDEN, generator=g)
        pos_embed = torch.randn(geometry.max_context, HIDDEN, generator=g)
        w1 = torch.randn(INTER, HIDDEN, generator=g) / HIDDEN ** 0.5
        w2 = torch.randn(HIDDEN, INTER, generator=g) / INTER ** 0.5
        head = torch.zeros(vocab_padded, HIDDEN)
        head[:VOCAB] = torch.randn(VOCAB, HIDDEN, generator=g)
        self.tp, self.vocab, self.geometry = tp, VOCAB, geometry
        inter = tp.shard(INTER, "intermediate")
        rows = tp.shard(vocab_padded, "padded vocabulary")
        self.register_buffer("embed", embed.to(device))
        self.register_buffer("pos_embed", pos_embed.to(device))
        self.register_buffer("w1", w1[inter].contiguous().to(device))       # column-parallel
        self.register_buffer("w2", w2[:, inter].contiguous().to(device))    # row-parallel
        self.register_buffer("head", head[rows].contiguous().to(device))    # vocab-parallel
        slots = geometry.num_kv_blocks * geometry.block_size
        self.register_buffer("cache", torch.zeros(slots, HIDDEN, device=device))
        self.register_buffer("context", torch.arange(geometry.max_context, device=device))

    @torch.inference_mode()
    def forward(self, inputs, logits_out):
        x = self.embed[inputs.input_ids.long()] + self.pos_embed[inputs.positions.long()]
        self.cache.index_copy_(0, inputs.slot_mapping.long(), x)
        bs = self.geometry.block_size
        pos = self.context
        slots = inputs.block_tables.long()[:, pos // bs] * bs + pos % bs       # [B, C]
        live = (pos[None, :] < inputs.seq_lens.long()[:, None]).float()        # [B, C]
        ctx = (self.cache[slots] * live[..., None]).sum(1) / live.sum(1, keepdim=True)
        h = x[inputs.logits_indices.long()] + ctx
        h = h + self.tp.all_reduce(torch.relu(h @ self.w1.T) @ self.w2.T)
        logits = self.tp.all_gather(h @ self.head.T, dim=-1)
        logits_out.copy_(logits[:, :self.vocab])


def build(be, tp):
    """The model of one rank (Engine(..., tensor_parallel=N)'s build)."""
    return TorchForwardModel(be, ShardedToy(tp, torch_device(be)), prefill="flat")


def build_failing_on_rank_1(be, tp):
    if tp.rank == 1:
        raise RuntimeError("this rank cannot load its shard")
    return build(be, tp)


def reference(be):
    """The same model in one process, unsharded."""
    return build(be, TensorParallel(0, 1))
