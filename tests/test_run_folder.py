"""A run folder has one writer at a time, and a new run never replaces an earlier one."""

import os
import time

import pytest

from errors import UserError
from tests.support.helpers import assert_names, hold_lock, line_naming
from training import run_folder


def test_a_second_job_is_refused_with_the_holders_pid_until_the_holder_dies(tmp_path):
  holder = hold_lock(tmp_path)
  try:
    with pytest.raises(UserError, match=r"in use by pid %d on " % holder.pid):
      run_folder.claim(str(tmp_path), resume=False)
  finally:
    holder.kill()
    holder.wait()
  deadline = time.time() + 10
  while True:  # the kernel has released the dead holder's lock
    try:
      run_folder.claim(str(tmp_path), resume=False)
      break
    except UserError:
      assert time.time() < deadline
      time.sleep(0.1)
  run_folder.release(str(tmp_path))


@pytest.mark.parametrize("marker", ["summary.yaml", os.path.join("checkpoints", "last", "checkpoint"),
                                    os.path.join("checkpoints", "best", "checkpoint")])
def test_a_new_run_never_replaces_an_earlier_one(tmp_path, marker):
  (tmp_path / "run_config.yaml").write_text("model: neuron_inverter\n")
  os.makedirs(os.path.dirname(str(tmp_path / marker)), exist_ok=True)
  (tmp_path / marker).write_text("kept")
  with pytest.raises(UserError) as caught:
    run_folder.claim(str(tmp_path), resume=False)
  assert_names(caught.value, "already holds a run", "--resume", "fresh --logdir")
  assert (tmp_path / marker).read_text() == "kept"
  run_folder.claim(str(tmp_path), resume=True)  # continuing it is what --resume is for
  run_folder.release(str(tmp_path))


@pytest.mark.parametrize("leftover", [None, os.path.join("checkpoints", "last", ".saving-ckpt-1.x", "ckpt-1.index"),
                                      os.path.join("checkpoints", "last", "checkpoint.tmp123"),
                                      os.path.join("checkpoints", "last", "ckpt-1.index")])
def test_a_run_that_saved_nothing_is_started_again_not_resumed(tmp_path, leftover, caplog):
  """Killed in its first epoch (or failed there): its run_config.yaml and events, perhaps a checkpoint
  save cut short, and nothing to continue. The same command starts it again; --resume says so."""
  (tmp_path / "run_config.yaml").write_text("model: neuron_inverter\n")
  if leftover:
    os.makedirs(os.path.dirname(str(tmp_path / leftover)), exist_ok=True)
    (tmp_path / leftover).write_text("half written")
  assert run_folder.started_without_saving(str(tmp_path)) and not run_folder.holds_run(str(tmp_path))
  with pytest.raises(UserError, match="--resume: ") as caught:
    run_folder.claim(str(tmp_path), resume=True)
  assert_names(caught.value, tmp_path, "first checkpoint", "without --resume")
  with caplog.at_level("INFO", logger="absl"):
    run_folder.claim(str(tmp_path), resume=False)
  run_folder.release(str(tmp_path))
  assert_names(line_naming(caplog.text, "first checkpoint"), "starting it again")


def test_resume_of_a_folder_without_a_run_is_refused(tmp_path):
  with pytest.raises(UserError, match="--resume: ") as caught:
    run_folder.claim(str(tmp_path), resume=True)
  assert_names(caught.value, tmp_path, "no run to continue")


def test_an_empty_or_new_folder_is_claimed(tmp_path):
  (tmp_path / "checkpoints").mkdir()
  run_folder.claim(str(tmp_path), resume=False)
  run_folder.release(str(tmp_path))


def test_a_dated_folder_taken_by_another_run_gets_the_next_free_name(tmp_path):
  dated = str(tmp_path / "logs" / "mnist" / "20261127-091653")
  assert [run_folder.make_new(dated) for _ in range(3)] == [dated, dated + "-2", dated + "-3"]
  assert run_folder.is_new(dated + "-2") and run_folder.is_new(dated + "-4")
  assert not run_folder.is_new(str(tmp_path / "logs"))
  (tmp_path / "file").write_text("")
  with pytest.raises(UserError) as caught:
    run_folder.make_new(str(tmp_path / "file" / "logs" / "x"))
  assert_names(caught.value, "run folder", "file/logs/x", "without --logdir", "Not a directory", "--logdir=<")
