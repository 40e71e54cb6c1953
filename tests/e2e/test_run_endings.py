"""How a run ends when a signal comes after its training steps, and how `--resume` finishes it.

In-process runs of training/loop.py (dev design, 8 steps per epoch) signalled at chosen points: the
last epoch's end, the test evaluation, the writing of summary.yaml; a run stopped mid-epoch and resumed
with shorter epochs; a run that failed before its first checkpoint, started again in its folder. One
real process is signalled after its closing report. The signal flag's own tests are in
tests/test_interrupt.py, mid-training stops through real processes in tests/e2e/test_loop_faults.py.
"""

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
import tensorflow as tf
from absl import logging

from errors import UserError
from run_config import RunConfig
from tests.support.cellspike_files import write_cellspike
from tests.support.helpers import REPO_ROOT, assert_names, line_naming, train_in_process, work_in
from tests.support.training_parts import with_first_callback
from training import loop
from training import summary as summary_lib


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
  return write_cellspike(str(tmp_path_factory.mktemp("data") / "endings.h5"),
                         sizes={"train": 128, "val": 32, "test": 32})


@pytest.fixture(autouse=True)
def signal_handlers():
  """A stop leaves SIGTERM and SIGINT ignored for the exit it expects; pytest carries on instead."""
  saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
  yield
  for signum, handler in saved.items():
    signal.signal(signum, handler)


def _config(data_file, logdir, **changes):
  return dataclasses.replace(
      RunConfig(model="neuron_inverter", model_options={"design": "dev"}, backend="cpu", batch_size=8, learning_rate=1e-3,
                optimizer="adam", data_path=data_file, logdir=logdir, epochs=2, warmup_epochs=1,
                steps_per_epoch=8, eval_steps=2, dropout=0.0, seed=5),
      **changes)


def _run(config):
  return train_in_process(config)


class _SignalAt(tf.keras.callbacks.Callback):
  """Sends this process SIGTERM at the end of training batch `batch` of epoch `epoch` (0-based), or at
  that epoch's end (batch None), as a time limit would."""

  def __init__(self, epoch, batch=None):
    super().__init__()
    self.epoch, self.batch, self._current = epoch, batch, None

  def on_epoch_begin(self, epoch, logs=None):
    self._current = epoch

  def on_train_batch_end(self, batch, logs=None):
    if self._current == self.epoch and batch == self.batch:
      os.kill(os.getpid(), signal.SIGTERM)

  def on_epoch_end(self, epoch, logs=None):
    if epoch == self.epoch and self.batch is None:
      os.kill(os.getpid(), signal.SIGTERM)  # first: the epoch's checkpoint is written after it


class _SignalAtTrainEnd(tf.keras.callbacks.Callback):
  """SIGTERM after the last epoch's end, before the fit returns (the stop flag's check is behind)."""

  def on_train_end(self, logs=None):
    os.kill(os.getpid(), signal.SIGTERM)


class _SignalAtTestBatch(tf.keras.callbacks.Callback):
  def __init__(self, batch):
    super().__init__()
    self.batch = batch

  def on_test_batch_end(self, batch, logs=None):
    if batch == self.batch:
      os.kill(os.getpid(), signal.SIGTERM)


def _signalled_at(monkeypatch, epoch, batch=None, callback=None):
  with_first_callback(monkeypatch, callback or _SignalAt(epoch, batch))


def _signal_before(monkeypatch, owner, name):
  """SIGTERM just before `owner.name` runs."""
  original = getattr(owner, name)

  def signalled(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    return original(*args, **kwargs)
  monkeypatch.setattr(owner, name, signalled)


def test_a_signal_at_the_last_epochs_end_stops_before_the_test_and_resume_only_tests(
    tmp_path, data_file, monkeypatch, caplog):
  reference = _run(_config(data_file, str(tmp_path / "reference")))
  logdir = str(tmp_path / "run")
  with monkeypatch.context() as patch:
    _signalled_at(patch, epoch=1)
    with pytest.raises(SystemExit) as stop:
      _run(_config(data_file, logdir))
  assert stop.value.code == 143
  assert_names(stop.value.where, "end of epoch 2", "the last", "before the test")
  assert stop.value.checkpoint == os.path.join(logdir, "checkpoints", "last", "ckpt-2")
  assert not os.path.exists(os.path.join(logdir, "summary.yaml"))
  with pytest.raises(UserError) as refused:
    _run(_config(data_file, logdir, resume=True, epochs=1))
  assert_names(refused.value, logdir, "trained its 2 epochs", "before its test", "--epochs=2")
  with pytest.raises(UserError, match="^--compile_only: ") as refused:
    _run(_config(data_file, logdir, resume=True, compile_only=True))
  assert_names(refused.value, logdir, "its 2 epochs", "nothing to compile")
  caplog.clear()

  with caplog.at_level("INFO", logger="absl"):
    summary = _run(_config(data_file, logdir, resume=True))
  assert_names(line_naming(caplog.text, "training finished"), "(epoch 2 of 2)", "test evaluation is left")
  assert "Epoch 1/" not in caplog.text and "Epoch 2/" not in caplog.text
  assert summary_lib.read_summary(logdir)["test_loss"] == summary["test_loss"]
  # The same weights tested as by the uninterrupted run, and its last epoch's losses reported.
  assert summary["test_loss"] == pytest.approx(reference["test_loss"], rel=1e-5)
  assert summary["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)
  assert summary["train_loss"] == pytest.approx(reference["train_loss"], rel=1e-5)
  assert summary["best_val_epoch"] == reference["best_val_epoch"]
  assert summary["first_epoch"] is None and summary["history"]["epoch"] == [1, 2]

  with pytest.raises(UserError) as refused:
    _run(_config(data_file, logdir, resume=True))
  assert_names(refused.value, "already finished", "2 epochs and its test", "raise --epochs")


def test_a_signal_during_the_test_stops_it_and_resume_tests_again(tmp_path, data_file, monkeypatch):
  logdir = str(tmp_path / "run")
  with monkeypatch.context() as patch:
    _signal_before(patch, loop, "_evaluate_test")
    with pytest.raises(SystemExit) as stop:
      _run(_config(data_file, logdir))
  assert stop.value.code == 143
  assert_names(stop.value.where, "during the test", "(after batch 1)")
  assert not os.path.exists(os.path.join(logdir, "summary.yaml"))
  assert not os.path.exists(os.path.join(logdir, "test"))  # no test scalars of a partial evaluation
  summary = _run(_config(data_file, logdir, resume=True))
  assert np.isfinite(summary["test_loss"]) and summary["test_samples"] == 16  # --eval_steps=2


def test_a_signal_after_the_last_epoch_says_the_test_stops_and_stops_it(tmp_path, data_file, monkeypatch,
                                                                        capfd):
  with monkeypatch.context() as patch:
    _signalled_at(patch, None, callback=_SignalAtTrainEnd())
    with pytest.raises(SystemExit) as stop:
      _run(_config(data_file, str(tmp_path / "run")))
  assert_names(stop.value.where, "during the test", "(after batch 1)")
  assert_names(line_naming(capfd.readouterr().err, "SIGTERM received: "), "stopping the test")


def test_a_signal_after_the_last_test_batch_stops_as_its_line_said(tmp_path, data_file, monkeypatch):
  """After the last batch's check, the handler's line has said the test stops: so it does."""
  evaluate = loop._evaluate_test  # pylint: disable=protected-access

  def signalled_at_the_last_batch(net, backend, splits, verbose, callbacks=()):
    return evaluate(net, backend, splits, verbose, list(callbacks) + [_SignalAtTestBatch(1)])  # 2 steps
  monkeypatch.setattr(loop, "_evaluate_test", signalled_at_the_last_batch)
  logdir = str(tmp_path / "run")
  with pytest.raises(SystemExit) as stop:
    _run(_config(data_file, logdir))
  assert_names(stop.value.where, "end of the test", "not recorded")
  assert not os.path.exists(os.path.join(logdir, "summary.yaml"))


def _main_config(data_file, logdir, *more):
  from absl import flags as absl_flags  # pylint: disable=import-outside-toplevel
  from absl.testing import flagsaver  # pylint: disable=import-outside-toplevel
  import flags  # pylint: disable=import-outside-toplevel
  from errors import parse_flags  # pylint: disable=import-outside-toplevel
  flags.define_flags()  # idempotent
  with flagsaver.flagsaver():
    absl_flags.FLAGS.unparse_flags()
    parse_flags(["main.py", "--model=neuron_inverter", "--design=dev", "--backend=cpu", "--batch_size=8",
                 "--epochs=1", "--steps_per_epoch=8", "--eval_steps=2", "--data_path=" + data_file,
                 "--logdir=" + logdir, "--predict", *more])
    return flags.to_config(absl_flags.FLAGS)


def test_a_signal_before_or_during_the_predict_report_is_resumed_by_making_the_report(
    tmp_path, data_file, monkeypatch, capsys):
  """--predict's report follows the summary: a signal there stops the job as resumable (143), and the
  resume only makes the report (not refused as 'already finished')."""
  import main  # pylint: disable=import-outside-toplevel
  from analysis import evaluation  # pylint: disable=import-outside-toplevel
  logdir = str(tmp_path / "run")
  predict_dir = os.path.join(logdir, "predict")
  with monkeypatch.context() as patch:
    _signal_before(patch, summary_lib, "write_summary")
    with pytest.raises(SystemExit) as stop:
      main.train_and_evaluate(_main_config(data_file, logdir))
  assert stop.value.code == 143
  assert_names(stop.value.where, "before", "--predict report")
  assert summary_lib.read_summary(logdir)["epochs"] == 1 and not os.path.exists(predict_dir)
  assert "Continue with:" in capsys.readouterr().out

  with monkeypatch.context() as patch:  # what reported_on_one_line's handler raises in the report
    patch.setattr(evaluation, "evaluate_run", lambda *args, **kwargs: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
      main.train_and_evaluate(_main_config(data_file, logdir, "--resume"))
  out = capsys.readouterr().out
  assert_names(line_naming(out, "report is not"), "finished (summary.yaml)", "--predict report", "Continue with:")
  assert "--resume --epochs=1" in out

  before = summary_lib.read_summary(logdir)
  summary = main.train_and_evaluate(_main_config(data_file, logdir, "--resume"))
  assert summary == before == summary_lib.read_summary(logdir)  # nothing trained or tested again
  assert os.path.isfile(os.path.join(predict_dir, "sum_pred.yaml"))
  assert "Run finished: %s" % logdir in capsys.readouterr().out


def test_a_signal_while_the_summary_is_written_lets_the_run_finish(tmp_path, data_file, monkeypatch, capfd):
  logdir = str(tmp_path / "run")
  _signal_before(monkeypatch, summary_lib, "write_summary")
  summary = _run(_config(data_file, logdir, epochs=1))
  assert np.isfinite(summary["test_loss"])
  assert summary_lib.read_summary(logdir)["epochs"] == 1
  assert_names(line_naming(capfd.readouterr().err, "SIGTERM received: "), "finished training", "ends normally")


def test_a_mid_epoch_resume_with_shorter_epochs_is_refused_before_writing(tmp_path, data_file, monkeypatch):
  logdir = str(tmp_path / "run")
  with monkeypatch.context() as patch:
    _signalled_at(patch, epoch=0, batch=4)
    with pytest.raises(SystemExit) as stop:
      _run(_config(data_file, logdir))
  assert_names(stop.value.where, "in epoch 1", "after step 5 of 8")
  with open(os.path.join(logdir, "run_config.yaml")) as f:
    before = f.read()
  with pytest.raises(UserError, match="^--resume: ") as refused:
    _run(_config(data_file, logdir, resume=True, steps_per_epoch=4))
  assert_names(refused.value, "after step 5 of epoch 1", "only 4 steps", "(--steps_per_epoch=4)",
               "--steps_per_epoch it ran")
  with open(os.path.join(logdir, "run_config.yaml")) as f:
    assert f.read() == before
  assert _run(_config(data_file, logdir, resume=True))["history"]["epoch"] == [1, 2]


def test_a_resume_with_fewer_epochs_than_the_run_started_with_is_refused(tmp_path, data_file, monkeypatch):
  """Stopped in its last epoch, a run resumed with --epochs lowered to the epochs done would only be
  tested, and the steps it trained in that epoch and its schedule's plan silently dropped."""
  logdir = str(tmp_path / "run")
  with monkeypatch.context() as patch:
    _signalled_at(patch, epoch=1, batch=4)
    with pytest.raises(SystemExit):
      _run(_config(data_file, logdir))
  with pytest.raises(UserError) as refused:
    _run(_config(data_file, logdir, resume=True, epochs=1))
  assert_names(refused.value, logdir, "1 epoch and 5 steps", "of epoch 2", "of the 2 epochs",
               "--epochs=2 (its plan)", "at least 2")


def test_a_run_killed_between_its_first_two_saves_resumes_from_best(tmp_path, data_file, monkeypatch,
                                                                   caplog):
  """Epoch 1 writes checkpoints/best, then links it as checkpoints/last: a kill in between must not leave a
  folder that --resume ('no checkpoint') and a new run ('already holds a run') both refuse."""
  logdir = str(tmp_path / "run")
  with monkeypatch.context() as patch:
    _signalled_at(patch, epoch=0)
    with pytest.raises(SystemExit):
      _run(_config(data_file, logdir))
  shutil.rmtree(os.path.join(logdir, "checkpoints", "last"))
  with caplog.at_level("INFO", logger="absl"):
    summary = _run(_config(data_file, logdir, resume=True))
  assert_names(line_naming(caplog.text, "saves were cut short"), "resuming from",
               os.path.join(logdir, "checkpoints", "best"))
  assert summary["history"]["epoch"] == [1, 2] and np.isfinite(summary["test_loss"])


def test_a_run_that_failed_before_its_first_checkpoint_starts_again_in_its_folder(tmp_path, data_file):
  logdir = str(tmp_path / "run")
  diverging = _config(data_file, logdir, optimizer="sgd", learning_rate=1e5, warmup_epochs=0)
  with pytest.raises(UserError) as failed:
    _run(diverging)
  assert_names(failed.value, "loss became NaN/Inf", "in epoch 1", "checkpoint: none")
  assert os.path.exists(os.path.join(logdir, "run_config.yaml"))
  with pytest.raises(UserError) as refused:
    _run(dataclasses.replace(diverging, learning_rate=1e-3, resume=True))
  assert_names(refused.value, logdir, "its first checkpoint", "without --resume")
  summary = _run(dataclasses.replace(diverging, learning_rate=1e-3))
  assert np.isfinite(summary["test_loss"]) and summary["params"]["learning_rate"] == 1e-3
  with pytest.raises(UserError, match="already holds a run"):  # now it has one to keep
    _run(diverging)


def test_a_signal_after_the_closing_report_keeps_exit_status_0(tmp_path, data_file):
  """Python and TensorFlow take about a second to exit after the last line: a time limit or Ctrl-C
  then must not make a finished run look killed (a requeue script would run it again)."""
  logdir, log_path = str(tmp_path / "run"), str(tmp_path / "run.log")
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  env.pop("TF_USE_LEGACY_KERAS", None)
  with open(log_path, "w") as log:
    process = subprocess.Popen(
        [sys.executable, os.path.join(REPO_ROOT, "main.py"), "--model=neuron_inverter", "--design=dev",
         "--backend=cpu", "--batch_size=8", "--epochs=1", "--steps_per_epoch=4", "--eval_steps=2",
         "--data_path=" + data_file, "--logdir=" + logdir], cwd=REPO_ROOT, env=env, stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True)
    try:
      deadline = time.monotonic() + 120
      while "--resume --epochs=6" not in open(log_path).read():  # the closing report's last line
        assert process.poll() is None and time.monotonic() < deadline, open(log_path).read()[-3000:]
        time.sleep(0.01)
      process.send_signal(signal.SIGTERM)
      status = process.wait(timeout=60)
    finally:
      if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
  output = open(log_path).read()
  assert status == 0, output[-3000:]
  assert "interrupted" not in output.split("Run finished")[-1], output[-3000:]


def test_a_lost_worker_is_named_by_tensorflows_reason_not_its_trace(tmp_path):
  """The chief's one line when its partner was killed mid-training (TensorFlow 2.21's message)."""
  message = ("Graph execution error:\n\nDetected at node CollectiveReduceV2 defined at (most recent call "
             "last):\n  File \"main.py\", line 68, in <module>\n    app.run(main)\n\nrecvmsg:Connection reset "
             "by peer\n\t [[{{node CollectiveReduceV2}}]] [Op:__inference_train_function_2411]")
  error = tf.errors.UnavailableError(None, None, message)
  line = loop._lost_process(error, 2, str(tmp_path))  # pylint: disable=protected-access
  assert_names(line, "2-process run", "cannot be reached", "(recvmsg:Connection", "reset by peer):",
               "launch all 2 again", "no checkpoint yet")
  for trace in ("Graph execution", "CollectiveReduceV2", "main.py", "[Op:", "\n"):  # TensorFlow's reason only
    assert trace not in line, line
  os.makedirs(str(tmp_path / "checkpoints" / "last"))
  (tmp_path / "checkpoints" / "last" / "checkpoint").write_text("")
  again = loop._lost_process(error, 2, str(tmp_path))  # pylint: disable=protected-access
  assert again.endswith(", with --resume") and "launch all 2 again" in again, again
  tf26 = tf.errors.UnavailableError(None, None, "[_Derived_]Collective ops is aborted by: cluster check alive "
                                    "failed, /job:worker/replica:0/task:1 is down")
  line = loop._lost_process(tf26, 2, str(tmp_path))  # pylint: disable=protected-access
  assert_names(line, "(Collective ops", "check alive failed", "/job:worker/replica:0/task:1", "is down)")
  assert "_Derived_" not in line, line


def test_a_run_whose_validation_loss_is_never_finite_fails(tmp_path):
  """Epochs are checkpointed by their validation loss; with it inf in every epoch (validation targets
  1e25 times the training ones) the run fails, rather than report itself finished with no checkpoint."""
  path = write_cellspike(str(tmp_path / "huge_val.h5"), sizes={"train": 128, "val": 32, "test": 32})
  with h5py.File(path, "a") as f:
    f["val_unitStar_par"][...] = f["val_unitStar_par"][...] * 1e25
  logdir = str(tmp_path / "run")
  with pytest.raises(UserError) as failed:
    _run(_config(path, logdir))
  assert_names(failed.value, "validation loss", "NaN/Inf in every epoch", "(last: inf)", "was checkpointed",
               "huge_val.h5")
  assert not os.path.exists(os.path.join(logdir, "summary.yaml"))


def test_runs_started_in_the_same_second_without_a_logdir_each_make_a_folder_of_their_own(
    tmp_path, data_file, monkeypatch, capsys):
  """Without --logdir the folder is logs/<model>/<date-time> (flags.py): of three runs sent to the
  background at once, the two later ones stopped with "--logdir=... is in use by pid ...", a flag that
  their users had not given."""
  import main  # pylint: disable=import-outside-toplevel
  work_in(tmp_path, monkeypatch)
  dated = os.path.join("logs", "neuron_inverter", "20261127-091653")
  config = _config(data_file, dated, epochs=1)
  first = main.train_and_evaluate(config, dated_logdir=True)
  second = main.train_and_evaluate(config, dated_logdir=True)
  assert first["weights_sha256"] == second["weights_sha256"]
  assert sorted(os.listdir(os.path.dirname(dated))) == ["20261127-091653", "20261127-091653-2"]
  assert os.path.isfile(dated + "-2/summary.yaml")
  assert "Run finished: %s-2\n" % dated in capsys.readouterr().out
  with pytest.raises(UserError, match="missing.h5"):   # a run that fails leaves no folder
    main.train_and_evaluate(dataclasses.replace(config, data_path=str(tmp_path / "missing.h5")),
                            dated_logdir=True)
  assert sorted(os.listdir(os.path.dirname(dated))) == ["20261127-091653", "20261127-091653-2"]


def test_the_run_folder_keeps_its_log_and_the_error_that_ended_it(tmp_path, data_file, monkeypatch):
  """A run's lines went to the terminal only: where it is gone (a lost ssh connection) nothing said how
  the run ended. log.txt has each start's command, the log's lines and an error that ended a start; a
  start refused by its checks leaves it as it was (its error is on the terminal only)."""
  logdir = str(tmp_path / "run")
  verbosity = logging.get_verbosity()
  logging.set_verbosity(logging.INFO)  # as main.py's (training/logs.py)
  try:
    _run(_config(data_file, logdir))
    with open(os.path.join(logdir, "log.txt"), "rb") as f:
      finished = f.read()
    with pytest.raises(UserError):
      _run(_config(data_file, logdir, resume=True))  # it finished its 2 epochs: refused
    with open(os.path.join(logdir, "log.txt"), "rb") as f:
      assert f.read() == finished
    def fail(*args):
      raise UserError("the summary could not be written")
    monkeypatch.setattr(summary_lib, "write_summary", fail)
    with pytest.raises(UserError) as error:
      _run(_config(data_file, logdir, resume=True, epochs=3))  # accepted, then failed at its end
  finally:
    logging.set_verbosity(verbosity)
  with open(os.path.join(logdir, "log.txt")) as f:
    lines = f.read().splitlines()
  starts = [index for index, line in enumerate(lines) if line.startswith("# ")]
  assert len(starts) == 2 and starts[0] == 0 and "(pid %d on " % os.getpid() in lines[0], lines
  first, second = lines[:starts[1]], lines[starts[1]:]
  assert any(re.match(r"I\d{4} [\d:]{8} callbacks\.py:\d+\] Epoch 2/2 took ", line) for line in first), first
  assert any("Wrote %s/summary.yaml" % logdir in line for line in first), first
  assert second[-1] == "error: %s" % error.value, second
