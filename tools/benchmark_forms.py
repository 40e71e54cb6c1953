"""A/B of the Neuron-Inverter training step in one process: the plain Keras form against the
application's form, with timed windows alternating so that both see the machine in the same state.

    python tools/benchmark_forms.py [--design=ontra4] [--precision=16.32] [--rounds=8] [--steps=10]
    python tools/benchmark_forms.py --precision=32.32 --variant=kernel_grad_by_matmul=true

- `standard`: the reference's layers as stock Keras builds them (Conv1D -> MaxPooling1D -> ReLU) and
  Keras' default Adam (the TF >= 2.11 class): the application without its fused blocks.
- `application`: what `main.py` trains on this backend: `model.neuron_inverter.conv_layers.PooledConv1D` blocks in
  the built-in form for this CPU (model/neuron_inverter/cpu_forms.py), the fused legacy Adam, optimizer
  slots created before tracing.
- `variant` (with `--variant=OPTION=VALUE,...`, in place of `standard`): the application with some of
  the options of that form changed (`model.neuron_inverter.designs.CONV_OPTION_DEFAULTS` names them), to
  decide an option.

Both train on the same random batch (the input is not measured). Prints the median and 10th
percentile of the step time of each and their ratio. Nothing in the test suite asserts a speed.
"""

import os
import statistics
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from errors import UserError, parse_flags, report_missing_packages, with_one_line_errors  # noqa: E402  pylint: disable=wrong-import-position
report_missing_packages()  # before the first third-party import: one line where one is missing

from absl import app  # noqa: E402  pylint: disable=wrong-import-position
from absl import flags  # noqa: E402  pylint: disable=wrong-import-position
from model.neuron_inverter.designs import CONV_OPTION_DEFAULTS, DESIGNS  # noqa: E402  pylint: disable=wrong-import-position  (plain data)

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_enum("design", "ontra4", ["ontra4", "dev"], "Neuron-Inverter design.")
  flags.DEFINE_enum("precision", "16.32", ["32.32", "16.32"], "--precision of main.py.")
  flags.DEFINE_integer("batch_size", 192, "Batch size.", lower_bound=1)
  flags.DEFINE_integer("rounds", 8, "Alternating rounds (one window of each form per round).", lower_bound=1)
  flags.DEFINE_integer("steps", 10, "Timed steps per window.", lower_bound=1)
  flags.DEFINE_list("variant", [], "OPTION=VALUE model options of a variant of the application to time "
                    "against it instead of the standard form (e.g. pooling=max_pool).")


def _variant_overrides() -> dict:
  """--variant's OPTION=VALUE pairs, each value parsed as the type of that option's default
  (model.neuron_inverter.designs.CONV_OPTION_DEFAULTS: plain data, so a bad pair is refused before TensorFlow starts)."""
  overrides = {}
  for pair in FLAGS.variant:
    name, _, text = pair.partition("=")
    if name not in CONV_OPTION_DEFAULTS:
      raise UserError("--variant: unknown model option %r; options: %s" % (name, ", ".join(CONV_OPTION_DEFAULTS)))
    kind = type(CONV_OPTION_DEFAULTS[name])
    try:
      overrides[name] = text.lower() in ("1", "true", "yes") if kind is bool else kind(text)
    except ValueError:
      raise UserError("--variant: %s=%r is not of type %s" % (name, text, kind.__name__)) from None
  return overrides


def _forms(config, variant):
  """{"standard" or "variant": train_function, "application": train_function} and an iterator over one
  batch; `variant` ({} for none) holds the options that the variant sets over the application's."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import model  # pylint: disable=import-outside-toplevel
  from strategies.select import select_backend  # pylint: disable=import-outside-toplevel
  from training import optimizers  # pylint: disable=import-outside-toplevel
  backend = select_backend(config)
  module = model.get_model_module("neuron_inverter")
  options = model.layer_forms(module, backend.hardware)[0]
  print("application options: %s" % options, flush=True)

  def application(form):
    network, _ = model.build_network(module, config, (1600, 4), 15, form)
    network.compile(optimizers.make_optimizer("adam", config.learning_rate), module.loss())
    optimizers.create_slots(network.optimizer, network.trainable_variables)
    return network

  if variant:
    other_name, other = "variant", application({**options, **variant})
  else:
    other_name, other = "standard", model.build_network(module, config, (1600, 4), 15,
                                                        {"standard_layers": True})[0]
    other.compile(tf.keras.optimizers.Adam(config.learning_rate), module.loss())
  fast = application(options)
  rng = np.random.default_rng(0)
  batch = (rng.standard_normal((config.batch_size, 1600, 4), dtype=np.float32),
           rng.standard_normal((config.batch_size, 15), dtype=np.float32))
  batches = iter(tf.data.Dataset.from_tensors(batch).repeat())
  return {other_name: other.make_train_function(), "application": fast.make_train_function()}, batches


def main(argv):
  del argv
  from run_config import RunConfig  # pylint: disable=import-outside-toplevel
  from strategies import environment, start  # pylint: disable=import-outside-toplevel
  config = RunConfig(model="neuron_inverter", model_options={"design": FLAGS.design}, backend="cpu",
                     precision=FLAGS.precision, batch_size=FLAGS.batch_size,
                     dropout=DESIGNS[FLAGS.design]["dropout"])
  variant = _variant_overrides()  # a bad --variant is its error line before TensorFlow starts
  environment.prepare(config)
  start.import_tensorflow(config)
  steps, batches = _forms(config, variant)
  for step in steps.values():  # tracing and first allocations
    for _ in range(3):
      float(step(batches)["loss"])
  times = {name: [] for name in steps}
  for round_index in range(FLAGS.rounds):
    for name, step in steps.items():
      for _ in range(FLAGS.steps):
        start = time.perf_counter()
        float(step(batches)["loss"])
        times[name].append(time.perf_counter() - start)
    print("round %d/%d: %s" % (round_index + 1, FLAGS.rounds, ", ".join(
        "%s %.1f ms" % (name, 1e3 * statistics.median(t[-FLAGS.steps:])) for name, t in times.items())),
          flush=True)
  for name, samples in times.items():
    ordered = sorted(samples)
    print("%-12s median %.1f ms/step, p10 %.1f ms (%s, %s, batch %d)" % (
        name, 1e3 * statistics.median(samples), 1e3 * ordered[len(ordered) // 10], FLAGS.design,
        FLAGS.precision, FLAGS.batch_size))
  other_name = next(name for name in steps if name != "application")  # as _forms named it
  print("%s / application: %.2fx" % (other_name, statistics.median(times[other_name])
                                     / statistics.median(times["application"])))


if __name__ == "__main__":
  define_flags()
  app.run(with_one_line_errors(main), flags_parser=parse_flags)  # bad flag: `error:` line, exit 2
