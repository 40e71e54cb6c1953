"""`run(config, backend)`: one training job from data to summary.yaml.

`_train_and_test` reads top to bottom in banner-separated stages:
1. data and model: the resume state is checked, the splits loaded, the model built and compiled in
   the strategy scope;
2. checkpoints, resume, callbacks: `--resume` restores weights, optimizer and schedule (`_restore`),
   then the callbacks are made (LR schedule, throughput, checkpoints, TensorBoard, graceful stop) and
   the run folder is claimed;
3. training (`_train`: the fit under the signal flag);
4. test, with the best-validation weights (`_test`);
5. summary.yaml (`training.summary.build_summary`).
Backend specifics stay behind `backend`.
"""

import contextlib
import math
import os
import random
import re
import shutil
import time

import numpy as np
import tensorflow as tf
from absl import logging

import data
import model
from data import pinned_files
from errors import UserError
from run_config import RunConfig
from stderr_lines import DroppedLines
from stop_signals import InterruptFlag
from strategies.backend import Backend
from training import autotune
from training import callbacks as callbacks_lib
from training import checkpoints as checkpoints_lib
from training import interrupt as interrupt_lib
from training import logs
from training import replica_statistics
from training import stopping
from training import run_folder
from training.hparams import write_hparams
from training.lr_schedule import LearningRateSchedule, optimizer_rate, warmup_problem
from training.optimizers import create_slots, make_optimizer
from training import summary as summary_lib
from training.summary import read_run_config, write_run_config


def set_seeds(seed: int) -> None:
  # tf.keras.utils.set_random_seed only exists from TF 2.7; this is the same on TF 2.6.
  random.seed(seed)
  np.random.seed(seed)
  tf.random.set_seed(seed)


def prepare_logdir(logdir: str) -> None:
  run_folder.prepare(logdir)


def build_and_compile(config: RunConfig, backend: Backend, model_module, splits,
                      checkpoint_format=None, form: dict = None) -> tf.keras.Model:
  """Creates the model and its optimizer state inside the strategy scope, as tf.distribute requires.
  A resumed run passes the optimizer family of its checkpoint as `checkpoint_format`; `form` is the
  form of the model's layers (one of model.layer_forms; None: the built-in one for the backend's hardware).

  The backend prepares the model between building and compiling: pipeline stages and on-device
  gradient accumulation on IPUs, the accumulating train step on CPU/GPU.
  """
  if form is None:
    form = model.layer_forms(model_module, backend.hardware)[0]
  with backend.strategy.scope():
    net, boundaries = model.build_network(model_module, config, splits.input_shape, splits.num_outputs, form)
    net = backend.prepare_model(net, boundaries)
    optimizer = make_optimizer(config.optimizer, _learning_rate(config, backend, splits.train.steps),
                               backend.optimizer_factories(), checkpoint_format, weight_decay=config.weight_decay,
                               clip_norm=config.clip_norm, **backend.optimizer_kwargs())
    net.compile(optimizer=optimizer, loss=model_module.loss(), metrics=model_module.metrics(),
                **backend.compile_kwargs(splits.train.steps, splits.evaluation_steps))
    create_slots(net.optimizer, net.trainable_variables)
  return net


def _learning_rate(config: RunConfig, backend: Backend, steps_per_epoch: int):
  """What the optimizer is built with, and the callback logs from: a cosine rate is computed in the
  training step from the update count (training/lr_schedule.py)."""
  return optimizer_rate(config, backend.optimizer_steps(steps_per_epoch))


def chosen_form(config: RunConfig, backend: Backend, module, splits, total_steps: int) -> tuple:
  """(form, chosen_by): the form of the model's layers to train with (model.layer_forms for the
  backend's hardware) and how it was chosen: "built-in", or "measured" or "cached" by --autotune
  (training/autotune.py), for a run of `total_steps` training steps on `splits`."""
  forms = model.layer_forms(module, backend.hardware)
  alternatives = autotune.alternatives_for(config, backend, forms)
  if not alternatives:
    return forms[0], "built-in"
  batch_shape = {"global_batch": backend.effective_batch(config.batch_size),
                 "input_shape": list(splits.input_shape), "outputs": splits.num_outputs}
  choice = autotune.tune(config, backend, alternatives,
                         lambda options: build_and_compile(config, backend, module, splits, form=options),
                         batch_shape, lambda: next(iter(splits.train.dataset.take(1))), total_steps)
  return (forms[0], "built-in") if choice is None else (choice.options, choice.source)


def write_test_scalars(logdir: str, results: dict, step: int) -> None:
  """Test metrics go to <logdir>/test beside Keras' train/ and validation/ event files."""
  writer = tf.summary.create_file_writer(os.path.join(logdir, "test"))
  with writer.as_default():
    for name, value in results.items():
      tf.summary.scalar("test_" + name, value, step=step)
  writer.flush()


def _identity(config: RunConfig) -> dict:
  """What a checkpoint must match to be resumed by this run (weights, optimizer slots, schedule): the
  model, its options that shape the weights (model.identity_options), the optimizer and its rate."""
  return {"model": config.model, **model.identity_options(config), "optimizer": config.optimizer,
          "learning_rate": config.learning_rate}


def _batch_layout(config: RunConfig, backend: Backend) -> dict:
  """What one step of an epoch consumes: a mid-epoch resume skips steps, which must mean the same. A
  step is one optimizer update on CPU/GPU, one micro-batch per replica on IPUs (rows_per_step)."""
  return {"global_batch": backend.effective_batch(config.batch_size), "replicas": backend.replicas,
          "rows_per_step": _layout(config, backend).step_rows}


def _layout(config: RunConfig, backend: Backend):
  """The backend's batch layout for this run's micro-batch and network (model.batch_dependent)."""
  return backend.layout(config.batch_size, model.batch_dependent(config))


def _describe_layout(layout: dict) -> str:
  replicas = layout["replicas"]
  text = "a global batch of %d on %d replica%s" % (layout["global_batch"], replicas, "" if replicas == 1 else "s")
  if layout.get("rows_per_step") not in (None, layout["global_batch"]):
    text += " in steps of %d rows (one micro-batch per replica)" % layout["rows_per_step"]
  return text


def _data_named(data_path, cell_name) -> str:
  if not data_path:
    return "the built-in dataset (no --data_path)"
  return "--data_path=%s%s" % (data_path, " --cell_name=%s" % cell_name if cell_name else "")


def check_same_data(config: RunConfig) -> None:
  """A resume trains on the data its run started with. The checkpoints hold no data identity, so a
  forgotten --data_path would otherwise move the run to the built-in dataset without a word. The
  file's name must match (it may have moved: a staged or copied dataset keeps its name)."""
  saved = read_run_config(config.logdir) or {}
  if "data_path" not in saved:
    return  # a run folder without its configuration (older versions): nothing to compare with
  before, now = saved.get("data_path"), config.data_path
  same_file = (not before and not now) or (
      before and now and os.path.basename(os.path.normpath(before)) == os.path.basename(os.path.normpath(now)))
  if not same_file or (before and saved.get("cell_name") != config.cell_name):
    raise UserError("--resume: the run in %s trained on %s, this run would train on %s: resume with %s"
                    % (config.logdir, _data_named(before, saved.get("cell_name")),
                       _data_named(now, config.cell_name), _data_named(before, saved.get("cell_name"))))


def _resume_state(config: RunConfig, backend: Backend) -> dict:
  if not config.resume:
    return {"epoch": 0}
  state = checkpoints_lib.peek_last_state(config.logdir, _identity(config))
  layout = _batch_layout(config, backend)
  saved = state.get("batch_layout")
  # Checkpoints written before rows_per_step was recorded hold the other two keys.
  if state.get("step") and saved and any(saved[key] != layout[key] for key in saved if key in layout):
    raise UserError("--resume: the run stopped after step %d of epoch %d with %s; this run has %s, so the "
                    "steps to skip would be other samples: resume with the same --batch_size, "
                    "--gradient_accumulation, --replicas and kind of backend"
                    % (state["step"], state["epoch"] + 1, _describe_layout(saved), _describe_layout(layout)))
  left = _what_is_left(config, state)
  if config.compile_only and left != "train":
    raise UserError("--compile_only: the run in %s has trained its %s, so there is nothing to compile: "
                    "resume it without --compile_only" % (config.logdir, _epochs(state["epoch"])))
  return dict(state, left=left)


def _epochs(count: int) -> str:
  return "%d epoch%s" % (count, "" if count == 1 else "s")


def _what_is_left(config: RunConfig, state: dict) -> str:
  """What a resume does: "train" on to --epochs; "test" a run stopped after its last epoch (before or
  during its test), then write its summary; "report": make the --predict report of a finished run (its
  first was stopped). Anything else with --epochs at or below the epochs done is refused."""
  done, step = state["epoch"], state.get("step", 0)
  if done < config.epochs:
    return "train"
  planned = (read_run_config(config.logdir) or {}).get("epochs", done)  # the run's own --epochs
  tested = _tested(config.logdir, state)
  if done == config.epochs == planned and not step:
    if not tested:
      return "test"
    if config.predict:
      return "report"
  where = "the run in %s" % config.logdir
  if step or planned > done:
    trained = _epochs(done) + (" and %d steps of epoch %d" % (step, done + 1) if step else "")
    raise UserError("--resume: %s has trained %s of the %s it was started with: resume with --epochs=%d "
                    "(its plan) or at least %d" % (where, trained, _epochs(planned), planned, done + 1))
  if tested:
    raise UserError("--resume: %s already finished %s and its test; raise --epochs to train more"
                    % (where, _epochs(done)))
  raise UserError("--resume: %s trained its %s and stopped before its test: resume with --epochs=%d to "
                  "test it, or more to train on" % (where, _epochs(done), done))


def _tested(logdir: str, state: dict) -> bool:
  """Whether the run's summary.yaml is that of its last checkpoint's epoch count (a run stopped after
  its last epoch, before its test, has none, or an earlier invocation's with fewer epochs)."""
  try:
    return summary_lib.read_summary(logdir).get("epochs") == state["epoch"]
  except Exception:  # pylint: disable=broad-except  (a damaged summary: the test's rerun replaces it)
    return False


def _check_resumed_step(config: RunConfig, state: dict, steps_per_epoch: int) -> None:
  """A run stopped mid-epoch continues after its steps done; the epochs of this run must be longer."""
  if state.get("step") and state["step"] >= steps_per_epoch:
    why = ("--steps_per_epoch=%d" % config.steps_per_epoch if config.steps_per_epoch
           else "the data's training split")
    raise UserError("--resume: the run stopped after step %d of epoch %d, and this run's epochs have only %d "
                    "steps (%s): resume with the --steps_per_epoch it ran with"
                    % (state["step"], state["epoch"] + 1, steps_per_epoch, why))


def _make_checkpointing(config, backend, net, outdir):
  """The LR schedule and the checkpoint callback (which saves the schedule's state with the weights)."""
  schedule = LearningRateSchedule(config.learning_rate, config.warmup_epochs, config.lr_factor,
                                   config.lr_patience, config.lr_cooldown)
  checkpoints = checkpoints_lib.RunCheckpoints(outdir, net, _identity(config), restore_logdir=config.logdir,
                                               keep_best=config.keep_checkpoints)
  checkpointing = checkpoints_lib.CheckpointCallback(checkpoints, schedule,
                                                     batch_layout=_batch_layout(config, backend))
  return schedule, checkpointing


def _restore(config, schedule, checkpointing, steps_per_epoch) -> dict:
  """--resume: loads the last checkpoint's weights and optimizer state, and the schedule and best-loss
  records; returns its run state ({} for a fresh run)."""
  if not config.resume:
    return {}
  checkpoints = checkpointing.checkpoints
  state = checkpoints.restore_last()
  if state["epoch"] >= config.epochs:
    logging.info("Resumed from %s: training finished (epoch %d of %d); the test evaluation is left",
                 checkpoints.directory, state["epoch"], config.epochs)
  else:
    logging.info("Resumed from %s: continuing with epoch %d of %d%s", checkpoints.directory,
                 state["epoch"] + 1, config.epochs,
                 " at step %d of %d" % (state["step"] + 1, steps_per_epoch) if state.get("step") else "")
  schedule.plateau.load(state["schedule"])
  checkpointing.restore_into(state)
  return state


def _make_callbacks(config, backend, schedule, checkpointing, state, outdir, flag, steps_per_epoch,
                    process_started):
  """The fit's callbacks, in the order they must run; returns them and the throughput callback."""
  if config.lr_schedule == "cosine":  # the optimizer's own rate, the same function of the update count
    schedule.cosine = _learning_rate(config, backend, steps_per_epoch)
  throughput = callbacks_lib.ThroughputCallback(backend.samples_per_step(config.batch_size), backend.replicas,
                                                backend.cache_dir)
  # After `throughput`, whose "Compiling..." line must show while the first step compiles.
  quiet = callbacks_lib.QuietNativeLines(DroppedLines(logs.ONE_OFF_NATIVE_LINES))
  if config.compile_only:
    return [throughput, quiet, callbacks_lib.StopAfterFirstStep()], throughput
  resumed = interrupt_lib.ResumedEpochLogs(state.get("step", 0), state.get("partial_logs"))
  # Several processes agree at every batch end whether any of them was signalled (one collective).
  graceful = interrupt_lib.GracefulStop(flag, checkpointing, steps_per_epoch, config.epochs, resumed,
                                        any_process=_any_process(backend))
  # Order matters: each callback may add to the epoch logs that the later ones record; `resumed`
  # completes a resumed epoch's metrics before anything records them, `graceful` acts after the
  # epoch's checkpoint and TensorBoard scalars are written.
  # The data files unchanged first: a changed file stops the run before anything is saved from it.
  # Then the first step's end: from there a signal waits for the next safe point (training/interrupt.py),
  # also one sent on a line that a later callback logs. history.csv's row before the epoch's checkpoint:
  # a resume drops the row of an epoch whose checkpoint a kill cut short.
  history = [callbacks_lib.HistoryCSV(outdir, state.get("epoch", 0))] if backend.is_chief else []
  callbacks = [pinned_files.keras_callback(), interrupt_lib.FirstStepEnds(flag), resumed, throughput, quiet,
               replica_statistics.ShareBeforeEvaluation(), schedule, *history, checkpointing,
               *_stoppers(config, checkpointing, process_started), tf.keras.callbacks.TerminateOnNaN(),
               callbacks_lib.EpochScalars(log_dir=outdir, profile_batch=0, every_n_steps=config.log_every_n_steps,
                                          steps_per_update=_steps_per_update(backend, steps_per_epoch))]
  if config.profile_dir and backend.profiles_with_tensorflow:
    callbacks.append(tf.keras.callbacks.TensorBoard(log_dir=config.profile_dir, profile_batch=(2, 4),
                                                    write_graph=False))
  # Keras' bar where Keras (tf_keras) puts its own, after the others; the epoch's log line after the bar
  # has ended its line (else it is glued to the bar's last update on a terminal); `graceful` last,
  # so that a stop at an epoch's end logs it first.
  if logs.shows_bar(config.progress, backend.is_chief):
    callbacks.append(callbacks_lib.RunProgbar(config.epochs))
  else:  # the lines inside an epoch that the bar would show (none with --log_every=0)
    callbacks.append(callbacks_lib.ProgressLines(config.epochs, steps_per_epoch, config.log_every,
                                                 backend.samples_per_step(config.batch_size),
                                                 first_step=state.get("step", 0), processes=backend.world_size))
  callbacks += [callbacks_lib.EpochLogger(config.epochs, steps_per_epoch, throughput), graceful]
  return callbacks, throughput


def _steps_per_update(backend, steps_per_epoch: int) -> int:
  """Keras steps per optimizer update: the gradient accumulation count on IPUs (a step is a micro-batch),
  1 elsewhere."""
  return max(steps_per_epoch // max(backend.optimizer_steps(steps_per_epoch), 1), 1)


def _stoppers(config, checkpointing, process_started) -> list:
  """--early_stopping_patience and --target_loss, after the checkpoint callback has ranked the epoch."""
  stoppers = []
  if config.early_stopping_patience:
    stoppers.append(stopping.EarlyStopping(config.early_stopping_patience, checkpointing))
  if config.target_loss is not None:
    stoppers.append(stopping.TargetLoss(config.target_loss, process_started))
  return stoppers


def _use_best_weights(checkpointing, last_epoch: int):
  """Tests the best-validation weights, not the possibly over-fitted last ones; returns their epoch."""
  best = checkpointing.best_epoch
  if best is None or best == last_epoch:
    return last_epoch
  state = checkpointing.checkpoints.restore_best_weights()
  best = state.get("best_epoch", best)  # the checkpoint's own record
  logging.info("Testing the weights of epoch %d (best validation loss %.4f), not of epoch %d",
               best, float(state.get("best_val_loss", checkpointing.best_val_loss)), last_epoch)
  return best


def _merge_histories(*histories) -> dict:
  merged = {}
  for history in histories:
    for key, values in history.items():
      merged.setdefault(key, []).extend(values)
  return merged


def _fit(net, config, backend, splits, first_epoch, first_step, callbacks) -> dict:
  """Keras fit from `first_epoch`; a run resumed mid-epoch first trains the rest of that epoch.

  Training and validation input are endless streams with explicit step counts, so Keras keeps one
  training iterator for the whole fit: nothing is torn down or refilled between epochs, and the
  pipeline keeps reading ahead across the epoch boundary while validation runs. The validation iterator
  is kept too on CPUs and GPUs; IPU Keras makes a new infeed for it at every evaluation (graphcore/keras
  keras/ipu/extensions/data_feed_manager.py), so there each validation starts its stream again, which
  reads the same samples (the split is not shuffled) in the same order. Keras' steps_per_epoch
  applies to every epoch, so the rest of an interrupted epoch is a fit of its own, on that epoch's
  stream without its first `first_step` steps (the order of an epoch depends only on seed, shard and
  epoch); the remaining epochs follow.
  """
  val_x, val_steps = (None, None)
  if splits.validation:
    val_x, val_steps = backend.fit_input(splits.validation.epochs_from(0), splits.validation.steps)
  histories = []
  verbose = logs.fit_verbosity(config.progress, backend.is_chief)
  steps = splits.train.steps
  if first_step:
    part_x, part_steps = backend.fit_input(splits.train.epochs_from(first_epoch, first_step),
                                           steps - first_step)
    with backend.device_errors():
      histories.append(net.fit(part_x, epochs=first_epoch + 1, initial_epoch=first_epoch,
                               steps_per_epoch=part_steps, validation_data=val_x,
                               validation_steps=val_steps, callbacks=callbacks, verbose=verbose).history)
    first_epoch += 1
    if any(not np.isfinite(v) for v in histories[0].get("loss", [])) or stopping.stopped(callbacks):
      return histories[0]
  if first_epoch < config.epochs or not histories:
    train_x, train_steps = backend.fit_input(splits.train.epochs_from(first_epoch), steps)
    with backend.device_errors():
      histories.append(net.fit(train_x, epochs=config.epochs, initial_epoch=first_epoch,
                               steps_per_epoch=train_steps, validation_data=val_x,
                               validation_steps=val_steps, callbacks=callbacks, verbose=verbose).history)
  return _merge_histories(*histories)


def _end_quiet_windows(callbacks) -> None:
  for callback in callbacks:
    if isinstance(callback, callbacks_lib.QuietNativeLines):
      callback.window.stop()


def end_interrupted_fit(callbacks) -> None:
  """What fit's end does for the callbacks, which an interrupted fit never reaches: closes the
  TensorBoard writers, and logs a plateau reduction decided at the epoch's end just before the stop."""
  for callback in callbacks:
    if isinstance(callback, LearningRateSchedule):
      callback.on_train_end()
    elif isinstance(callback, tf.keras.callbacks.TensorBoard):
      try:
        callback.on_train_end()
      except Exception as error:  # pylint: disable=broad-except
        logging.warning("Could not close the TensorBoard writers: %s", error)


def run(config: RunConfig, backend: Backend, process_started: float = None, command_line=None) -> dict:
  """Trains and tests `config.model` on `backend`; returns the summary also written to summary.yaml.
  `process_started`: the process's start on time.monotonic()'s clock (main.py), for the total time and
  the time to a --target_loss; default: now. `command_line`: the arguments as typed (main.py's sys.argv),
  recorded in run_config.yaml beside the settled settings."""
  started = time.perf_counter()
  process_started = time.monotonic() if process_started is None else process_started
  info = model.get_model_info(config.model)
  outdir = backend.output_dir(config.logdir)
  scratch = outdir != config.logdir  # another process's: the chief writes the run's folder
  new_folder = run_folder.is_new(outdir)
  prepare_logdir(outdir)
  # The writer locks the folder and refuses to start over an earlier run before it reads data or
  # builds anything: the first run's data generation alone takes minutes on a slow CPU. The lock file
  # is no output of the run: a command that fails later still leaves an earlier run untouched.
  if scratch:
    logging.info("Process %d writes its events and checkpoints to %s, removed at its end (the chief "
                 "writes %s)", backend.rank, outdir, config.logdir)
  try:
    if not scratch:
      run_folder.claim(config.logdir, config.resume)
    # The writer's folder keeps the log; the other processes' folders are removed at their end.
    logged = contextlib.nullcontext() if scratch else logs.copied_to_file(os.path.join(outdir, logs.LOG_FILE))
    # The data files this run reads, checked at its steps; one that shrinks ends the process at once.
    watched = pinned_files.watched_in_run(before_sudden_exit=lambda: run_folder.release(config.logdir))
    with logged, watched:
      try:
        summary = _train_and_test(config, backend, info, outdir, started, process_started, command_line)
      except tf.errors.UnavailableError as error:
        if backend.world_size == 1:
          raise
        raise UserError(_lost_process(error, backend.world_size, config.logdir)) from None
  except BaseException:
    if new_folder and not scratch:
      run_folder.remove_if_unused(config.logdir)
    raise
  finally:
    run_folder.release(config.logdir)
    if scratch:
      # The other processes save with the chief (saving is collective) but nothing reads their copies,
      # and a resume restores from the chief's: kept, they would fill /tmp run after run.
      shutil.rmtree(outdir, ignore_errors=True)
  if config.compile_only and new_folder and not scratch:
    run_folder.remove_if_unused(config.logdir)  # the executables are in the cache, not here
  if scratch and "weights_sha256" in summary:
    logging.info("Process %d done, its weights' sha256 %s (the chief's summary.yaml: weights_sha256)",
                 backend.rank, summary["weights_sha256"])
  return summary


# TensorFlow's wrapping of a failed op's reason: the op, the Python trace of where it was defined.
_OP_CONTEXT = re.compile(r"^(Graph execution error:|Detected at node |\[\[|\[Op:|The error could be from|"
                         r"Restart your program|The tasks have crashed)")


def _lost_process(error, processes: int, logdir: str) -> str:
  """The one line for a collective that failed because another process of the run is gone (stopped by
  a signal or killed, or its host unreachable): TensorFlow's reason, without the op and its trace."""
  text = re.sub(r"\{\{[^}]*\}\}\s*|\[_Derived_\]", "", error.message)  # op names; TF 2.6's marker
  reason = [line.strip() for line in text.splitlines()
            if line.strip() and not line[:1].isspace() and not _OP_CONTEXT.match(line.strip())]
  saved = os.path.exists(os.path.join(logdir, "checkpoints", checkpoints_lib.LAST, checkpoints_lib.INDEX_FILE))
  return ("another process of this %d-process run stopped or cannot be reached (%s): launch all %d again%s"
          % (processes, " ".join(reason[:2]) or error.message.splitlines()[0], processes,
             ", with --resume" if saved else " (the run has saved no checkpoint yet)"))


def _train_and_test(config: RunConfig, backend: Backend, info, outdir: str, started: float,
                    process_started: float, command_line=None) -> dict:
  set_seeds(config.seed)
  print("%s, running on %s" % (info.title, backend.label), flush=True)

  # --- Data and model (nothing is written before the flags, data and checkpoint are found good) -------
  resume_state = _resume_state(config, backend)
  if resume_state.get("left") == "report":  # main.py makes it
    _accepted(outdir)
    logging.info("The run in %s finished its %s and its test (summary.yaml): --predict makes its report",
                 config.logdir, _epochs(resume_state["epoch"]))
    return summary_lib.read_summary(outdir)
  global_batch_size = backend.effective_batch(config.batch_size)
  splits = data.load(info.dataset, config, _layout(config, backend), resume_state["epoch"])
  if config.resume:  # after the data's own checks, whose errors say more of a file than that it differs
    check_same_data(config)
    _check_resumed_step(config, resume_state, splits.train.steps)
  module = model.get_model_module(config.model)
  form, form_chosen_by = chosen_form(config, backend, module, splits,
                                     splits.train.steps * max(config.epochs - resume_state["epoch"], 0))
  set_seeds(config.seed)  # the initial weights do not depend on whether the forms were timed
  net = build_and_compile(config, backend, module, splits, resume_state.get("optimizer_format"), form)
  _print_model(net, module)
  _log_training_setup(config, backend, global_batch_size, splits.train.steps)

  # --- Checkpoints, resume, callbacks -----------------------------------------------------------------
  schedule, checkpointing = _make_checkpointing(config, backend, net, outdir)
  state = _restore(config, schedule, checkpointing, splits.train.steps)
  if config.init_from and not config.resume:  # the network's weights; the optimizer and schedule start afresh
    init = checkpoints_lib.load_initial_weights(net, config.init_from, _identity(config))
    logging.info("Starting from the network weights of %s (epoch %d, sha256 %s)", init["checkpoint"],
                 init["epoch"], init["weights_sha256"])
    checkpointing.init_from = init  # saved with the run's checkpoints: a resume keeps the record
  init_from = checkpointing.init_from
  # SIGTERM/SIGINT from the end of the first step to the summary: a stop at the next safe point with
  # every checkpoint saved, then exit 128 + signal number; before it, at once (training/interrupt.py).
  flag = InterruptFlag(immediate_until_first_step=True)
  callbacks, throughput = _make_callbacks(config, backend, schedule, checkpointing, state, outdir, flag,
                                          splits.train.steps, process_started)
  # Only now, with the flags, data and any checkpoint to resume found good: a bad command leaves the
  # outputs of the run already in the logdir untouched, its log and lock file too.
  _accepted(outdir)
  # --compile_only trains nothing: no run to continue or evaluate, and so no run marker in the folder
  # (run_folder.RUN_MARKERS), which would refuse the training run that the compilation prepares.
  if not config.compile_only:
    write_run_config(outdir, config, command_line)  # with the backend's decisions (strategies.select.settle)
    write_hparams(outdir, config, global_batch_size)

  with flag:
    # --- Training -------------------------------------------------------------------------------------
    history, fit_seconds = _train(net, config, backend, splits, resume_state, callbacks)
    if config.compile_only:
      _compile_test(net, backend, splits)
      logging.info("--compile_only: compiled in %.1f s; exiting before training",
                   throughput.first_execution_seconds or 0.0)
      return {"compile_seconds": throughput.compile_seconds}
    _check_losses_finite(history, config, checkpointing, splits, resume_state["epoch"])

    # --- Test (the best-validation weights) -----------------------------------------------------------
    flag.phase = "test"
    stop_test = interrupt_lib.StopTestOnSignal(flag, checkpointing.checkpoints.latest(),
                                                any_process=_any_process(backend))
    test_results, test_epoch = _test(net, config, backend, splits, checkpointing, outdir,
                                     len(history.get("loss", [])) + resume_state["epoch"], stop_test)

    # --- summary.yaml ---------------------------------------------------------------------------------
    # Nothing is left to resume: a signal now is noted, and the run ends normally, or before the --predict
    # report (made by main.py after this returns), which a resume then makes.
    flag.phase = "finishing_before_report" if config.predict else "finishing"
    summary = summary_lib.build_summary(
        config, backend, info, splits, history, test_results, test_epoch, throughput, checkpointing,
        global_batch_size=global_batch_size, layer_forms=(form, form_chosen_by),
        first_epoch=resume_state["epoch"] + 1 if history else None,
        wall_seconds=time.perf_counter() - started, fit_seconds=fit_seconds,
        weights_sha256=checkpoints_lib.weights_digest(net), tensorflow_version=tf.__version__,
        keras_policy=tf.keras.mixed_precision.global_policy().name,
        total_seconds=time.monotonic() - process_started,
        stops=stopping.record(callbacks, config.target_loss), init_from=init_from)
    if backend.is_chief:  # the others' folders are scratch (run)
      logging.info("Wrote %s", summary_lib.write_summary(outdir, summary))
    if config.predict:
      interrupt_lib.stop_if_signalled(flag, checkpointing.checkpoints.latest(), "before the --predict report",
                                      config.logdir, _any_process(backend))
  return summary


def _accepted(outdir: str) -> None:
  """The run passed its checks: its log file is written from here (with the lines so far), and its
  lock file is its own (training/run_folder.py). Before, a refused command changes nothing there."""
  logs.start_file_copy()
  run_folder.accepted(outdir)


def _print_model(net, module) -> None:
  """Keras' model summary, and the model module's note on it where it has one (model/__init__.py)."""
  # Both models are chains of layers, which Keras prints in 3 columns, the first 45 % of the line: at
  # its default 65 characters, "batch_norm (BatchNormalization)" wrapped (or, on Keras 2.6, was cut).
  net.summary(line_length=80)
  note = module.summary_note(net) if hasattr(module, "summary_note") else None
  for line in (note or "").splitlines():
    logging.info(line)


def _log_training_setup(config: RunConfig, backend: Backend, global_batch_size: int,
                        steps_per_epoch: int) -> None:
  """The batch layout, and the settings a user may not expect, before the first step."""
  logging.info("Global batch %d = %d per replica x %d gradient accumulation x %d replica%s; "
               "%d optimizer steps per epoch", global_batch_size, config.batch_size,
               backend.gradient_accumulation, backend.replicas, "" if backend.replicas == 1 else "s",
               backend.optimizer_steps(steps_per_epoch))
  problem = warmup_problem(config.warmup_epochs, config.epochs, config.lr_schedule)
  if problem:
    logging.warning(problem)


def _check_losses_finite(history: dict, config: RunConfig, checkpointing, splits,
                         epochs_before: int) -> None:
  """A UserError naming the epoch and the checkpoint kept when training or validation diverged.

  `epochs_before`: the epochs a resumed run had trained before this process (0 for a new run).
  """
  if any(not np.isfinite(v) for v in history.get("loss", [])):
    kept = checkpointing.last_saved or checkpointing.checkpoints.latest()
    kept = checkpoints_lib.in_run_folder(kept, config.logdir) or "none"
    raise UserError("training stopped: the loss became NaN/Inf in epoch %d (lower --learning_rate); "
                    "last good checkpoint: %s" % (len(history["loss"]) + epochs_before, kept))
  if history.get("val_loss") and math.isinf(checkpointing.best_val_loss):
    # Epochs are checkpointed by their validation loss: with none finite, the run kept nothing.
    raise UserError("the validation loss was NaN/Inf in every epoch (last: %s), so no epoch was "
                    "checkpointed: the validation split's values may lie far outside the training "
                    "split's (%s)" % (history["val_loss"][-1], splits.source))


def _any_process(backend: Backend):
  """The collective by which several processes agree on a stop (None for one process)."""
  return backend.any_process if backend.world_size > 1 else None


def _train(net, config, backend, splits, resume_state, callbacks):
  """The fit, under the caller's signal flag (its callbacks read it); returns its history and its
  seconds. A signal ends it with a checkpoint and TrainingInterrupted (training/interrupt.py)."""
  if resume_state["epoch"] >= config.epochs:
    return {}, 0.0  # a run stopped after its last epoch: only its test is left (_restore said so)
  print("\nTraining", flush=True)
  interrupted = None
  fit_started = time.perf_counter()
  try:
    with pinned_files.changes_reported():
      history = _fit(net, config, backend, splits, resume_state["epoch"], resume_state.get("step", 0),
                     callbacks)
  except interrupt_lib.TrainingInterrupted as stop:
    interrupted = stop.with_traceback(None)  # frees fit's frames (and its data iterators) below
  finally:
    _end_quiet_windows(callbacks)  # a fit that raised in its first step shows all of its stderr
  if interrupted is not None:
    # Still inside the caller's `with flag`: a further signal is only noted while the run winds down,
    # and the flag ignores signals (instead of restoring the default action) once this raise leaves it.
    end_interrupted_fit(callbacks)
    interrupt_lib.log_interrupted(interrupted, config.logdir)
    raise interrupted
  # Training alone, from the first step to the return of the last fit (its input torn down): beside
  # the epochs' own wall times it shows any wait that no epoch accounts for.
  return history, time.perf_counter() - fit_started


def _evaluate_test(net, backend, splits, verbose: int, callbacks=()) -> dict:
  """The test split's metrics with `net`'s current weights (the application's one evaluation of it)."""
  test_x, test_steps = backend.fit_input(splits.test.dataset, splits.test.steps)
  replica_statistics.share(net)  # the statistics the checkpoints hold, in every replica
  with DroppedLines(logs.ONE_OFF_NATIVE_LINES), backend.device_errors(), pinned_files.changes_reported():
    return net.evaluate(test_x, steps=test_steps, return_dict=True, verbose=verbose, callbacks=list(callbacks))


def _compile_test(net, backend, splits) -> None:
  """--compile_only: evaluates the test split once too (the fit ran the validation), so that a real run
  finds its executable in the cache: a pipelined IPU model's evaluation embeds its iterations, the
  steps_per_execution truncated to the split's steps, in the graph (keras/ipu/extensions/
  extensions_base.py `_make_ipu_test_function_wrapper`), so a test split of another size than the
  validation split has an executable of its own."""
  if splits.test:
    _evaluate_test(net, backend, splits, verbose=0)


def _test(net, config, backend, splits, checkpointing, outdir, last_epoch, stop_test):
  """Evaluates the test split with the best-validation weights; returns (metrics, their epoch). A
  signal ends it at the next batch (`stop_test`) with TrainingInterrupted; --resume tests again."""
  if not splits.test:
    return {}, None
  test_epoch = _use_best_weights(checkpointing, last_epoch)
  print("\nEvaluation", flush=True)
  try:
    test_results = _evaluate_test(net, backend, splits,
                                  verbose=logs.evaluate_verbosity(config.progress, backend.is_chief),
                                  callbacks=[pinned_files.keras_callback(), stop_test,
                                             callbacks_lib.RunProgbar()])
  except interrupt_lib.TrainingInterrupted as stop:
    stop = stop.with_traceback(None)
    interrupt_lib.log_interrupted(stop, config.logdir)
    raise stop from None
  write_test_scalars(outdir, test_results, step=callbacks_lib.epoch_step(test_epoch or config.epochs))
  return test_results, test_epoch
