"""Does the CPU training step give the same bits every time? A probe of the rare weight divergence.

    python tools/repeat_step.py [--repeats=8000] [--replicas=4] [--batch_size=48]

Runs the Neuron-Inverter step's forward pass, backward pass and sum over the replicas again and again,
on the same weights and the same batch, as `main.py` places them on this CPU (the backend's replicas and
threads, the model's convolution forms for it, the first block's C++ kernel where it is built), and names every
gradient whose bits differ from the first repeat's (the replicas' sum, and each replica's own): how
many of its elements, and by how much. Nothing is updated, so every repeat computes the same function
of the same numbers; dropout is off.

Why: with tf.distribute's own sum, about one whole `make run` in ten on 2 cores ended with other
weights than the others. With that sum this probe saw two repeats in 25,000 differ, both the same way
(`batch_norm/beta`'s gradient, in the last bits): TensorFlow's `AddN` sums the replicas in another
order when timing lets it take over another input's buffer. The CPU backend sums in a fixed order
(strategies/ordered_reduction.py; docs/performance.md, "The fixed-order gradient sum").
Returning each replica's gradients keeps their buffers held, which hides that cause from this probe;
it stays for any other. A repeat takes about 0.1-0.17 s, so a rare case takes an hour or more to find:
run it alone.
"""

import os
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from errors import parse_flags, report_missing_packages, with_one_line_errors  # noqa: E402  pylint: disable=wrong-import-position
report_missing_packages()  # before the first third-party import: one line where one is missing

from absl import app  # noqa: E402  pylint: disable=wrong-import-position
from absl import flags  # noqa: E402  pylint: disable=wrong-import-position
import numpy as np  # noqa: E402  pylint: disable=wrong-import-position

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_integer("repeats", 2000, "Repeats of the step after the first, each compared with it.",
                       lower_bound=1)
  flags.DEFINE_integer("replicas", 4, "Replicas, as main.py's --replicas.", lower_bound=1)
  flags.DEFINE_integer("batch_size", 48, "Rows per replica, as main.py's --batch_size.", lower_bound=1)
  flags.DEFINE_enum("design", "ontra4", ["ontra4", "dev"], "Neuron-Inverter design.")
  flags.DEFINE_integer("report_every", 500, "A progress line every this many repeats.", lower_bound=1)
  flags.DEFINE_string("save_differing", None, "An .npz file for the first repeat that differs: each "
                      "differing gradient as first and as then (`<name>/first`, `<name>/then`).")
  # Checked before TensorFlow starts: the file is written only when a case turns up, maybe an hour in.
  flags.register_validator("save_differing", lambda path: not path or os.path.isdir(os.path.dirname(
      os.path.abspath(path))), "--save_differing: expected a file name in an existing folder")


def differing(names, first, now) -> list:
  """(name, elements whose bits differ, largest absolute difference among them) of each array of `now`
  that is not bit for bit the same array of `first` (0.0 and -0.0 differ; NaNs of the same bits do not)."""
  found = []
  for name, old, new in zip(names, first, now):
    bits = np.dtype("u%d" % old.dtype.itemsize)
    unequal = old.view(bits) != new.view(bits)
    if unequal.any():
      gap = np.abs(old[unequal].astype(np.float64) - new[unequal].astype(np.float64))
      found.append((name, int(np.count_nonzero(unequal)), float(gap.max())))
  return found


def _layer_form(backend, config) -> dict:
  """The built-in form of the model's layers on this backend's hardware (model.layer_forms), as main.py
  trains with --autotune=off."""
  import model  # pylint: disable=import-outside-toplevel
  return model.layer_forms(model.get_model_module(config.model), backend.hardware)[0]


def _step(backend, config):
  """The step as a tf.function of no arguments, returning the replica-summed gradients, then each
  replica's own, and their names."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import model  # pylint: disable=import-outside-toplevel
  module = model.get_model_module(config.model)
  tf.random.set_seed(config.seed)
  with backend.strategy.scope():
    network, _ = model.build_network(module, config, (1600, 4), 15, _layer_form(backend, config))
  rng = np.random.default_rng(config.seed)
  rows = config.batch_size * config.replicas
  batch = (rng.standard_normal((rows, 1600, 4), dtype=np.float32),
           rng.standard_normal((rows, 15), dtype=np.float32))
  mse = tf.keras.losses.MeanSquaredError(reduction=tf.keras.losses.Reduction.SUM)

  def replica_rows(context):  # replica k's part of the global batch, as tf.distribute splits one
    part = slice(context.replica_id_in_sync_group * config.batch_size,
                 (context.replica_id_in_sync_group + 1) * config.batch_size)
    return tf.constant(batch[0][part]), tf.constant(batch[1][part])

  fixed = backend.strategy.experimental_distribute_values_from_function(replica_rows)

  def replica_step(rows_of_replica):
    frames, targets = rows_of_replica
    with tf.GradientTape() as tape:
      loss = mse(targets, network(frames, training=True)) / rows
    return tape.gradient(loss, network.trainable_variables)

  @tf.function
  def step():
    grads = backend.strategy.run(replica_step, args=(fixed,))
    summed = [backend.strategy.reduce("SUM", grad, axis=None) for grad in grads]
    # Each replica's own gradients too: where only the sum differs, the replicas' reduction did it.
    own = [part for grad in grads for part in backend.strategy.experimental_local_results(grad)]
    return summed + own

  variables = [variable.name for variable in network.trainable_variables]
  names = variables + ["replica %d's %s" % (replica, name) for name in variables
                       for replica in range(config.replicas)]
  return step, names


def _save(path: str, names, first, now, which: set) -> None:
  arrays = {}
  for name, old, new in zip(names, first, now):
    if name in which:
      arrays[name + "/first"], arrays[name + "/then"] = old, new
  np.savez(path, **arrays)
  print("wrote %s" % path, flush=True)


def main(argv):
  del argv
  from run_config import RunConfig  # pylint: disable=import-outside-toplevel
  from strategies import environment, start  # pylint: disable=import-outside-toplevel
  from training import logs  # pylint: disable=import-outside-toplevel
  logs.setup()  # as main.py: the application's INFO lines, not the libraries' (one per reduced gradient)
  config = RunConfig(model="neuron_inverter", model_options={"design": FLAGS.design}, backend="cpu",
                     precision="32.32", replicas=FLAGS.replicas, batch_size=FLAGS.batch_size, dropout=0.0, autotune="off")
  environment.prepare(config)
  config, backend = start.start_backend(config)
  print("forms: %s" % _layer_form(backend, config), flush=True)
  step, names = _step(backend, config)
  first = [grad.numpy() for grad in step()]
  cases, started = 0, time.perf_counter()
  for repeat in range(1, FLAGS.repeats + 1):
    now = [grad.numpy() for grad in step()]
    found = differing(names, first, now)
    if found:
      cases += 1
      print("repeat %d differs: %s" % (repeat, "; ".join(
          "%s in %d elements, by %.3g at most" % case for case in found)), flush=True)
      if FLAGS.save_differing and cases == 1:
        _save(FLAGS.save_differing, names, first, now, {name for name, _, _ in found})
    if repeat % FLAGS.report_every == 0 and repeat < FLAGS.repeats:
      print("%d repeats, %.3f s each, %d differed" % (repeat, (time.perf_counter() - started) / repeat, cases),
            flush=True)
  print("%d repeats of the step (%d replica%s x %d rows, %s): %d differed from the first" % (
      FLAGS.repeats, config.replicas, "" if config.replicas == 1 else "s", config.batch_size, backend.label,
      cases))


if __name__ == "__main__":
  define_flags()
  app.run(with_one_line_errors(main), flags_parser=parse_flags)  # bad flag: `error:` line, exit 2
