"""The Neuron-Inverter regressor: 1-D CNN + fully connected head, voltage traces -> 15 conductances.

Faithful to the reference PyTorch model, including its input quirk: the (1600 time bins, 4 probes)
sample is *reshaped* row-major to (4, 1600) and used as 4 channels of 1600 positions, so each "channel"
holds 400 consecutive time bins with the probes interleaved. Keras' channels-last Conv1D then needs the
transpose back to (1600, 4). Each conv block is Conv1D(valid) -> MaxPool -> ReLU; one batch
normalisation on the flattened features (moving statistics, or each batch's own as in the reference's IPU
model: `--batch_norm_statistics`); Dense+ReLU+Dropout layers (rate `--dropout`; the reference's is the design's
`dropout`); a linear output. Weights start as PyTorch's
defaults would (`model.initializers`).

Pipeline stages: the CNN block and the fully connected head (`STAGE_BOUNDARIES` names the first layer
of each later stage). Where they run is the backend's business.

Training builds each conv block as one `conv_layers.PooledConv1D`: the same function and the same weights,
computed faster, in the form `cpu_forms.forms` picks for the hardware. `standard_layers=True` builds the
plain Keras form of the reference (Conv1D, MaxPooling1D, ReLU layers), which the tests and
`tools/benchmark_forms.py` hold the fast blocks against. The model's own options (`design`,
`batch_norm_statistics`) are declared in `options.py`.
"""

from typing import Optional

import tensorflow as tf

from errors import UserError
from model import initializers
from model.neuron_inverter.conv_layers import LeadingChannels, PooledConv1D
from model.neuron_inverter.cpu_forms import forms  # noqa: F401  pylint: disable=unused-import  (model.layer_forms)
from model import options as options_lib
from model.neuron_inverter.designs import DESIGNS
from model.neuron_inverter.options import OPTIONS
from model.normalization import BatchStatisticsNormalization
from run_config import RunConfig

STAGE_BOUNDARIES = ("flatten",)
# The form options of an exported SavedModel (analysis/export.py): without the compiled first-block op, whose
# library would have to travel with it; TensorFlow's ops compute the same block, to float32 rounding
# (relative 1e-6).
SAVED_MODEL_FORM = {"first_block_library": ""}


def _standard_conv_block(x, index, filters, kernel, pool):
  layers = tf.keras.layers
  x = layers.Conv1D(filters, kernel, padding="valid", name="conv%d" % index,
                    kernel_initializer=initializers.kernel(),
                    bias_initializer=initializers.bias(kernel * int(x.shape[-1])))(x)
  x = layers.MaxPooling1D(pool, name="pool%d" % index)(x)
  return layers.ReLU(name="relu%d" % index)(x)


def _conv_blocks(x, design, standard_layers, pooling, phases_max_in_channels, first_block_library,
                 **conv_options):
  blocks = list(zip(design["conv_filters"], design["conv_kernels"], design["conv_pools"]))
  in_channels = int(x.shape[-1])
  for index, (filters, kernel, pool) in enumerate(blocks, start=1):
    if standard_layers:
      x = _standard_conv_block(x, index, filters, kernel, pool)
    else:
      block_pooling = "phases" if in_channels <= phases_max_in_channels else pooling
      x = PooledConv1D(filters, kernel, pool, in_channels, name="conv%d" % index, pooling=block_pooling,
                       library=first_block_library if index == 1 else "", **conv_options)(x)
    in_channels = filters
  return x if standard_layers else LeadingChannels(in_channels, name="conv_channels")(x)


def _batch_norm(statistics: str) -> tf.keras.layers.Layer:
  """The reference's BatchNorm1d on the flattened features: moving statistics for evaluation (its GPU
  model; PyTorch's momentum 0.1 is Keras' 0.9, eps 1e-5), or each batch's own (its IPU model). Every run
  has "auto" settled (model.settle_options); a config made directly (tests) builds Keras' layer."""
  if statistics == "batch":
    return BatchStatisticsNormalization(epsilon=1e-5, name="batch_norm")
  return tf.keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-5, name="batch_norm")


def min_time_bins(design: dict) -> int:
  """Shortest frames (in time bins) whose conv blocks still leave at least one position."""
  length = 1
  for kernel, pool in reversed(list(zip(design["conv_kernels"], design["conv_pools"]))):
    length = length * pool + kernel - 1
  return length


def build(config: RunConfig, input_shape=(1600, 4), num_outputs=15, channel_multiple=1,
          input_grad_by_forward_conv=False, kernel_grad_by_matmul=False, pooling="max_pool",
          phases_max_in_channels=0, first_block_library="", standard_layers=False) -> tf.keras.Model:
  """Builds the (uncompiled) model of the `design` option (options.py) for samples of `input_shape`.

  `channel_multiple`, `input_grad_by_forward_conv`, `kernel_grad_by_matmul`, `pooling`,
  `phases_max_in_channels` and `first_block_library` are the form of the conv blocks (cpu_forms.py; see
  conv_layers.py: blocks with at most `phases_max_in_channels` real input channels pool by phases, the
  others by `pooling`; the first block, whose input is the data, runs as the compiled op at
  `first_block_library` where one is given);
  `standard_layers` builds the plain Keras layers instead, without options.
  """
  values = options_lib.values(OPTIONS, config.model_options)
  design = DESIGNS[values["design"]]
  layers = tf.keras.layers
  time_bins, probes = input_shape
  if time_bins < min_time_bins(design):
    raise UserError("--design=%s needs frames of at least %d time bins; the data has %d time bins"
                    % (values["design"], min_time_bins(design), time_bins))
  inputs = layers.Input(shape=input_shape, name="frames")
  x = layers.Reshape((probes, time_bins), name="reference_reshape")(inputs)  # reshape, not transpose
  x = layers.Permute((2, 1), name="channels_last")(x)
  x = _conv_blocks(x, design, standard_layers, pooling, phases_max_in_channels, first_block_library,
                   channel_multiple=channel_multiple, input_grad_by_forward_conv=input_grad_by_forward_conv,
                   kernel_grad_by_matmul=kernel_grad_by_matmul)
  x = layers.Flatten(name="flatten")(x)
  x = _batch_norm(values["batch_norm_statistics"])(x)
  for i, dim in enumerate(design["fc_dims"], start=1):
    x = layers.Dense(dim, activation="relu", name="fc%d" % i, kernel_initializer=initializers.kernel(),
                     bias_initializer=initializers.bias(int(x.shape[-1])))(x)
    x = layers.Dropout(config.dropout, name="dropout%d" % i)(x)
  # Linear (u* is unbounded); float32 under mixed precision so the loss is computed at full precision.
  outputs = layers.Dense(num_outputs, dtype="float32", name="conductances",
                         kernel_initializer=initializers.kernel(),
                         bias_initializer=initializers.bias(int(x.shape[-1])))(x)
  return tf.keras.Model(inputs, outputs, name="neuron_inverter_" + values["design"])


def summary_note(net: tf.keras.Model) -> Optional[str]:
  """Lines for under the model summary: where the conv blocks carry padding channels, so that their
  widths there (32 / 96 / 192 for ontra4's 30 / 90 / 180 filters) are not read as another network; and
  where the batch normalisation uses each batch's own statistics, which a user may not expect."""
  notes = []
  blocks = [layer for layer in net.layers if isinstance(layer, PooledConv1D)]
  if any(block.output_channels != block.filters for block in blocks):
    notes.append("%s: %s channels = the design's %s filters + zero padding to multiples of %d (fastest for "
                 "this backend's kernels); conv_channels drops the padding, and the parameter count is the "
                 "design's" % (", ".join(block.name for block in blocks),
                               " / ".join(str(block.output_channels) for block in blocks),
                               " / ".join(str(block.filters) for block in blocks), blocks[0].channel_multiple))
  if any(isinstance(layer, BatchStatisticsNormalization) for layer in net.layers):
    notes.append("Batch normalisation by each batch's own statistics, in evaluation and prediction too "
                 "(--batch_norm_statistics=batch, the reference's IPU model; auto chooses it for pipelined "
                 "IPU training, which cannot update moving statistics)")
  return "\n".join(notes) or None


def loss():
  return tf.keras.losses.MeanSquaredError()


def metrics():
  return [tf.keras.metrics.MeanAbsoluteError(name="mae")]
