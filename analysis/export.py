"""Export of a trained model as a self-contained TensorFlow SavedModel, for use without this application.

    import numpy as np, tensorflow as tf
    loaded = tf.saved_model.load("EXPORT_DIR")
    z = loaded.signatures["serving_default"](frames=tf.constant(x, tf.float32))["conductances"]

The exported network is rebuilt outside any strategy with the same layers and the same backend options
(convolution forms, channel padding) as the model it copies, under the precision policy the application
computed with (float32, or mixed 16-bit for `--precision=16.32`), and the trained weights are copied in,
so that it gives the application's predictions exactly. (Standard Keras layers would not: on CPUs with
16-bit units oneDNN fuses a Conv1D's bias into the convolution and rounds once, so their bfloat16 results
differ in the last bits.) The graph is saved, not the Python classes: loading needs none of this code.
Float32 in, float32 out, inference graph (dropout off, BatchNorm moving statistics, or each call's
batch statistics for a run trained with `--batch_norm_statistics=batch`, which export_info.yaml then
notes). The serving signature takes `frames` of shape (batch, time bins, probes) and returns
`conductances` (batch, parameters) in the training targets' units (u*). The parameter names travel
with it as `loaded.par_names()` (and in `export_info.yaml` beside the model). The same folder also
loads with `tf.keras.models.load_model` under Keras 2 (TF <= 2.15, or tf-keras).
"""

import os

import tensorflow as tf
import yaml

import model as model_registry
from host import atomic_files
from run_config import RunConfig

SIGNATURE_INPUT = "frames"
SIGNATURE_OUTPUT = "conductances"


def plain_copy(net: tf.keras.Model, config: RunConfig, input_shape, num_outputs,
               model_options=None) -> tf.keras.Model:
  """The same network rebuilt outside any strategy (and any IPU layer swap), with `net`'s weights.

  It is built with the form `net` was built with (`model_options`, model.layer_forms) but for the model
  module's `SAVED_MODEL_FORM` (options a SavedModel needs: the Neuron-Inverter leaves its compiled op out,
  which would load only beside its library), under the global precision policy in effect, the one `net`
  was built under, so it computes as `net` does.
  """
  module = model_registry.get_model_module(config.model)
  options = dict(model_options or {}, **getattr(module, "SAVED_MODEL_FORM", {}))
  with tf.distribute.get_strategy().scope():  # the default strategy: plain, single-device variables
    plain, _ = model_registry.build_network(module, config, input_shape, num_outputs, options)
  plain.set_weights(net.get_weights())
  return plain


def export_saved_model(net: tf.keras.Model, config: RunConfig, input_shape, num_outputs, export_dir: str,
                       par_names=(), model_options=None) -> str:
  """Writes the SavedModel of `net` (built with `model_options`; float32 in and out) into `export_dir`;
  returns the folder."""
  plain = plain_copy(net, config, input_shape, num_outputs, model_options)

  @tf.function(input_signature=[tf.TensorSpec((None,) + tuple(input_shape), tf.float32,
                                              name=SIGNATURE_INPUT)])
  def serve(frames):
    return {SIGNATURE_OUTPUT: tf.cast(plain(frames, training=False), tf.float32)}

  names = [str(name) for name in par_names]
  plain.par_names = tf.function(lambda: tf.constant(names, dtype=tf.string), input_signature=[])
  try:
    os.makedirs(export_dir, exist_ok=True)
  except OSError as error:
    raise atomic_files.write_error(export_dir, error) from None
  # Saving an uncompiled model, Keras 2 logs a warning that "the compiled metrics have yet to be built"
  # (tf_keras' saving_utils.try_build_compiled_arguments): an inference copy has none to build. Compiled
  # without loss or metrics, it has empty ones; include_optimizer=False keeps the optimizer out of the file.
  plain.compile()
  # Keras' SavedModel writer: tf.saved_model.load needs nothing else, and Keras 2 can load_model it.
  try:
    plain.save(export_dir, save_format="tf", include_optimizer=False, signatures={"serving_default": serve})
  except (OSError, tf.errors.OpError) as error:  # a full disk, a file-size limit: named in the message
    if not atomic_files.is_write_error(error):
      raise
    raise atomic_files.write_error(export_dir, error) from None
  info = {"format": "TensorFlow SavedModel", "signature": "serving_default",
          "input": {"name": SIGNATURE_INPUT, "shape": [None] + list(input_shape), "dtype": "float32"},
          "output": {"name": SIGNATURE_OUTPUT, "shape": [None, num_outputs], "dtype": "float32"},
          "par_names": names, "model": config.model, **model_registry.option_values(config),
          "trained_precision": config.precision,
          "compute_policy": tf.keras.mixed_precision.global_policy().name,
          "tensorflow_version": tf.__version__}
  if model_registry.batch_dependent(config):
    info["note"] = ("normalises each call's batch with that batch's own statistics (the reference's IPU "
                    "model): pass batches of many samples, as in training, not single frames")
  atomic_files.write_text(os.path.join(export_dir, "export_info.yaml"), yaml.safe_dump(info, sort_keys=False))
  return export_dir
