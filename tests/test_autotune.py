"""--autotune (training/autotune.py): which forms are timed, how the fastest is chosen and cached, and
the timing loop itself on a real (small) Keras model."""

import dataclasses
import gc
import weakref

import numpy as np
import pytest
import tensorflow as tf
import yaml

from model.neuron_inverter import cpu_forms
from run_config import AUTOTUNE_MIN_STEPS, RunConfig
from strategies import precision as precision_lib
from strategies.backend import Backend, Hardware
from tests.support.helpers import assert_names
from training import autotune
from training.optimizers import create_slots


def _hardware(features=("fma", "avx2"), signature="test cpu"):
  return Hardware("cpu", precision_lib.FLOAT32, frozenset(features), ("AuthenticAMD", 25), signature)


def _alternatives(features=("fma", "avx2"), library=""):
  """The Neuron-Inverter's forms on an AVX2 CPU in float32, as cpu_forms gives them (the compiled op's
  library at `library`), without building the op."""
  hardware = _hardware(features)
  chosen = dict(cpu_forms.cpu_options(hardware), first_block_library=library)
  return cpu_forms.alternatives(hardware, chosen)


def _backend(**fields):
  return Backend("cpu", tf.distribute.get_strategy(), ("/cpu:0",), hardware=_hardware(), **fields)


def test_forms_are_timed_and_described_by_the_options_in_which_they_differ():
  alternatives = _alternatives()
  timed = autotune.labels(alternatives)
  assert [len(label) for label in timed] == [3, 3, 3, 3]  # pooling, phases, kernel gradient
  assert autotune.describe(timed[0]) == "pooling=max_pool, kernel_grad_by_matmul=True, phases_max_in_channels=0"


@pytest.mark.parametrize("features", [{"fma", "avx2"}, {"fma", "avx2", "avx512f"}])
def test_a_compiled_first_block_is_named_in_the_form_without_it_only(features):
  """The form on TensorFlow's ops reads as the built-in one but that; the op's path keys nothing."""
  alternatives = _alternatives(features, library="/k/op.so")
  timed = autotune.labels(alternatives)
  assert len(set(timed)) == 5
  assert autotune.describe(timed[-1]) == autotune.describe(timed[0]) + ", first_block_library=none"
  assert not any("first_block_library" in dict(label) for label in timed[:-1])
  key = autotune.cache_key(RunConfig(model="neuron_inverter"), _backend(), SHAPE, alternatives)
  assert "/k/op.so" not in yaml.safe_dump(key)  # the kernel's folder does not key the timings


def test_two_forms_differing_in_one_option_both_name_it():
  assert autotune.labels(({"a": 1, "b": 0}, {"a": 2, "b": 0})) == ((("a", 1),), (("a", 2),))


def _durations(alternatives, *windows_per_form):
  """measure()'s step durations: for each form, one value per round repeated over its window."""
  return {autotune.describe(label): [seconds for seconds in windows for _ in range(autotune.WINDOW_STEPS)]
          for label, windows in zip(autotune.labels(alternatives), windows_per_form)}


def test_choose_keeps_the_builtin_forms_unless_another_is_clearly_faster():
  alternatives = _alternatives()
  other = [0.110, 0.110, 0.110, 0.110]
  slow = [0.130, 0.130, 0.130, 0.130]
  builtin = [0.100, 0.100, 0.100, 0.100]
  close = _durations(alternatives, builtin, other, [0.099] * 4, slow)  # 1 % faster: a shared machine's noise
  assert autotune.choose(alternatives, close) == alternatives[0]
  clear = _durations(alternatives, builtin, other, [0.085] * 4, slow)  # 15 % faster in every round
  assert autotune.choose(alternatives, clear) == alternatives[2]


def test_a_form_faster_only_through_the_builtins_slow_windows_is_not_chosen():
  """A slow stretch of a shared VM over three of the built-in form's four windows puts its median
  step 20 % above another form's, which was still the slower of the two in the round where the
  machine ran at its usual speed: too little evidence to leave the built-in choice."""
  alternatives = _alternatives()
  builtin = [0.180, 0.180, 0.180, 0.130]
  challenger = [0.150, 0.150, 0.150, 0.150]
  other = [0.170] * 4
  durations = _durations(alternatives, builtin, other, challenger, other)
  assert autotune.medians(durations)[autotune.describe(autotune.labels(alternatives)[0])] > 0.150 * (
      1 + autotune.TOLERANCE)
  assert autotune.choose(alternatives, durations) == alternatives[0]


def test_nothing_to_choose_when_off_distributed_over_processes_or_one_form():
  config = RunConfig(model="neuron_inverter", autotune="on")
  backend = _backend()
  forms = _alternatives()
  assert autotune.alternatives_for(config, backend, forms) == forms
  assert autotune.alternatives_for(dataclasses.replace(config, autotune="off"), backend, forms) == ()
  assert autotune.alternatives_for(config, backend, ({},)) == ()  # e.g. the MNIST model
  assert autotune.alternatives_for(config, backend, (forms[0], dict(forms[0]))) == ()  # repeats count once

  class OneOfSeveralProcesses(Backend):
    world_size = 2

  several = OneOfSeveralProcesses(**{field.name: getattr(backend, field.name)
                                     for field in dataclasses.fields(Backend)})
  assert autotune.alternatives_for(config, several, forms) == ()


def test_auto_times_only_runs_long_enough_to_repay_it():
  auto = RunConfig(model="neuron_inverter")
  assert auto.autotune == "auto"
  assert autotune.may_time(auto, AUTOTUNE_MIN_STEPS)
  assert not autotune.may_time(auto, AUTOTUNE_MIN_STEPS - 1)
  assert autotune.may_time(dataclasses.replace(auto, autotune="on"), 1)


SHAPE = {"global_batch": 8, "input_shape": [16, 4], "outputs": 3}


def _stored_choice(tmp_path, backend, chosen_index=1):
  config = RunConfig(model="neuron_inverter", cache_dir=str(tmp_path))
  alternatives = _alternatives()
  key = autotune.cache_key(config, backend, SHAPE, alternatives)
  path = autotune.cache_path(str(tmp_path), key)
  timed = autotune.labels(alternatives)
  seconds = {autotune.describe(label): 0.1 + 0.01 * index for index, label in enumerate(timed)}
  seconds[autotune.describe(timed[chosen_index])] = 0.05
  choice = autotune.Choice(timed[chosen_index], alternatives[chosen_index], "measured", seconds, timed[0], path)
  autotune._write(path, key, choice)  # pylint: disable=protected-access
  return config, key, path


def test_a_cached_choice_is_read_back_for_the_same_key_only(tmp_path):
  backend = _backend()
  config, key, path = _stored_choice(tmp_path, backend)
  alternatives = _alternatives()
  cached = autotune.read_cached(path, key, alternatives)
  assert cached.source == "cached" and cached.options == alternatives[1]
  assert cached.forms == autotune.labels(alternatives)[1]
  assert cached.speedup == pytest.approx(0.1 / 0.05)
  assert_names(autotune.report(cached), "2.00x", "built-in forms")
  # Another machine (or TensorFlow, or batch) has another file; the same file under another key is
  # not trusted.
  other = autotune.cache_key(config, dataclasses.replace(backend, hardware=_hardware(signature="other cpu")),
                             SHAPE, alternatives)
  assert autotune.cache_path(str(tmp_path), other) != path
  assert autotune.read_cached(path, other, alternatives) is None
  # New code of a layer's forms is timed afresh: the key holds a digest of the model package's sources.
  assert key["model_code"] == autotune.model_code_digest()
  changed = dict(key, model_code="0" * 16)
  assert autotune.cache_path(str(tmp_path), changed) != path
  assert autotune.read_cached(path, changed, alternatives) is None
  # So is a choice made by another way of timing (here 2 rounds judged by the median alone).
  earlier = dict(key, timing={"rounds": 2, "window_steps": 4, "tolerance": 0.05})
  assert autotune.cache_path(str(tmp_path), earlier) != path
  assert autotune.read_cached(path, earlier, alternatives) is None
  # tune() returns the cached choice without timing (no build, no batch).
  never = lambda *args: pytest.fail("timed although the choice was cached")  # noqa: E731
  assert autotune.tune(config, backend, alternatives, never, SHAPE, never,
                       AUTOTUNE_MIN_STEPS) == cached


@pytest.mark.parametrize("content", ["key: [unclosed", "just a string", "{}"])
def test_an_unusable_cache_file_is_reported_and_not_trusted(tmp_path, content, caplog):
  backend, alternatives = _backend(), _alternatives()
  _, key, path = _stored_choice(tmp_path, backend)
  with open(path, "w") as stream:
    stream.write(content)
  assert autotune.read_cached(path, key, alternatives) is None
  assert path in caplog.text and "timing the forms again" in caplog.text


def test_a_cached_choice_outside_the_alternatives_is_not_trusted(tmp_path, caplog):
  backend, alternatives = _backend(), _alternatives()
  _, key, path = _stored_choice(tmp_path, backend)
  with open(path) as stream:
    stored = yaml.safe_load(stream)
  stored["chosen"]["pooling"] = "phases"
  with open(path, "w") as stream:
    yaml.safe_dump(stored, stream)
  assert autotune.read_cached(path, key, alternatives) is None
  assert "this backend's forms" in caplog.text


def test_a_short_auto_run_neither_times_nor_guesses_without_a_cache(tmp_path):
  backend, alternatives = _backend(), _alternatives()
  config = RunConfig(model="neuron_inverter", cache_dir=str(tmp_path))
  never = lambda *args: pytest.fail("timed in a run too short for it")  # noqa: E731
  assert autotune.tune(config, backend, alternatives, never, SHAPE, never, 1) is None


def test_measure_trains_each_form_in_alternating_windows(tmp_path):
  """The timing loop on a real Keras model: every form trains its warm-up and windows, the medians
  are positive, and tune() writes what it chose where the next run reads it."""
  backend, alternatives = _backend(), _alternatives()
  built = []

  def build(options):
    model = tf.keras.Sequential([tf.keras.Input((16, 4)), tf.keras.layers.Flatten(),
                                 tf.keras.layers.Dense(3)])
    model.compile("sgd", "mse")
    built.append((options, model))
    return model

  rng = np.random.default_rng(0)
  batch = (rng.standard_normal((8, 16, 4)).astype("float32"), rng.standard_normal((8, 3)).astype("float32"))
  config = RunConfig(model="neuron_inverter", cache_dir=str(tmp_path), autotune="on")
  choice = autotune.tune(config, backend, alternatives, build, SHAPE, lambda: batch, 1)
  assert len(built) == 4 and len({str(options) for options, _ in built}) == 4
  steps = autotune.WARMUP_STEPS + autotune.ROUNDS * autotune.WINDOW_STEPS
  # Every form trained its steps (one step counter where the forms share it, as they do once the
  # optimizer has created it while building).
  counters = {id(model.optimizer.iterations): model.optimizer.iterations for _, model in built}
  assert sum(int(counter) for counter in counters.values()) == 4 * steps
  assert [options for options, _ in built] == list(alternatives)
  assert set(choice.seconds_per_step) == {autotune.describe(label) for label in autotune.labels(alternatives)}
  assert all(seconds > 0 for seconds in choice.seconds_per_step.values())
  assert choice.source == "measured" and choice.options in alternatives
  assert choice.forms == autotune.labels(alternatives)[alternatives.index(choice.options)]
  key = autotune.cache_key(config, backend, SHAPE, alternatives)
  assert autotune.read_cached(choice.path, key, alternatives).forms == choice.forms


def test_the_timed_models_are_freed_before_the_run_builds_its_own(tmp_path):
  """Keras models hold reference cycles, so only the cycle collector frees them. With the automatic
  collector off, the throwaway models must still be gone when tune() returns: their weights, optimizer
  slots and traced functions would otherwise stay beside the real model for the whole run."""
  backend, alternatives = _backend(), _alternatives()
  built = []

  def build(options):
    del options
    model = tf.keras.Sequential([tf.keras.Input((16, 4)), tf.keras.layers.Flatten(),
                                 tf.keras.layers.Dense(3)])
    model.compile("adam", "mse")
    built.append(weakref.ref(model))
    return model

  batch = (np.zeros((8, 16, 4), "float32"), np.zeros((8, 3), "float32"))
  config = RunConfig(model="neuron_inverter", cache_dir=str(tmp_path), autotune="on")
  gc.collect()
  gc.disable()
  try:
    autotune.tune(config, backend, alternatives, build, SHAPE, lambda: batch, 1)
    alive = [ref for ref in built if ref() is not None]
  finally:
    gc.enable()
  assert len(built) == 4 and not alive


def test_the_timed_models_share_one_set_of_variables_across_replicas(tmp_path):
  """Under a 2-replica MirroredStrategy, as the run builds them (weights, BatchNorm statistics and the
  optimizer's slots created inside the strategy's scope): the later forms get the first form's
  variables, so timing four forms holds one model's memory; each form trains them in turn."""
  # As strategies/cpu.py builds it: reduced through one device (collective all-reduce instances can
  # clash between the strategies of one test process).
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                            cross_device_ops=tf.distribute.ReductionToOneDevice())
  backend = dataclasses.replace(_backend(), strategy=strategy, devices=("/cpu:0", "/cpu:1"), replicas=2)
  alternatives = _alternatives()
  built = []

  def build(options):
    del options
    with strategy.scope():
      model = tf.keras.Sequential([tf.keras.Input((16, 4)), tf.keras.layers.Flatten(),
                                   tf.keras.layers.BatchNormalization(), tf.keras.layers.Dense(3)])
      model.compile(tf.keras.optimizers.Adam(), "mse")
      create_slots(model.optimizer, model.trainable_variables)
    built.append(model)
    return model

  rng = np.random.default_rng(0)
  batch = (rng.standard_normal((8, 16, 4)).astype("float32"), rng.standard_normal((8, 3)).astype("float32"))
  durations = autotune.measure(backend, alternatives, build, batch)
  assert len(durations) == 4
  assert all(len(steps) == autotune.ROUNDS * autotune.WINDOW_STEPS and min(steps) > 0
             for steps in durations.values())
  state = [model.variables + model.optimizer.variables() for model in built]
  assert len(state[0]) == 4 + 2 + 1 + 2 * 4  # BN's 4, Dense's 2, Adam's counter, 2 slots per trainable
  for other in state[1:]:
    assert len(other) == len(state[0]) and all(a is b for a, b in zip(state[0], other))
  assert isinstance(built[0].layers[-1].kernel, tf.distribute.DistributedValues)
  # One counter, stepped by every form's warm-up and windows in turn.
  steps = autotune.WARMUP_STEPS + autotune.ROUNDS * autotune.WINDOW_STEPS
  assert int(built[0].optimizer.iterations.numpy()) == 4 * steps
