"""Training on a weighted mix of three token sources with a weight schedule, interrupted and
resumed on another world size, worker count or batch size.

    python examples/train_mix.py                                          # one process
    torchrun --nproc-per-node 2 examples/train_mix.py --stop-after 6      # "preempted" ...
    torchrun --nproc-per-node 3 examples/train_mix.py --resume --workers 0 --batch-size 6

Each source is a file of tokens read in windows (``TokenWindows``); without ``--data`` three
tiny ones are generated. ``--log-identities FILE`` writes which (source, index) each rank read
at each step, so a test can check that the interrupted and resumed runs read exactly what an
uninterrupted one reads.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from _torchrun import join, leave
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from fastloader import DataLoader, Mix

VOCAB, CONTEXT = 256, 32
# Weights by samples of the mixed stream (a schedule by step: step x global batch size), so
# the change happens at the same sample whatever the world size or batch size.
WEIGHTS = {"web": 0.6, "code": 0.3, "math": 0.1}
ANNEAL_AT = 160  # samples: from here on, more code and math
ANNEALED = {"web": 0.3, "code": 0.4, "math": 0.3}


class TokenWindows(Dataset):
    """Windows of ``CONTEXT + 1`` tokens of a ``.npy`` file, memory-mapped in each process."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self.windows = (len(np.load(self.path, mmap_mode="r")) - 1) // CONTEXT
        self._tokens = None

    def __len__(self) -> int:
        return self.windows

    def __getitem__(self, index: int) -> torch.Tensor:
        if self._tokens is None:  # opened lazily: in the worker that reads
            self._tokens = np.load(self.path, mmap_mode="r")
        start = index * CONTEXT
        return torch.from_numpy(np.array(self._tokens[start : start + CONTEXT + 1], np.int64))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}


def make_sources(folder: Path) -> dict[str, Path]:
    """Three tiny token files with different statistics (web, code, math)."""
    folder.mkdir(parents=True, exist_ok=True)
    sizes = {"web": 12_000, "code": 5_000, "math": 1_500}
    paths = {}
    for seed, (name, size) in enumerate(sizes.items()):
        path = folder / f"{name}.npy"
        if not path.exists():
            rng = np.random.default_rng(seed)
            tokens = (np.cumsum(rng.integers(1, 4 + seed, size)) % VOCAB).astype(np.uint8)
            np.save(path, tokens)
        paths[name] = path
    return paths


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="a folder with web.npy, code.npy, math.npy (tokens)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--workers", type=int, default=1, help="per rank")
    parser.add_argument("--checkpoint", default="mix-checkpoint.pt")
    parser.add_argument("--stop-after", type=int, help="stop after this many steps (a test)")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument("--log-identities", help="write each step's (source, index) per rank")
    return parser.parse_args()


def build(args: argparse.Namespace, distributed: bool, rank: int) -> tuple:
    """The mix of three token sources, its loader, a tiny model and its optimizer."""
    folder = Path(args.data or Path(tempfile.gettempdir(), "fastloader-example-tokens"))
    if rank == 0:
        make_sources(folder)
    if distributed:
        dist.barrier()
    mix = Mix(
        {name: TokenWindows(folder / f"{name}.npy") for name in WEIGHTS},
        WEIGHTS,
        schedule={ANNEAL_AT: ANNEALED},
        samples_per_epoch=256,
    )
    loader = DataLoader(
        mix, batch_size=args.batch_size, num_workers=args.workers, distributed=distributed, seed=0
    )
    model = nn.Sequential(nn.Embedding(VOCAB, 32), nn.Linear(32, VOCAB))
    if distributed:
        model = DistributedDataParallel(model)
    return loader, model, torch.optim.SGD(model.parameters(), lr=0.1)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> float:
    """One next-token prediction step; returns the loss."""
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def main() -> None:
    args = parse_args()
    distributed, rank = join()  # examples/_torchrun.py: under torchrun, the gloo group
    loader, model, optimizer = build(args, distributed, rank)

    step = 0
    if args.resume:  # any world size, worker count or batch size: the state counts samples
        checkpoint = torch.load(args.checkpoint)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        loader.load_state_dict(checkpoint["loader"])  # the mix's weight history included
        step = checkpoint["step"]
        if rank == 0:
            at = checkpoint["loader"]["position"]
            print(f"resumed at step {step}, epoch {loader.epoch}, sample {at} of the epoch")
    log = open(f"{args.log_identities}.rank{rank}", "a") if args.log_identities else None
    for epoch in range(loader.epoch, args.epochs):
        for batch in loader:  # a MixSample: .sample (the tokens), .source (names), .index
            loss = train_step(model, optimizer, batch.sample)
            if log is not None:
                rows = list(zip(batch.source, batch.index.tolist(), strict=True))
                log.write(json.dumps([epoch, loader.state_dict()["position"], rows]) + "\n")
            step += 1
            if rank == 0:  # one rank's state resumes every rank of any new world size
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save({**state, "loader": loader.state_dict(), "step": step}, args.checkpoint)
            if step == args.stop_after:
                if rank == 0:
                    print(f"stopped after step {step}; run again with --resume")
                break
        else:
            if rank == 0:
                shares = loader.stats.last.source_shares  # realised: over every rank
                text = ", ".join(f"{name} {100 * share:.0f}%" for name, share in shares.items())
                print(f"epoch {epoch}: loss {loss:.3f}, step {step}, sources {text}")
            continue
        break  # stopped early
    if log is not None:
        log.close()
    loader.close()
    leave(distributed)


if __name__ == "__main__":
    main()
