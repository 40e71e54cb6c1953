"""The reference's training loop, epoch by epoch, on a cellSpike file: the PyTorch side of tools/parity.py.

    .venv-torch/bin/python tools/reference_train.py --data_path=FILE.h5 [--epochs=6] [--seed=0]
        [--batch_size=192] [--learning_rate=1e-3] [--warmup_epochs=2] [--threads=0] [--bf16]

It trains `tools/reference_torch.py`'s model (the reference's layers, PyTorch's default initialisation)
the way the reference's `torch/toolbox/Trainer.py` does on one device: torch.optim.Adam and MSE; for
the first `warmup_epochs` epochs the learning rate is lr * (epoch + 1) / warmup_epochs, afterwards
ReduceLROnPlateau (factor, patience, cooldown) is stepped with each epoch's validation loss; the
training rows are reshuffled every epoch (the last partial batch dropped), validation runs in eval
mode. Two differences, kept so that both sides see the same validation rows: the reference also
shuffles its validation rows each epoch and drops the last partial batch; here they are read in
order and all of them are used (the short last batch weighted by its rows), as the application reads
them on CPUs and GPUs.

The file's splits are held in memory as float32 (input is not what is compared). Prints one JSON
line: per-epoch training and validation loss, learning rate, and seconds (training + validation).
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from errors import OneLineArgumentParser, existing_file, report_missing_packages  # noqa: E402  pylint: disable=wrong-import-position
report_missing_packages("reference")  # before the first third-party import: one line where one is missing

from model.neuron_inverter.designs import DESIGNS  # noqa: E402  plain data: no TensorFlow comes with it


def parse_args():
  parser = OneLineArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--data_path", type=existing_file, required=True,
                      help="cellSpike .h5 file (train and val splits)")
  parser.add_argument("--design", default="ontra4", choices=sorted(DESIGNS))
  parser.add_argument("--epochs", type=int, default=6)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--batch_size", type=int, default=192)
  parser.add_argument("--learning_rate", type=float, default=1e-3)
  parser.add_argument("--warmup_epochs", type=int, default=2)
  parser.add_argument("--lr_factor", type=float, default=0.11)
  parser.add_argument("--lr_patience", type=int, default=8)
  parser.add_argument("--lr_cooldown", type=int, default=2)
  parser.add_argument("--threads", type=int, default=0, help="torch threads (0: PyTorch's default)")
  parser.add_argument("--bf16", action="store_true", help="mixed bfloat16 (torch.autocast on the CPU)")
  return parser.parse_args()


if __name__ == "__main__":  # before PyTorch's import (seconds): --help and a bad argument answer at once
  _ARGS = parse_args()

import h5py  # noqa: E402  pylint: disable=wrong-import-position
import numpy as np  # noqa: E402  pylint: disable=wrong-import-position
import torch  # noqa: E402  pylint: disable=wrong-import-position
from torch import nn  # noqa: E402  pylint: disable=wrong-import-position

from reference_torch import ReferenceModel  # noqa: E402  pylint: disable=wrong-import-position


def load_split(path: str, split: str):
  with h5py.File(path, "r") as f:
    frames = torch.from_numpy(np.asarray(f[split + "_frames"], np.float32))
    targets = torch.from_numpy(np.asarray(f[split + "_unitStar_par"], np.float32))
  return frames, targets


def train_epoch(net, optimizer, loss_fn, frames, targets, args, generator) -> float:
  net.train()
  order = torch.randperm(len(frames), generator=generator)
  batches = len(frames) // args.batch_size
  total = 0.0
  for b in range(batches):
    rows = order[b * args.batch_size:(b + 1) * args.batch_size]
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
      loss = loss_fn(net(frames[rows]).float(), targets[rows])
    loss.backward()
    optimizer.step()
    total += loss.item()
  return total / batches


def validate(net, loss_fn, frames, targets, args) -> float:
  net.eval()
  total = 0.0
  with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
    for start in range(0, len(frames), args.batch_size):
      rows = slice(start, start + args.batch_size)
      total += loss_fn(net(frames[rows]).float(), targets[rows]).item() * len(frames[rows])
  return total / len(frames)


def main(args):
  if args.threads:
    torch.set_num_threads(args.threads)
  torch.manual_seed(args.seed)
  train_x, train_y = load_split(args.data_path, "train")
  val_x, val_y = load_split(args.data_path, "val")
  net = ReferenceModel(DESIGNS[args.design], train_x.shape[1], train_x.shape[2], train_y.shape[1])
  optimizer = torch.optim.Adam(net.parameters(), lr=args.learning_rate)
  plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
      optimizer, mode="min", factor=args.lr_factor, patience=args.lr_patience, cooldown=args.lr_cooldown)
  loss_fn = nn.MSELoss()
  generator = torch.Generator().manual_seed(args.seed)
  history = {"loss": [], "val_loss": [], "lr": [], "epoch_seconds": []}
  for epoch in range(args.epochs):
    if epoch < args.warmup_epochs:
      for group in optimizer.param_groups:
        group["lr"] = args.learning_rate * (epoch + 1) / args.warmup_epochs
    started = time.perf_counter()
    history["lr"].append(optimizer.param_groups[0]["lr"])
    history["loss"].append(train_epoch(net, optimizer, loss_fn, train_x, train_y, args, generator))
    history["val_loss"].append(validate(net, loss_fn, val_x, val_y, args))
    history["epoch_seconds"].append(time.perf_counter() - started)
    if epoch >= args.warmup_epochs:
      plateau.step(history["val_loss"][-1])
  print(json.dumps({"framework": "torch " + torch.__version__, "threads": torch.get_num_threads(),
                    "seed": args.seed, "bf16": args.bf16, "history": history}))


if __name__ == "__main__":
  main(_ARGS)
