"""The benchmark tools run end to end on a small file (their figures are not asserted: no timed tests)."""

import json
import os
import subprocess
import sys

from tests.cellspike_files import write_cellspike
from tests.helpers import REPO_ROOT


def test_benchmark_produces_every_figure(tmp_path):
  data = write_cellspike(str(tmp_path / "d.h5"), sizes={"train": 256, "val": 32, "test": 32})
  out = str(tmp_path / "bench.json")
  subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "benchmark.py"), "--designs=dev",
                  "--batch_size=16", "--windows=1", "--window_steps=2", "--data_path=" + data,
                  "--precisions=32.32",
                  "--skip=compile", "--json=" + out], check=True, capture_output=True, timeout=300)
  results = json.load(open(out))
  train = results["precisions"]["32.32"]["dev"]["train"]
  assert train["samples_per_sec"] > 0 and train["peak_rss_mb"] > 0
  assert train["flops_per_sample_forward"] > 1e6
  assert results["precisions"]["32.32"]["dev"]["inference"]["samples_per_sec"] > 0
  assert {"streaming", "in_memory", "raw_h5py"} <= set(results["input"])


def test_input_benchmark_reports_memory(tmp_path):
  data = write_cellspike(str(tmp_path / "d.h5"), sizes={"train": 256, "val": 32, "test": 32})
  out = str(tmp_path / "input.json")
  subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "benchmark_input.py"),
                  "--data_path=" + data, "--replicas=2", "--batch_size=16", "--json=" + out],
                 check=True, capture_output=True, timeout=300)
  result = json.load(open(out))
  assert result["pipeline"]["samples"] == 256 and result["pipeline"]["peak_rss_mb"] > 0
  assert result["raw_h5py"]["gb_per_sec"] > 0
