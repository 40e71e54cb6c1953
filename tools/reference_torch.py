"""The reference PyTorch Neuron-Inverter, timed the way `tools/benchmark.py` times ours.

    .venv-torch/bin/python tools/reference_torch.py --data_path=FILE.h5 [--design=ontra4]
        [--batch_size=192] [--windows=5] [--window_steps=30] [--threads=0]

A re-implementation, from the layer table in the reference documentation, of the GPU reference model
(`torch/toolbox/Model.py`, class CNNandFC_Model): the (1600, 4) sample is *viewed* as (4, 1600), three
Conv1d -> MaxPool1d -> ReLU blocks, BatchNorm1d on the flattened features, Dense+ReLU+Dropout layers and
a linear output; PyTorch's default initialisation; Adam and MSE as in its trainer. It trains on real
batches of the file, held in memory (so, like our benchmark, the input is not measured), and prints
one JSON line: the median samples/s of the timed windows after a warm-up window, and the parameter
count (2,988,843 for ontra4, the same as our Keras model).

It needs only torch, numpy and h5py (`make bench-reference` builds `.venv-torch`), and takes nothing
from this application but the design table (`model/neuron_inverter/designs.py`, plain data), so TensorFlow is never
imported beside PyTorch.
"""

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from errors import OneLineArgumentParser, existing_file, report_missing_packages  # noqa: E402  pylint: disable=wrong-import-position
report_missing_packages("reference")  # before the first third-party import: one line where one is missing

from model.neuron_inverter.designs import DESIGNS  # noqa: E402  plain data: no TensorFlow comes with it


def parse_args():
  parser = OneLineArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--data_path", type=existing_file, required=True, help="cellSpike .h5 file")
  parser.add_argument("--design", default="ontra4", choices=sorted(DESIGNS))
  parser.add_argument("--batch_size", type=int, default=192)
  parser.add_argument("--windows", type=int, default=5, help="timed windows (the median is reported)")
  parser.add_argument("--window_steps", type=int, default=30, help="training steps per window")
  parser.add_argument("--threads", type=int, default=0, help="torch threads (0: PyTorch's default, "
                      "all cores)")
  parser.add_argument("--learning_rate", type=float, default=1e-3)
  parser.add_argument("--bf16", action="store_true", help="mixed bfloat16: torch.autocast on the CPU "
                      "(the reference's own AMP is CUDA float16, which a CPU does not have)")
  return parser.parse_args()


if __name__ == "__main__":  # before PyTorch's import (seconds): --help and a bad argument answer at once
  _ARGS = parse_args()

import h5py  # noqa: E402  pylint: disable=wrong-import-position
import numpy as np  # noqa: E402  pylint: disable=wrong-import-position
import torch  # noqa: E402  pylint: disable=wrong-import-position
from torch import nn  # noqa: E402  pylint: disable=wrong-import-position


class ReferenceModel(nn.Module):
  """CNN + FC regressor with the reference's layer order and its reshape-not-transpose input."""

  def __init__(self, design: dict, time_bins: int, probes: int, outputs: int):
    super().__init__()
    self.input_view = (probes, time_bins)
    blocks, channels = [], probes
    for filters, kernel, pool in zip(design["conv_filters"], design["conv_kernels"],
                                     design["conv_pools"]):
      blocks += [nn.Conv1d(channels, filters, kernel), nn.MaxPool1d(pool), nn.ReLU()]
      channels = filters
    self.cnn = nn.Sequential(*blocks)
    with torch.no_grad():
      flat = self.cnn(torch.zeros((2,) + self.input_view)).flatten(1).shape[1]
    layers, width = [nn.BatchNorm1d(flat)], flat
    for dim in design["fc_dims"]:
      layers += [nn.Linear(width, dim), nn.ReLU(), nn.Dropout(design["dropout"])]
      width = dim
    layers.append(nn.Linear(width, outputs))
    self.head = nn.Sequential(*layers)

  def forward(self, x):
    x = x.view((-1,) + self.input_view)  # a view (reshape), as in the reference, not a transpose
    return self.head(self.cnn(x).flatten(1))


def load_batches(path: str, batch_size: int, count: int):
  """`count` real training batches of the file as float32 tensors (fp16 files are cast, as there)."""
  with h5py.File(path, "r") as f:
    rows = min(len(f["train_frames"]), batch_size * count) // batch_size * batch_size
    if rows == 0:
      raise SystemExit("error: %s: fewer training samples than one batch of %d" % (path, batch_size))
    frames = torch.from_numpy(np.asarray(f["train_frames"][:rows], np.float32))
    targets = torch.from_numpy(np.asarray(f["train_unitStar_par"][:rows], np.float32))
  return list(zip(frames.split(batch_size), targets.split(batch_size)))


def main(args):
  if args.threads:
    torch.set_num_threads(args.threads)
  torch.manual_seed(0)
  batches = load_batches(args.data_path, args.batch_size, 16)
  time_bins, probes = batches[0][0].shape[1:]
  net = ReferenceModel(DESIGNS[args.design], time_bins, probes, batches[0][1].shape[1])
  optimizer = torch.optim.Adam(net.parameters(), lr=args.learning_rate)
  loss_fn = nn.MSELoss()
  net.train()

  def window():
    start = time.perf_counter()
    for step in range(args.window_steps):
      x, y = batches[step % len(batches)]
      optimizer.zero_grad(set_to_none=True)
      with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
        loss = loss_fn(net(x).float(), y)
      loss.backward()
      optimizer.step()
    return args.window_steps * args.batch_size / (time.perf_counter() - start)

  window()  # warm-up
  rates = [window() for _ in range(args.windows)]
  print(json.dumps({"framework": "torch " + torch.__version__, "design": args.design, "bf16": args.bf16,
                    "batch_size": args.batch_size, "threads": torch.get_num_threads(),
                    "samples_per_sec": statistics.median(rates), "windows": rates,
                    "params": sum(p.numel() for p in net.parameters())}))


if __name__ == "__main__":
  main(_ARGS)
