"""A faster, exactly equivalent form of the Neuron-Inverter's Conv1D -> MaxPool -> ReLU block.

`PooledConv1D` computes relu(maxpool(conv(x) + b)) as relu(maxpool(conv(x)) + b). Adding a
per-channel constant commutes with taking a maximum (and with rounding to 16 bits, which is
monotonic), so the result is the same bit for bit, while the bias add, its gradient and the ReLU touch
`pool` times fewer values. On the CPU these element-wise passes cost a third of an ontra4 training
step in bfloat16, because oneDNN does not fuse a bias into a Conv1D (Keras runs it as a Conv2D between
an ExpandDims and a Squeeze).

Further options change how the same function is computed; cpu_forms.py chooses them for the hardware,
because which is faster depends on the processor's kernels:
- `channel_multiple`: the kernel is zero-padded so that the block's output channel count is a multiple
  of it (and its input count matches the padded block before it; the network's 4 input probes are not
  widened). Only where that adds at most a quarter more channels: padding the small `dev` design's 4
  filters to 32 would multiply that block's work by 8 for no gain. The padded output channels are exactly zero (zero weights, zero bias, ReLU),
  feed the next block through zero weights, and their gradients are never applied: only the design's
  (kernel, in_channels, filters) variables exist. oneDNN's AMX bfloat16 convolutions take their fast
  path only for channel counts that are multiples of 32; at 90 -> 30 channels they ran 4x slower per
  FLOP than at 96 -> 32.
- `input_grad_by_forward_conv`: the gradient with respect to the block's input is computed as a forward
  convolution of the zero-padded output gradient with the flipped, transposed kernel (the textbook
  identity), because oneDNN's backward-data convolution ran 3-4x slower than its forward convolution
  at these shapes.
- `kernel_grad_by_matmul`: the kernel gradient is one matmul of the block's input, laid out as the
  kernel's shifted windows (im2col), with the output gradient. oneDNN's AVX2 backward-filter kernel ran
  1.1-1.7x slower than that at the ontra4 shapes; with AVX-512 it was the faster one. Blocks with a
  skinny im2col (fewer than MATMUL_MIN_COLUMNS columns: the 4-probe first block) keep oneDNN's kernel.

- `pooling`: how the maximum over each pool window is taken.
  - "max_pool": TensorFlow's MaxPool and, in training, MaxPoolGrad.
  - "maximum": the conv output reshaped to (positions, pool, channels) and reduced by a tree of
    elementwise maxima, whose gradient is a few selects. On the AVX2 CPU where it was measured,
    MaxPoolGrad alone cost a sixth of a float32 step.
  - "phases": as "maximum", but each pool phase (conv positions i, i + pool, ...) is computed by its
    own stride-`pool` convolution, so the full-resolution conv output never exists. It pays off where
    that output is much larger than the work that makes it: the first block, whose 4 input probes
    give a 1597 x 30 output per sample from 16 multiply-adds per value (the model builder's
    `phases_max_in_channels` picks such blocks).
  On ties every form routes the gradient to the first maximum of the window, as MaxPoolGrad does (the
  traces have flat stretches, where the conv values of a window are equal).
- `library`: the path of the compiled ConvPool1D op (model/neuron_inverter/conv_pool_op.py), which computes the whole
  float32 block in one pass and keeps the conv output in registers. It gives no input gradient, so it
  is only for a block whose input is the data (the model builder passes it to the first block only).

Weights keep the names and shapes of a Keras Conv1D (`kernel`, `bias`), so checkpoints and
`set_weights` move freely between this block and the standard layers.
"""

import tensorflow as tf

from model import initializers
from model.neuron_inverter import conv_pool_op


def _input_grad_by_forward_conv(upstream, kernel):
  """dx[s] = sum_j dy[s - j] . kernel[j]^T: a VALID conv of dy padded by width-1 on both sides with the
  kernel reversed in time and its channel axes swapped (the textbook identity)."""
  width = kernel.shape[0]
  padded = tf.pad(upstream, [[0, 0], [width - 1, width - 1], [0, 0]])
  flipped = tf.transpose(tf.reverse(kernel, axis=[0]), [0, 2, 1])
  return tf.nn.conv1d(padded, flipped, stride=1, padding="VALID")


# Below this many im2col columns (kernel width x input channels) oneDNN's backward-filter kernel stays:
# for the 4-probe first block (16 columns) it beat the matmul at batch 48 and 192 with AVX2 code
# (2.5 against 3.0 ms, 5.9 against 8.2 ms), the skinny matmul being the slow part.
MATMUL_MIN_COLUMNS = 32


def _kernel_grad_by_matmul(x, upstream, width):
  """dkernel[j, c, o] = sum_{b,t} x[b, t + j, c] dy[b, t, o], as one matmul of the `width` shifted
  copies of x (im2col) with dy.

  Row t of the im2col, x[b, t:t + width, :] flattened, is a contiguous run of x's memory, so one
  tf.signal.frame over the flattened time and channel axes makes it (one gather), where slicing the
  `width` copies and concatenating them took 1.1-1.3x as long (AVX2 code, ontra4's conv2 and conv3).
  """
  time_steps, in_channels = x.shape[1], x.shape[2]
  out_channels = upstream.shape[2]
  columns = tf.signal.frame(tf.reshape(x, [-1, time_steps * in_channels]), width * in_channels,
                            in_channels, axis=-1)
  product = tf.matmul(tf.reshape(columns, [-1, width * in_channels]),
                      tf.reshape(upstream, [-1, out_channels]), transpose_a=True)
  return tf.reshape(product, [width, in_channels, out_channels])


def _conv1d_with_gradients(input_grad_by_forward_conv, kernel_grad_by_matmul):
  """VALID, stride-1 conv1d(x, kernel) whose input and kernel gradients are computed in the forms
  asked for (the same values as oneDNN's backward convolutions, up to summation order)."""

  @tf.custom_gradient
  def conv1d(x, kernel):
    outputs = tf.nn.conv1d(x, kernel, stride=1, padding="VALID")

    def grad(upstream):
      width, in_channels, out_channels = kernel.shape
      if input_grad_by_forward_conv:
        input_grad = _input_grad_by_forward_conv(upstream, kernel)
      else:
        input_grad = tf.squeeze(tf.raw_ops.Conv2DBackpropInput(
            input_sizes=tf.shape(tf.expand_dims(x, 1)), filter=tf.expand_dims(kernel, 0),
            out_backprop=tf.expand_dims(upstream, 1), strides=[1, 1, 1, 1], padding="VALID"), 1)
      if kernel_grad_by_matmul:
        kernel_grad = _kernel_grad_by_matmul(x, upstream, width)
      else:
        kernel_grad = tf.squeeze(tf.raw_ops.Conv2DBackpropFilter(
            input=tf.expand_dims(x, 1), filter_sizes=tf.constant([1, width, in_channels, out_channels]),
            out_backprop=tf.expand_dims(upstream, 1), strides=[1, 1, 1, 1], padding="VALID"), 0)
      return input_grad, kernel_grad

    return outputs, grad

  return conv1d


POOLINGS = ("max_pool", "maximum", "phases")


def _first_maximum(tensors):
  """Elementwise maximum of `tensors`, as a balanced tree that keeps the earlier operand on ties.

  tf.maximum's gradient goes to its first operand where the two are equal, so the whole tree sends it
  to the earliest maximal tensor, as MaxPoolGrad sends it to the first maximum of a window.
  """
  while len(tensors) > 1:
    pairs = [tf.maximum(tensors[i], tensors[i + 1]) for i in range(0, len(tensors) - 1, 2)]
    tensors = pairs + tensors[len(pairs) * 2:]
  return tensors[0]


def _pool_by_maximum(x, pool):
  """max_pool1d(x, pool, pool, VALID) as a tree of elementwise maxima over the window positions."""
  positions, channels = x.shape[1] // pool, x.shape[2]
  if x.shape[1] != positions * pool:
    x = x[:, :positions * pool]
  windows = tf.reshape(x, [-1, positions, pool, channels])
  return _first_maximum(tf.unstack(windows, axis=2))


def _conv_pool_by_phases(x, kernel, pool):
  """max_pool1d(conv1d(x, kernel, VALID), pool, pool, VALID), one strided conv per pool phase."""
  width = kernel.shape[0]
  positions = (x.shape[1] - width + 1) // pool
  span = pool * (positions - 1) + width  # the input one phase reads
  phases = [tf.nn.conv1d(x[:, i:i + span], kernel, stride=pool, padding="VALID") for i in range(pool)]
  return _first_maximum(phases)


MAX_PADDING = 0.25  # extra channels, as a share of the real ones, worth the fast kernels


def padded_channels(count: int, multiple: int) -> int:
  """`count` rounded up to a multiple of `multiple`, unless that adds more than MAX_PADDING."""
  rounded = -(-count // multiple) * multiple
  return rounded if rounded <= count * (1 + MAX_PADDING) else count


class PooledConv1D(tf.keras.layers.Layer):
  """Conv1D (VALID, stride 1) -> MaxPooling1D(pool) -> ReLU over `in_channels` real input channels.

  The incoming tensor may carry extra, all-zero channels after the real ones (a padded block before
  it); the output carries padded_channels(filters, channel_multiple) channels, the first `filters` real.
  """

  def __init__(self, filters, kernel_size, pool_size, in_channels, channel_multiple=1,
               input_grad_by_forward_conv=False, kernel_grad_by_matmul=False, pooling="max_pool",
               library="", **kwargs):
    super().__init__(**kwargs)
    self.filters = filters
    self.kernel_size = kernel_size
    self.pool_size = pool_size
    self.in_channels = in_channels
    self.channel_multiple = channel_multiple
    self.input_grad_by_forward_conv = input_grad_by_forward_conv
    self.kernel_grad_by_matmul = kernel_grad_by_matmul
    if pooling not in POOLINGS:
      raise ValueError("pooling=%r is not one of %s" % (pooling, ", ".join(POOLINGS)))
    self.pooling = pooling
    self.library = library

  def build(self, input_shape):
    incoming = int(input_shape[-1])
    if incoming < self.in_channels:
      raise ValueError("%s expects at least %d input channels, got %d" % (self.name, self.in_channels,
                                                                         incoming))
    self.kernel = self.add_weight("kernel", (self.kernel_size, self.in_channels, self.filters),
                                  initializer=initializers.kernel())
    self.bias = self.add_weight("bias", (self.filters,),
                                initializer=initializers.bias(self.kernel_size * self.in_channels))
    self._input_padding = incoming - self.in_channels  # the previous block's zero channels
    self._kernel_grad_by_matmul = (self.kernel_grad_by_matmul
                                   and self.kernel_size * incoming >= MATMUL_MIN_COLUMNS)
    self._output_padding = self.output_channels - self.filters
    # The op computes float32 only, without padding channels, and only some sizes (cpu_forms.py asks for
    # it in float32 only).
    self._by_library = bool(self.library) and self.compute_dtype == "float32" and not (
        self._input_padding or self._output_padding) and conv_pool_op.computes(
            self.kernel_size, self.in_channels, self.filters, self.pool_size)
    super().build(input_shape)

  @property
  def output_channels(self) -> int:
    """The channels the block outputs: its `filters`, then any all-zero padding channels."""
    return padded_channels(self.filters, self.channel_multiple)

  def call(self, inputs):
    return self._forward(inputs)

  # No Python control flow depends on tensors here: AutoGraph's conversion would only add tracing time.
  @tf.autograph.experimental.do_not_convert
  def _forward(self, inputs):
    # A tensor, not the variable: tf.custom_gradient must see only tensors (the autocast read is here).
    kernel, bias = tf.convert_to_tensor(self.kernel), self.bias
    if self._input_padding or self._output_padding:
      kernel = tf.pad(kernel, [[0, 0], [0, self._input_padding], [0, self._output_padding]])
      bias = tf.pad(bias, [[0, self._output_padding]])
    if self._by_library:
      return conv_pool_op.conv_pool1d(inputs, kernel, bias, self.pool_size, self.library)
    if self.pooling == "phases":
      x = _conv_pool_by_phases(inputs, kernel, self.pool_size)
    else:
      if self.input_grad_by_forward_conv or self._kernel_grad_by_matmul:
        x = _conv1d_with_gradients(self.input_grad_by_forward_conv, self._kernel_grad_by_matmul)(inputs,
                                                                                                kernel)
      else:
        x = tf.nn.conv1d(inputs, kernel, stride=1, padding="VALID")
      if self.pooling == "maximum":
        x = _pool_by_maximum(x, self.pool_size)
      else:
        x = tf.nn.max_pool1d(x, self.pool_size, self.pool_size, padding="VALID")
    return tf.nn.relu(tf.nn.bias_add(x, bias))

  def get_config(self):
    config = super().get_config()
    config.update(filters=self.filters, kernel_size=self.kernel_size, pool_size=self.pool_size,
                  in_channels=self.in_channels, channel_multiple=self.channel_multiple,
                  input_grad_by_forward_conv=self.input_grad_by_forward_conv,
                  kernel_grad_by_matmul=self.kernel_grad_by_matmul, pooling=self.pooling,
                  library=self.library)
    return config


class LeadingChannels(tf.keras.layers.Layer):
  """Keeps the first `count` channels: drops a padded block's all-zero channels."""

  def __init__(self, count, **kwargs):
    super().__init__(**kwargs)
    self.count = count

  def call(self, inputs):
    return self._forward(inputs)

  @tf.autograph.experimental.do_not_convert
  def _forward(self, inputs):
    count, width = self.count, int(inputs.shape[-1])
    if width == count:
      return inputs

    @tf.custom_gradient
    def leading(x):
      def grad(upstream):
        # StridedSliceGrad has no fast bfloat16 kernel; padding back to the full width is the same.
        return tf.pad(upstream, [[0, 0]] * (len(x.shape) - 1) + [[0, width - count]])
      return x[..., :count], grad

    return leading(inputs)

  def get_config(self):
    config = super().get_config()
    config.update(count=self.count)
    return config
