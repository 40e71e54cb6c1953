"""`run(config, backend)`: one training job from data to summary.yaml.

Stages: seed -> (resume state) -> data -> model + optimizer in the strategy scope -> fit with callbacks
(LR schedule, throughput, checkpoints, TensorBoard) -> test -> TensorBoard scalars and summary.yaml.
Backend specifics stay behind `backend.strategy`.
"""

import dataclasses
import hashlib
import math
import os
import random
import time

import numpy as np
import tensorflow as tf
from absl import logging

import data
import model
from errors import UserError
from run_config import RunConfig
from strategies.backend import Backend
from training import callbacks as callbacks_lib
from training import checkpoints as checkpoints_lib
from training import interrupt as interrupt_lib
from training import run_folder
from training.lr_schedule import Cosine, LearningRateSchedule
from training.optimizers import create_slots, make_optimizer
from training.summary import write_run_config, write_summary


def set_seeds(seed: int) -> None:
  # tf.keras.utils.set_random_seed only exists from TF 2.7; this is the same on TF 2.6.
  random.seed(seed)
  np.random.seed(seed)
  tf.random.set_seed(seed)


def prepare_logdir(logdir: str) -> None:
  try:
    os.makedirs(logdir, exist_ok=True)
    probe = os.path.join(logdir, ".write_test")
    with open(probe, "w"):
      pass
    os.remove(probe)
  except OSError as error:
    raise UserError("--logdir=%s is not a writable folder (%s)" % (logdir, error.strerror)) from None


def build_and_compile(config: RunConfig, backend: Backend, model_module, splits,
                      checkpoint_format=None) -> tf.keras.Model:
  """Creates the model and its optimizer state inside the strategy scope, as tf.distribute requires.
  A resumed run passes the optimizer family of its checkpoint as `checkpoint_format`.

  The backend prepares the model between building and compiling: pipeline stages and on-device
  gradient accumulation on IPUs, the accumulating train step on CPU/GPU.
  """
  with backend.strategy.scope():
    net = model_module.build(config, splits.input_shape, splits.num_outputs,
                             **model.accepted_options(model_module.build, **backend.model_options()))
    net = backend.prepare_model(net, getattr(model_module, "STAGE_BOUNDARIES", ()))
    optimizer = make_optimizer(config.optimizer, config.learning_rate, backend.optimizer_factories(),
                               checkpoint_format, **backend.optimizer_kwargs())
    eval_steps = [split.steps for split in (splits.validation, splits.test) if split]
    net.compile(optimizer=optimizer, loss=model_module.loss(), metrics=model_module.metrics(),
                **backend.compile_kwargs(splits.train.steps, eval_steps))
    create_slots(net.optimizer, net.trainable_variables)
  return net


def write_test_scalars(logdir: str, results: dict, step: int) -> None:
  """Test metrics go to <logdir>/test beside Keras' train/ and validation/ event files."""
  writer = tf.summary.create_file_writer(os.path.join(logdir, "test"))
  with writer.as_default():
    for name, value in results.items():
      tf.summary.scalar("test_" + name, value, step=step)
  writer.flush()


def _last(history: dict, key: str):
  values = history.get(key)
  return float(values[-1]) if values else None


def _identity(config: RunConfig) -> dict:
  """What a checkpoint must match to be resumed by this run (weights, optimizer slots, schedule)."""
  uses_design = model.get_model_info(config.model).uses_design
  return {"model": config.model, "design": config.design if uses_design else None,
          "optimizer": config.optimizer, "learning_rate": config.learning_rate}


def _batch_layout(global_batch_size: int, backend: Backend) -> dict:
  """What one step of an epoch consumes: a mid-epoch resume skips steps, which must mean the same."""
  return {"global_batch": global_batch_size, "replicas": backend.replicas}


def _resume_state(config: RunConfig, backend: Backend) -> dict:
  if not config.resume:
    return {"epoch": 0}
  state = checkpoints_lib.peek_last_state(config.logdir, _identity(config))
  layout = _batch_layout(backend.effective_batch(config.batch_size), backend)
  saved = state.get("batch_layout")
  if state.get("step") and saved and saved != layout:
    raise UserError("--resume: the run stopped after step %d of epoch %d with a global batch of %d on %d "
                    "replica(s); this run has %d on %d, so the steps to skip would be other samples: resume "
                    "with the same --batch_size, --gradient_accumulation and --replicas"
                    % (state["step"], state["epoch"] + 1, saved["global_batch"], saved["replicas"],
                       layout["global_batch"], layout["replicas"]))
  if state["epoch"] >= config.epochs:
    raise UserError("--resume: the run in %s already finished %d epochs; raise --epochs to train more"
                    % (config.logdir, state["epoch"]))
  return state


def _make_callbacks(config, backend, net, global_batch_size, outdir, flag, steps_per_epoch):
  schedule = LearningRateSchedule(config.learning_rate, config.warmup_epochs, config.lr_factor,
                                   config.lr_patience, config.lr_cooldown)
  checkpoints = checkpoints_lib.RunCheckpoints(outdir, net, _identity(config),
                                               restore_logdir=config.logdir)
  checkpointing = checkpoints_lib.CheckpointCallback(checkpoints, schedule,
                                                     batch_layout=_batch_layout(global_batch_size, backend))
  state = {}
  if config.resume:
    state = checkpoints.restore_last()
    logging.info("Resumed from %s: continuing with epoch %d of %d%s", checkpoints.directory,
                 state["epoch"] + 1, config.epochs,
                 " at step %d of %d" % (state["step"] + 1, steps_per_epoch) if state.get("step") else "")
    schedule.plateau.load(state["schedule"])
    checkpointing.restore_into(state)
  if config.lr_schedule == "cosine":
    schedule.cosine = Cosine(config.epochs, steps_per_epoch, state.get("epoch"), state.get("step", 0))
  throughput = callbacks_lib.ThroughputCallback(global_batch_size, backend.replicas, backend.cache_dir)
  if config.compile_only:
    return [throughput, callbacks_lib.StopAfterFirstStep()], throughput, checkpointing
  resumed = interrupt_lib.ResumedEpochLogs(state.get("step", 0), state.get("partial_logs"))
  # Several processes agree at every batch end whether any of them was signalled (one collective).
  graceful = interrupt_lib.GracefulStop(flag, checkpointing, steps_per_epoch, config.epochs, resumed,
                                        any_process=backend.any_process if backend.world_size > 1 else None)
  # Order matters: each callback may add to the epoch logs that the later ones record; `resumed`
  # completes a resumed epoch's metrics before anything records them, `graceful` acts after the
  # epoch's checkpoint and TensorBoard scalars are written.
  callbacks = [resumed, throughput, schedule, callbacks_lib.EpochLogger(), checkpointing,
               tf.keras.callbacks.TerminateOnNaN(),
               tf.keras.callbacks.TensorBoard(log_dir=outdir, profile_batch=0)]
  if config.profile_dir and backend.kind != "ipu":  # IPU profiles come from POPLAR_ENGINE_OPTIONS
    callbacks.append(tf.keras.callbacks.TensorBoard(log_dir=config.profile_dir, profile_batch=(2, 4),
                                                    write_graph=False))
  callbacks.append(graceful)
  return callbacks, throughput, checkpointing


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


def weights_digest(net: tf.keras.Model) -> str:
  """SHA-256 of all weights: equal digests mean identical models (e.g. across workers)."""
  digest = hashlib.sha256()
  for weight in net.get_weights():
    digest.update(np.ascontiguousarray(weight).tobytes())
  return digest.hexdigest()


def _full_history(epoch_logs: list) -> dict:
  """Per-key lists over every epoch of the run since epoch 1, across resumes (None where missing)."""
  keys = []
  for entry in epoch_logs:
    keys += [key for key in entry if key not in keys]
  return {key: [entry.get(key) for entry in epoch_logs] for key in keys}


def _merge_histories(*histories) -> dict:
  merged = {}
  for history in histories:
    for key, values in history.items():
      merged.setdefault(key, []).extend(values)
  return merged


def _fit(net, config, backend, splits, first_epoch, first_step, callbacks) -> dict:
  """Keras fit from `first_epoch`; a run resumed mid-epoch first trains the rest of that epoch.

  Training and validation input are endless streams with explicit step counts, so Keras keeps one
  iterator of each for the whole fit: nothing is torn down or refilled between epochs, and the
  pipeline keeps reading ahead across the epoch boundary while validation runs. Keras' steps_per_epoch
  applies to every epoch, so the rest of an interrupted epoch is a fit of its own, on that epoch's
  stream without its first `first_step` steps (the order of an epoch depends only on seed, shard and
  epoch); the remaining epochs follow.
  """
  val_x, val_steps = (None, None)
  if splits.validation:
    val_x, val_steps = backend.fit_input(splits.validation.epochs_from(0), splits.validation.steps)
  histories = []
  verbose = 1 if backend.is_chief else 2
  steps = splits.train.steps
  if first_step:
    part_x, part_steps = backend.fit_input(splits.train.epochs_from(first_epoch, first_step),
                                           steps - first_step)
    histories.append(net.fit(part_x, epochs=first_epoch + 1, initial_epoch=first_epoch,
                             steps_per_epoch=part_steps, validation_data=val_x,
                             validation_steps=val_steps, callbacks=callbacks, verbose=verbose).history)
    first_epoch += 1
    if any(not np.isfinite(v) for v in histories[0].get("loss", [])):
      return histories[0]
  if first_epoch < config.epochs or not histories:
    train_x, train_steps = backend.fit_input(splits.train.epochs_from(first_epoch), steps)
    histories.append(net.fit(train_x, epochs=config.epochs, initial_epoch=first_epoch,
                             steps_per_epoch=train_steps, validation_data=val_x,
                             validation_steps=val_steps, callbacks=callbacks, verbose=verbose).history)
  return _merge_histories(*histories)


def _close_writers(callbacks) -> None:
  """TensorBoard writers are closed at the end of fit; an interrupted fit has no end."""
  for callback in callbacks:
    if isinstance(callback, tf.keras.callbacks.TensorBoard):
      try:
        callback.on_train_end()
      except Exception as error:  # pylint: disable=broad-except
        logging.warning("Could not close the TensorBoard writers: %s", error)


def _epoch_time_stats(history: dict, key: str = "epoch_seconds"):
  seconds = history.get(key, [])[1:]  # the first epoch carries the compilation
  if not seconds:
    return None
  return [float(np.mean(seconds)), float(np.std(seconds))]


def run(config: RunConfig, backend: Backend) -> dict:
  """Trains and tests `config.model` on `backend`; returns the summary also written to summary.yaml."""
  started = time.perf_counter()
  info = model.get_model_info(config.model)
  outdir = backend.output_dir(config.logdir)
  prepare_logdir(outdir)
  if outdir != config.logdir:
    logging.info("Process %d writes its events and checkpoints to %s (the chief writes %s)",
                 backend.rank, outdir, config.logdir)
  try:
    return _train_and_test(config, backend, info, outdir, started)
  finally:
    run_folder.release(config.logdir)


def _train_and_test(config: RunConfig, backend: Backend, info, outdir: str, started: float) -> dict:
  set_seeds(config.seed)
  print("%s, running on %s" % (info.title, backend.label), flush=True)
  resume_state = _resume_state(config, backend)

  global_batch_size = backend.effective_batch(config.batch_size)
  splits = data.load(info.dataset, config, backend.layout(config.batch_size), resume_state["epoch"])
  net = build_and_compile(config, backend, model.get_model_module(config.model), splits,
                          resume_state.get("optimizer_format"))
  net.summary()
  logging.info("Global batch %d = %d per replica x %d gradient accumulation x %d replicas; "
               "%d optimizer steps per epoch", global_batch_size, config.batch_size,
               backend.gradient_accumulation, backend.replicas,
               splits.train.samples // global_batch_size)

  # SIGTERM/SIGINT during training: checkpoint at the next safe point, then exit 128 + signal number.
  flag = interrupt_lib.InterruptFlag()
  callbacks, throughput, checkpointing = _make_callbacks(config, backend, net, global_batch_size, outdir,
                                                         flag, splits.train.steps)
  # Only now, with the flags, data and any checkpoint to resume found good: a bad command leaves the
  # outputs of the run already in the logdir untouched. The writer locks the folder first.
  if outdir == config.logdir:
    run_folder.claim(config.logdir, config.resume)
  write_run_config(outdir, dataclasses.replace(config, precision=backend.precision))
  print("\nTraining", flush=True)
  interrupted = None
  with flag:
    fit_started = time.perf_counter()
    try:
      history = _fit(net, config, backend, splits, resume_state["epoch"], resume_state.get("step", 0),
                     callbacks)
    except interrupt_lib.TrainingInterrupted as stop:
      interrupted = stop.with_traceback(None)  # frees fit's frames (and its data iterators) below
    if interrupted is not None:
      # Still inside `with flag`: a further signal is only noted while the run winds down, and the
      # flag ignores signals (instead of restoring the default action) once this raise leaves it.
      _close_writers(callbacks)
      interrupt_lib.log_interrupted(interrupted, config.logdir)
      raise interrupted
  # Training alone, from the first step to the return of the last fit (its input torn down): beside
  # the epochs' own wall times it shows any wait that no epoch accounts for.
  fit_seconds = time.perf_counter() - fit_started
  if config.compile_only:
    logging.info("--compile_only: compiled in %.1f s; exiting before training",
                 throughput.compile_seconds or 0.0)
    return {"compile_seconds": throughput.compile_seconds}
  if any(not np.isfinite(v) for v in history.get("loss", [])):
    kept = checkpointing.last_saved or checkpointing.checkpoints.latest() or "none"
    raise UserError("training stopped: the loss became NaN/Inf in epoch %d (lower --learning_rate); "
                    "last good checkpoint: %s" % (len(history["loss"]) + resume_state["epoch"], kept))

  test_results, test_epoch = {}, None
  if splits.test:
    test_epoch = _use_best_weights(checkpointing, len(history.get("loss", [])) + resume_state["epoch"])
    print("\nEvaluation", flush=True)
    test_x, test_steps = backend.fit_input(splits.test.dataset, splits.test.steps)
    test_results = net.evaluate(test_x, steps=test_steps, return_dict=True, verbose=1)
    write_test_scalars(outdir, test_results, step=config.epochs)

  summary = {
      "model": config.model,
      "backend": backend.kind,
      "replicas": backend.replicas,
      "global_batch_size": global_batch_size,
      "per_replica_batch_size": config.batch_size,
      "gradient_accumulation": backend.gradient_accumulation,
      "precision": backend.precision,
      "epochs": config.epochs,
      "first_epoch": resume_state["epoch"] + 1,
      "steps_per_epoch": splits.train.steps,
      "train_samples_per_epoch": splits.train.samples,
      "train_loss": _last(history, "loss"),
      "val_loss": _last(history, "val_loss"),
      "test_loss": float(test_results["loss"]) if "loss" in test_results else None,
      "test_weights_epoch": test_epoch,
      "samples_per_sec_per_replica": throughput.samples_per_sec_per_replica,
      "compile_seconds": throughput.compile_seconds,
      "executable_from_cache": throughput.from_cache,
      "wall_seconds": time.perf_counter() - started,
      "seconds_per_epoch": _epoch_time_stats(history),
      "wall_seconds_per_epoch": _epoch_time_stats(history, "epoch_wall_seconds"),
      "fit_seconds": fit_seconds,
      "best_val_loss": None if math.isinf(checkpointing.best_val_loss) else checkpointing.best_val_loss,
      "best_val_epoch": checkpointing.best_epoch,
      "final_lr": _last(history, "lr"),
      "data_source": splits.source,
      "devices": list(backend.devices),
      "rank": backend.rank,
      "world_size": backend.world_size,
      "weights_sha256": weights_digest(net),
      "tensorflow_version": tf.__version__,
      "params": config.as_dict(),
      "history": {key: [float(v) for v in values] for key, values in history.items()},
      "full_history": _full_history(checkpointing.epoch_logs),
  }
  summary.update(splits.summary_extras)
  if info.task == "classification":
    summary["train_accuracy"] = _last(history, "accuracy")
    summary["test_accuracy"] = float(test_results["accuracy"]) if "accuracy" in test_results else None
  path = write_summary(outdir, summary)
  logging.info("Wrote %s", path)
  return summary
