"""`tools/serve_tensorboard.py`: a real TensorBoard server on 127.0.0.1, asked over HTTP for the
scalars of real event files, and its log read for TensorFlow's CUDA probe lines."""

import glob
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import tensorflow as tf

from tests.support.helpers import REPO_ROOT, assert_one_line_error

TOOL = os.path.join(REPO_ROOT, "tools", "serve_tensorboard.py")
CUDA_PROBE_LINES = ("failed call to cuInit", "Could not find cuda drivers", "absl::InitializeLog")


def _write_losses(logdir, losses):
  with tf.summary.create_file_writer(os.path.join(logdir, "train")).as_default():
    for step, loss in enumerate(losses):
      tf.summary.scalar("epoch_loss", loss, step=step)


def _lines(stream, into):
  for line in stream:
    into.put(line)
  into.put(None)


def _get_json(url):
  with urllib.request.urlopen(url, timeout=30) as response:
    return json.loads(response.read().decode())


def _signal_state(pid):
  """The kernel's view of a process: its state and its blocked, ignored and caught signal masks."""
  try:
    with open("/proc/%d/status" % pid) as f:
      return " ".join(line.strip() for line in f if line.startswith(("State", "SigBlk", "SigIgn", "SigCgt")))
  except OSError:
    return "(no /proc status)"


def _exit_status_after_ctrl_c(process, lines, log):
  """Ctrl-C to a TensorBoard command; its exit status. A server that ignores SIGINT would never end:
  that is what it inherits from a suite started in the background by a non-interactive shell, unless
  conftest.py gives SIGINT back its default (a hung server would cost a full run). So that is
  checked first; a server still there a minute after Ctrl-C fails with its signal masks and its log."""
  state = _signal_state(process.pid)
  ignored = re.search(r"SigIgn:\s*([0-9a-f]+)", state)
  sigint_ignored = ignored and int(ignored.group(1), 16) >> (signal.SIGINT - 1) & 1
  assert not sigint_ignored, "the server ignores SIGINT: " + state
  process.send_signal(signal.SIGINT)
  try:
    return process.wait(timeout=60)
  except subprocess.TimeoutExpired:
    state = _signal_state(process.pid)
    process.kill()
    pytest.fail("still running 60 s after Ctrl-C (%s); its log:\n%s"
                % (state, "".join(log + list(iter(lines.get, None)))))


def _start(command):
  """Starts a TensorBoard command; returns (process, its address, its log so far, the rest's queue)."""
  process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  lines = queue.Queue()
  threading.Thread(target=_lines, args=(process.stderr, lines), daemon=True).start()
  log, url, deadline = [], None, time.time() + 120
  while url is None and time.time() < deadline:
    try:
      line = lines.get(timeout=1)
    except queue.Empty:
      continue
    if line is None:
      break
    log.append(line)
    match = re.search(r"TensorBoard \S+ at (http://\S+/) ", line)
    url = match.group(1) if match else None
  if url is None:
    process.kill()
    process.wait()
    raise AssertionError("no server address in: %s" % "".join(log))
  return process, url, log, lines


@pytest.fixture
def server(tmp_path):
  logdir = str(tmp_path / "run")
  _write_losses(logdir, [0.5, 0.25, 0.125])
  process, url, log, lines = _start([sys.executable, TOOL, "--logdir", logdir, "--port", "0", "--host",
                                     "127.0.0.1"])
  try:
    yield process, url, log, lines
  finally:
    if process.poll() is None:
      process.kill()
    process.wait()


def test_serves_the_runs_scalars_without_the_cuda_probe_lines(server):
  process, url, log, lines = server
  deadline = time.time() + 60  # TensorBoard reads the event files in the background after it starts
  while "train" not in _get_json(url + "data/runs") and time.time() < deadline:
    time.sleep(0.5)
  scalars = _get_json(url + "data/plugin/scalars/scalars?run=train&tag=epoch_loss")
  assert [(step, value) for _, step, value in scalars] == [(0, 0.5), (1, 0.25), (2, 0.125)]
  assert _exit_status_after_ctrl_c(process, lines, log) == 0  # TensorBoard's own quiet exit
  log += [line for line in iter(lines.get, None)]
  if not glob.glob("/dev/nvidia[0-9]*"):
    noise = [line for line in log if any(pattern in line for pattern in CUDA_PROBE_LINES)]
    assert not noise, "".join(log)
  assert not any("Traceback" in line for line in log), "".join(log)


def test_missing_logdir_is_one_line_error(tmp_path):
  result = subprocess.run([sys.executable, TOOL, "--logdir", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=60)
  assert_one_line_error(result, "--logdir=%s" % (tmp_path / "nope"), "no such folder")


def test_a_bad_tensorboard_flag_is_one_line_without_the_usage(tmp_path):
  result = subprocess.run([sys.executable, TOOL, "--logdir", str(tmp_path), "--port", "abc"],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 2, result.stderr
  assert_one_line_error(result, "tensorboard: error:", "--port", "'abc'")
  assert "usage:" not in result.stderr


def test_the_tunnel_tool_runs_it_and_ctrl_c_ends_it_without_a_traceback(tmp_path):
  """tools/tensorboard_tunnel.py prints the SSH line, then becomes this TensorBoard (exec): a Ctrl-C
  reaches TensorBoard alone, not a waiting parent that would print a KeyboardInterrupt traceback."""
  _write_losses(str(tmp_path), [1.0])
  with socket.socket() as probe:  # a port free now (the tool takes no --port=0)
    probe.bind(("", 0))
    port = probe.getsockname()[1]
  process, url, log, lines = _start([sys.executable, os.path.join(REPO_ROOT, "tools", "tensorboard_tunnel.py"),
                                     "--logdir=%s" % tmp_path, "--port=%d" % port, "--login_host=login.example.org"])
  try:
    assert isinstance(_get_json(url + "data/runs"), list)  # the server answers
    assert _exit_status_after_ctrl_c(process, lines, log) == 0
  finally:
    if process.poll() is None:
      process.kill()
  log += [line for line in iter(lines.get, None)]
  assert "ssh -N -L %d:" % port in process.stdout.read()
  assert not any("Traceback" in line or "KeyboardInterrupt" in line for line in log), "".join(log)
