"""A small transformer language model on synthetic tokens (no download).

The tokens come from a fixed random first-order Markov chain, so there is
something to learn: the loss falls from ln(vocab) towards the chain's entropy.

    python examples/transformer_lm.py --max-steps 100
    torchrun --nproc-per-node 2 examples/transformer_lm.py --max-steps 100
    torchrun --nproc-per-node 2 examples/transformer_lm.py --max-steps 100 --plain-ddp   # baseline

``--plain-ddp`` runs the same model, data and global batches with
``torch.nn.parallel.DistributedDataParallel`` and no shoal, as the overhead baseline.
The model and the tokens live on ``job.device``: a GPU when shoal (or
``SHOAL_TRAIN_DEVICE=cuda`` under torchrun) says so. The baseline uses the same
variable: ``cuda`` runs it on NCCL with one GPU per rank (``LOCAL_RANK``), else gloo on CPU.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import shoal.train as st
import torch
import torch.nn.functional as F
from torch import nn


def markov_tokens(n_seqs: int, seq_len: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """``n_seqs`` sequences of ``seq_len + 1`` tokens from a sparse random Markov chain."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(vocab, vocab)) * 3.0
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    cdf = probs.cumsum(1)
    out = np.empty((n_seqs, seq_len + 1), dtype=np.int64)
    out[:, 0] = rng.integers(0, vocab, n_seqs)
    u = rng.random((n_seqs, seq_len))
    for t in range(seq_len):
        out[:, t + 1] = (u[:, t : t + 1] > cdf[out[:, t]]).sum(1).clip(max=vocab - 1)
    return torch.from_numpy(out)


class TinyLM(nn.Module):
    def __init__(
        self, vocab: int = 64, d_model: int = 64, layers: int = 2, heads: int = 4, seq_len: int = 32
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
        layer = nn.TransformerEncoderLayer(d_model, heads, 2 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:t]
        return self.head(self.encoder(h, mask=self.mask[:t, :t], is_causal=True))


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=32, help="global batch size (sequences)")
    p.add_argument("--seqs", type=int, default=2048)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plain-ddp", action="store_true", help="baseline: torch DDP, no shoal")
    p.add_argument("--time-after", type=int, default=10, help="report steps/s after this many steps")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    data = markov_tokens(args.seqs, 32, 64, args.seed)
    torch.manual_seed(args.seed)
    model = TinyLM()
    if args.plain_ddp:
        return _plain_ddp(args, data, model)

    job = st.init()  # shoal
    model, data = model.to(job.device), data.to(job.device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    job.register(model, opt)  # shoal
    job.elastic_sampler(len(data), global_batch_size=args.batch, seed=args.seed)  # shoal
    t0, first = 0.0, 0
    for step in job.train(max_steps=args.max_steps):  # shoal
        if job.iteration == args.time_after:
            t0, first = time.perf_counter(), job.iteration
        loss = lm_loss(model, data[torch.as_tensor(step.indices, dtype=torch.long, device=job.device)])
        loss.backward()
        job.step(loss)  # shoal
        if job.rank == 0 and job.iteration % 50 == 0:
            print(f"step {job.iteration} world {job.world} loss {job.loss:.4f}", flush=True)
    if job.device.type == "cuda":
        torch.cuda.synchronize()  # the rate counts the queued GPU work too
    if job.rank == 0 and t0:
        rate = (job.iteration - first) / (time.perf_counter() - t0)
        print(f"done step {job.iteration} loss {job.loss:.4f} steps_per_s {rate:.3f}", flush=True)


def _plain_ddp(args: argparse.Namespace, data: torch.Tensor, model: nn.Module) -> None:
    import torch.distributed as dist
    from shoal.train.data import ElasticSampler, Scaling

    if os.environ.get("SHOAL_TRAIN_DEVICE") == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
        model, data = model.to(device), data.to(device)
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    rank, world = dist.get_rank(), dist.get_world_size()
    sampler = ElasticSampler(len(data), Scaling(global_batch_size=args.batch), seed=args.seed)
    t0 = 0.0
    for it in range(args.max_steps):
        if it == args.time_after:
            t0 = time.perf_counter()
        glob = sampler.global_indices(world)
        idx = sampler.local_indices(world, rank)
        loss = lm_loss(ddp, data[torch.as_tensor(idx, dtype=torch.long, device=device)])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sampler.advance(len(glob))
    if device.type == "cuda":
        torch.cuda.synchronize()  # the rate counts the queued GPU work too
    if rank == 0:
        rate = (args.max_steps - args.time_after) / (time.perf_counter() - t0)
        print(f"done step {args.max_steps} loss {loss.item():.4f} steps_per_s {rate:.3f}", flush=True)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
