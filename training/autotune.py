"""`--autotune`: time the model's alternative forms of its layers and train with the fastest.

Some of a model's choices of the forms of its layers for the hardware were measured on some CPUs and
not on others (the model lists the forms worth timing: `model.layer_forms`, e.g.
model/neuron_inverter/cpu_forms.py). Every form computes the same function with the same weights,
so which one is fastest can be measured on the machine itself, as cuDNN's autotuner times a GPU's
convolution algorithms:
- each form builds and compiles the run's model and trains it on the run's first training batch, over
  and over (the input pipeline is not timed); the models share one set of variables;
- after WARMUP_STEPS steps each (tracing, first-step allocations), the forms train in alternating
  windows of WINDOW_STEPS steps, so that all of them see the machine in the same state;
- the form with the shortest median step is kept if its median is more than TOLERANCE below the
  built-in choice's and it was also the faster of the two in every round; else the built-in choice.
  A difference that small is within a shared machine's noise, and a VM's slow second can fall on a
  whole window: on a shared 2-core VM, 2 rounds judged by the median alone left the built-in forms
  in 4 of 24 timings, though they were the fastest over 6 rounds each time; 4 rounds judged this way
  did so in none of 16 (docs/performance.md, "Convolution forms and --autotune");
- the result goes to <cache_dir>/autotune/<key>.yaml, keyed by the machine, TensorFlow, the model, the
  batch layout, the source of the model package (a new form of a layer is timed afresh) and the timing
  rule (TIMING), so later runs on this machine read it instead of timing again.
The throwaway models draw from TensorFlow's random state; the caller re-seeds before building the real
one, so the run's initial weights do not depend on whether timing happened.
"""

import dataclasses
import datetime
import gc
import hashlib
import os
import statistics
import time
from typing import Callable, Optional

import tensorflow as tf
import yaml
from absl import logging

import model
from host import atomic_files
from run_config import AUTOTUNE_MIN_STEPS, RunConfig
from stderr_lines import DroppedLines
from strategies.backend import Backend
from training import logs

WARMUP_STEPS = 2
WINDOW_STEPS = 4
ROUNDS = 4
TOLERANCE = 0.05
# Part of the cache key, so that a choice made by an earlier, noisier way of timing is timed again.
TIMING = {"rounds": ROUNDS, "window_steps": WINDOW_STEPS, "tolerance": TOLERANCE, "faster_in_every_round": True}
FOLDER = "autotune"


@dataclasses.dataclass(frozen=True)
class Choice:
  """The form a run trains with and how it was chosen."""
  forms: tuple                      # the chosen form as timed and cached: (option, value) pairs (labels)
  options: dict                     # the chosen form whole: the model builder's keyword options
  source: str                       # "measured" (this run timed them) or "cached" (an earlier run did)
  seconds_per_step: dict            # describe(label) -> median seconds per step, for each form timed
  builtin: tuple                    # the model's own choice (the first alternative) as timed and cached
  path: Optional[str] = None        # the cache file

  @property
  def speedup(self) -> float:
    """The chosen forms' speed as a multiple of the built-in choice's."""
    return self.seconds_per_step[describe(self.builtin)] / self.seconds_per_step[describe(self.forms)]


def describe(forms) -> str:
  """"pooling=maximum, kernel_grad_by_matmul=True, ..." for (option, value) pairs (`labels`), the pooling
  first and the compiled first block last (an empty value, TensorFlow's ops, as "none")."""
  ordered = sorted(forms, key=lambda pair: (pair[0] != "pooling", pair[0] == "first_block_library", pair[0]))
  return ", ".join("%s=%s" % (name, "none" if value == "" else value) for name, value in ordered)


def labels(alternatives) -> tuple:
  """Each of the `alternatives` (option dicts, the built-in first) as it is timed, described and
  cached: its options in which the alternatives differ, as sorted (option, value) pairs. The options
  they share (the compiled op's path among them) say nothing of the choice; an option that one form
  alone changes from the built-in is named in that form only (it reads as the built-in but that),
  unless no other option names the built-in."""
  builtin = alternatives[0]
  changed = {name: sum(forms.get(name) != builtin.get(name) for forms in alternatives)
             for name in {name for forms in alternatives for name in forms}}
  varying = {name for name, count in changed.items() if count}
  everywhere = {name for name in varying if changed[name] > 1} or varying
  return tuple(tuple(sorted((name, value) for name, value in forms.items()
                            if name in everywhere or (name in varying and value != builtin.get(name))))
               for forms in alternatives)


def _names(alternatives) -> list:
  """describe() of each alternative's label, in order."""
  return [describe(label) for label in labels(alternatives)]


def _distinct(forms) -> tuple:
  """`forms` without repeats, in order."""
  distinct = []
  for options in forms:
    if options not in distinct:
      distinct.append(dict(options))
  return tuple(distinct)


def alternatives_for(config: RunConfig, backend: Backend, forms) -> tuple:
  """The forms this run may choose between (`forms`: model.layer_forms' option dicts, the built-in
  first), or () for the built-in choice: --autotune=off, one process of several (each would time, and
  choose, on its own), or a model with one form on this hardware."""
  if config.autotune == "off":
    return ()
  alternatives = _distinct(forms) if backend.world_size == 1 else ()
  if len(alternatives) > 1:
    return alternatives
  if config.autotune == "on":
    logging.info("--autotune=on: nothing to time (%s)", (
        "the %d processes would each choose on their own" % backend.world_size if backend.world_size > 1
        else "%s has one form of %s's convolutions at precision %s" % (backend.label, config.model,
                                                                     backend.precision)))
  return ()


def may_time(config: RunConfig, total_steps: int) -> bool:
  """Whether this run may spend the timing: --autotune=on, or auto and a run of at least
  AUTOTUNE_MIN_STEPS training steps."""
  return config.autotune == "on" or (config.autotune == "auto" and total_steps >= AUTOTUNE_MIN_STEPS)


def model_code_digest() -> str:
  """A digest of the model package's sources (Python and the C++ kernels): the forms' relative speeds
  change with their code."""
  folder = os.path.dirname(os.path.abspath(model.__file__))
  digest = hashlib.sha256()
  sources = sorted(os.path.relpath(os.path.join(root, name), folder) for root, _, names in os.walk(folder)
                   for name in names if name.endswith((".py", ".cc")))
  for name in sources:
    with open(os.path.join(folder, name), "rb") as source:
      digest.update(name.encode() + b"\0" + source.read())
  return digest.hexdigest()[:16]


def cache_key(config: RunConfig, backend: Backend, batch_shape: dict, alternatives) -> dict:
  """What the timings depend on: the machine, TensorFlow, the network's code and the batches it trains
  on (`batch_shape`: e.g. {"global_batch": 192, "input_shape": [1600, 4], "outputs": 15}), and how
  the choice was timed (TIMING)."""
  return {"machine": backend.hardware.signature, "tensorflow": tf.__version__, "model_code": model_code_digest(),
          "backend": backend.kind, "precision": backend.precision.name, "jit_compile": backend.jit_compile,
          "model": config.model, "model_options": model.option_values(config), "batch": dict(batch_shape),
          "replicas": backend.replicas, "gradient_accumulation": backend.gradient_accumulation,
          "alternatives": [dict(label) for label in labels(alternatives)], "timing": TIMING}


def cache_path(cache_dir: str, key: dict) -> str:
  digest = hashlib.sha256(yaml.safe_dump(key, sort_keys=True).encode()).hexdigest()[:16]
  return os.path.join(cache_dir, FOLDER, digest + ".yaml")


def read_cached(path: str, key: dict, alternatives) -> Optional[Choice]:
  """The choice stored at `path` for `key`, or None (no file yet). A file that cannot be used is
  reported and timed again, never trusted."""
  if not os.path.exists(path):
    return None
  try:
    with open(path) as stream:
      stored = yaml.safe_load(stream)
    if not isinstance(stored, dict) or stored.get("key") != key:
      raise ValueError("it was written for another machine, TensorFlow or model")
    forms = tuple(sorted(stored["chosen"].items()))
    timings = {str(name): float(seconds) for name, seconds in stored["seconds_per_step"].items()}
    timed = labels(alternatives)
    if forms not in timed or describe(timed[0]) not in timings or describe(forms) not in timings:
      raise ValueError("its choice is not one of this backend's forms")
  except (OSError, yaml.YAMLError, ValueError, KeyError, TypeError, AttributeError) as error:
    logging.warning("Ignoring the autotune cache %s (%s); timing the forms again", path, error)
    return None
  return _choice(alternatives, timed.index(forms), "cached", timings, path)


def _choice(alternatives, index: int, source: str, seconds: dict, path: Optional[str]) -> Choice:
  """The Choice of `alternatives[index]`."""
  timed = labels(alternatives)
  return Choice(timed[index], alternatives[index], source, seconds, timed[0], path)


def _write(path: str, key: dict, choice: Choice) -> None:
  """Writes the choice atomically (another run may read the folder at the same time); a cache that
  cannot be written only costs the next run the timing again."""
  content = {"key": key, "chosen": dict(choice.forms), "seconds_per_step": choice.seconds_per_step,
             "measured": datetime.datetime.now().isoformat(timespec="seconds")}
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with atomic_files.replaced(path) as stream:  # never through a link planted in the cache
      yaml.safe_dump(content, stream, sort_keys=False)
  except OSError as error:  # atomic_files' WriteError and LinkError are OSErrors too
    logging.warning("Could not write the autotune cache %s (%s)", path, error)


class _StepTimer(tf.keras.callbacks.Callback):
  """Wall time of each training step (the train function returns once its step has run)."""

  def __init__(self):
    super().__init__()
    self.durations = []
    self._began = 0.0

  def on_train_batch_begin(self, batch, logs=None):
    self._began = time.perf_counter()

  def on_train_batch_end(self, batch, logs=None):
    self.durations.append(time.perf_counter() - self._began)


def medians(durations: dict) -> dict:
  """describe() -> median seconds per step, from measure()'s step durations."""
  return {name: statistics.median(steps) for name, steps in durations.items()}


def _window_medians(steps: list) -> list:
  """The median of each window of WINDOW_STEPS steps in measure()'s durations of one alternative."""
  return [statistics.median(steps[start:start + WINDOW_STEPS])
          for start in range(0, len(steps), WINDOW_STEPS)]


def choose(alternatives, durations: dict) -> dict:
  """The form to train with, given each one's step `durations` (measure()): the one with the shortest
  median step if that is more than TOLERANCE below the built-in alternatives[0]'s and each of its
  windows was faster than the built-in's window of the same round; else the built-in."""
  return alternatives[_chosen_index(alternatives, durations)]


def _chosen_index(alternatives, durations: dict) -> int:
  names, seconds = _names(alternatives), medians(durations)
  fastest = min(range(len(names)), key=lambda index: seconds[names[index]])
  if seconds[names[0]] <= seconds[names[fastest]] * (1 + TOLERANCE):
    return 0
  rounds = zip(_window_medians(durations[names[fastest]]), _window_medians(durations[names[0]]))
  return fastest if all(challenger < incumbent for challenger, incumbent in rounds) else 0


class _SharedVariables:
  """Gives the models built under `creator` one set of variables: the first build creates them, and
  each later build is handed the same ones in the order it asks for them. The forms compute the same
  function with the same variables, and they train one at a time. Four sets (weights, optimizer slots
  and BatchNorm statistics, per replica) would raise the peak of TensorFlow's CPU allocator, which
  keeps its memory for the rest of the process: with four, a first float32 run at 4 x 48 would train
  in 1.33 GB where a later run, which reads the timings, needs 0.78 GB; with one set it trains in
  1.0-1.04 GB (docs/performance.md, "Memory").

  The creator must be the innermost one (entered inside the strategy's scope, which a build's own
  strategy.scope() then re-enters without a creator of its own), so that it sees, and hands out, whole
  distributed variables. A request that does not match the first build's sequence (name, shape,
  dtype, trainable) gets a variable of its own, as without sharing."""

  def __init__(self):
    self._made = []       # (request, variable) of the first build, in order
    self._next = None     # the position in _made of the next request of a later build

  @staticmethod
  def _request(kwargs) -> tuple:
    return (kwargs.get("name"), tf.TensorShape(kwargs.get("shape")), str(kwargs.get("dtype")),
            kwargs.get("trainable"))

  def creator(self, next_creator, **kwargs):
    request = self._request(kwargs)
    if self._next is None:
      variable = next_creator(**kwargs)
      self._made.append((request, variable))
      return variable
    if self._next < len(self._made) and self._made[self._next][0] == request:
      self._next += 1
      return self._made[self._next - 1][1]
    return next_creator(**kwargs)

  def replay(self) -> None:
    """Called after each build: the next build is handed the first build's variables from the start."""
    self._next = 0


def measure(backend: Backend, alternatives, build: Callable[[dict], tf.keras.Model], batch) -> dict:
  """The seconds of each timed training step of each alternative (describe() of its label -> list,
  ROUNDS windows of WINDOW_STEPS in round order), each built by `build(options)` and training on
  `batch` (one element of the run's training dataset) over and over."""
  dataset = tf.data.Dataset.from_tensors(batch).repeat()
  shared, models = _SharedVariables(), []
  with backend.strategy.scope(), tf.variable_creator_scope(shared.creator):
    for options in alternatives:
      models.append(build(options))
      shared.replay()  # the next build gets these variables
  timers = [_StepTimer() for _ in alternatives]

  def train(index, steps):
    x, steps = backend.fit_input(dataset, steps)
    models[index].fit(x, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[timers[index]])

  for index in range(len(alternatives)):
    train(index, WARMUP_STEPS)
  for timer in timers:
    timer.durations.clear()
  for round_index in range(ROUNDS):
    order = range(len(alternatives))
    for index in (order if round_index % 2 == 0 else reversed(order)):
      train(index, WINDOW_STEPS)
  return {name: list(timer.durations) for name, timer in zip(_names(alternatives), timers)}


def tune(config: RunConfig, backend: Backend, alternatives, build: Callable[[dict], tf.keras.Model],
         batch_shape: dict, first_batch: Callable[[], object], total_steps: int) -> Optional[Choice]:
  """The form to train with among `alternatives` (alternatives_for; `build(options)` builds and
  compiles the model of one), reported in the log: from the cache of an earlier run on this machine,
  else timed now on `first_batch()` (one element of the run's training dataset) if a run of
  `total_steps` training steps may spend the timing (`may_time`), else None (the built-in form)."""
  key = cache_key(config, backend, batch_shape, alternatives)
  path = cache_path(config.cache_dir, key) if config.cache_dir else None
  choice = read_cached(path, key, alternatives) if path else None
  if choice is None and may_time(config, total_steps):
    choice = _measured(backend, alternatives, build, first_batch, key, path)
  if choice is None:
    logging.info("--autotune=auto: %d training steps, fewer than %d: the built-in convolution forms "
                 "(%s)", total_steps, AUTOTUNE_MIN_STEPS, _names(alternatives)[0])
  else:
    print(report(choice), flush=True)
  return choice


def _measured(backend, alternatives, build, first_batch, key, path) -> Choice:
  """Times the alternatives now, prints their step times, and stores the choice at `path`."""
  steps = WARMUP_STEPS + ROUNDS * WINDOW_STEPS
  print("Autotune: timing %d forms of the convolutions on this %s, %d steps each (once per machine)"
        % (len(alternatives), backend.label, steps), flush=True)
  started = time.perf_counter()
  # The process's first batch and steps: TensorFlow's one-off lines come now, not in training's first step.
  with DroppedLines(logs.ONE_OFF_NATIVE_LINES), logs.tensorflow_warnings_dropped(logs.RETRACING_WARNING):
    durations = measure(backend, alternatives, build, first_batch())
  # The throwaway models hold reference cycles (layers, optimizers, traced functions), which only the
  # cycle collector frees: collected now, before the run builds its own model.
  gc.collect()
  seconds = medians(durations)
  for index, name in enumerate(_names(alternatives)):
    print("  %s: %.3f s per step%s" % (name, seconds[name], " (built-in)" if index == 0 else ""), flush=True)
  print("  timed in %.0f s" % (time.perf_counter() - started), flush=True)
  choice = _choice(alternatives, _chosen_index(alternatives, durations), "measured", seconds, path)
  if path:
    _write(path, key, choice)
  return choice


def report(choice: Choice) -> str:
  """One line for the log: what the run trains with, how fast against the built-in choice, and where
  the timings are kept."""
  when = "timed on this machine" + ("" if choice.source == "measured" else " by an earlier run")
  where = "; timings in %s" % choice.path if choice.path else ""
  if choice.forms == choice.builtin:
    return ("Autotune: the built-in convolution forms, none of the others %.0f%% faster by the median step "
            "and faster in every round (%s)%s") % (
        100 * TOLERANCE, when, where)
  return "Autotune: training with %s, %.2fx the built-in forms' speed (%s)%s" % (
      describe(choice.forms), choice.speedup, when, where)
