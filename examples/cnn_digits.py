"""A small CNN on scikit-learn's digits (1,797 8x8 images, shipped with scikit-learn).

Elastic under shoal, unchanged under torchrun or as one process::

    python examples/cnn_digits.py --epochs 3
    torchrun --nproc-per-node 2 examples/cnn_digits.py --epochs 3

The five ``shoal.train`` lines are marked ``# shoal``.
"""

from __future__ import annotations

import argparse

import shoal.train as st
import torch
import torch.nn.functional as F
from torch import nn


def load_digits(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The digits images scaled to [0, 1] as (N, 1, 8, 8) and their labels."""
    from sklearn.datasets import load_digits as sk_load_digits

    data = sk_load_digits()
    x = torch.tensor(data.images, dtype=dtype).unsqueeze(1) / 16.0
    return x, torch.tensor(data.target, dtype=torch.long)


class DigitsCNN(nn.Module):
    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, channels, 3, padding=1)
        self.fc = nn.Linear(channels * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return self.fc(x.flatten(1))


def build(
    seed: int, dtype: torch.dtype, optimizer: str, lr: float, device: torch.device | str = "cpu"
) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = DigitsCNN().to(device=device, dtype=dtype)
    if optimizer == "adam":
        return model, torch.optim.Adam(model.parameters(), lr=lr)
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=64, help="global batch size (strong scaling)")
    p.add_argument("--scaling", choices=("strong", "weak"), default="strong")
    p.add_argument("--per-worker-batch", type=int, default=16, help="samples per worker (weak scaling)")
    p.add_argument("--weak-range", default="1,4", help="world sizes min,max where weak scaling holds")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--float64", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.epochs is None and args.max_steps is None:
        args.epochs = 3
    dtype = torch.float64 if args.float64 else torch.float32
    torch.set_num_threads(1)

    job = st.init()  # shoal
    x, y = (t.to(job.device) for t in load_digits(dtype))
    model, opt = build(args.seed, dtype, args.optimizer, args.lr, job.device)
    job.register(model, opt)  # shoal
    lo, hi = (int(v) for v in args.weak_range.split(","))
    job.elastic_sampler(  # shoal
        len(x),
        global_batch_size=args.batch,
        scaling=args.scaling,
        per_worker_batch=args.per_worker_batch,
        weak_range=(lo, hi),
        seed=args.seed,
    )
    for step in job.train(max_steps=args.max_steps, epochs=args.epochs):  # shoal
        idx = torch.as_tensor(step.indices, dtype=torch.long, device=job.device)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        job.step(loss)  # shoal
        if job.rank == 0 and job.iteration % 20 == 0:
            print(
                f"step {job.iteration} epoch {step.data_epoch} world {job.world} loss {job.loss:.4f}",
                flush=True,
            )
    if job.rank == 0:
        print(f"done step {job.iteration} loss {job.loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
