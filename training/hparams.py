"""The run's settings for TensorBoard's HParams dashboard.

`tensorboard --logdir` over several runs (a `tools/scan.py` folder, or `logs/neuron_inverter`) then
shows one row per run with its settings beside the metrics the Keras TensorBoard callback and the test
write into the run's `train/`, `validation/` and `test/` folders (epoch_loss, test_loss, ...), to sort,
filter and plot against each other. The settings are written by the HParams plugin's own summary
(`tensorboard.plugins.hparams.api`) into the run folder itself, when training starts.
"""

import os

import tensorflow as tf
from tensorboard.plugins.hparams import api as hp

import model
from host import atomic_files
from run_config import RunConfig

# The settings that tell runs apart (every RunConfig field is in run_config.yaml as well). The run's
# config holds what its backend settled (strategies/select.py config_with_decisions): the backend,
# the precision's name, the replicas of all processes, the pipeline stages placed.
_SETTINGS = ("model", "backend", "precision", "replicas", "batch_size", "gradient_accumulation",
             "pipeline_stages", "epochs", "optimizer", "learning_rate", "lr_schedule", "warmup_epochs",
             "dropout", "seed", "synthetic_data")


def run_hparams(config: RunConfig, global_batch_size: int) -> dict:
  """The dashboard's values for this run: plain bools, numbers and strings."""
  values = {name: getattr(config, name) for name in _SETTINGS}
  values["global_batch_size"] = global_batch_size
  values["data"] = config.data_path or "built-in"
  values.update(model.option_values(config))  # the model's own options (ModelInfo.options)
  return values


def write_hparams(logdir: str, config: RunConfig, global_batch_size: int) -> None:
  """Writes the run's settings into `logdir`, replacing those of an earlier start of the run.

  TensorBoard keeps the first settings it reads in a folder, so a resumed run (with more --epochs)
  removes the earlier event file, the only one in the run folder itself (Keras writes into train/ and
  validation/, the test into test/)."""
  try:
    for path in tf.io.gfile.glob(os.path.join(logdir, "events.out.tfevents.*")):
      tf.io.gfile.remove(path)  # a link is removed, not what it points at
    writer = tf.summary.create_file_writer(logdir)
    with writer.as_default():
      # The run folder's name is the trial: runs with equal settings stay apart (a rerun, a resumed copy).
      hp.hparams(run_hparams(config, global_batch_size),
                 trial_id=os.path.basename(os.path.normpath(config.logdir)))
    writer.close()
  except (OSError, tf.errors.OpError) as error:  # a full disk: TensorFlow names the cause in its message
    if not atomic_files.is_write_error(error):
      raise
    raise atomic_files.write_error(os.path.join(logdir, "events.out.tfevents.*"), error) from None
