"""Gradient accumulation for CPU and GPU backends, with the mathematics of the IPU's.

On an IPU, `--gradient_accumulation=G` makes every replica run G micro-batches and apply one optimizer
step with their mean gradient. Here each replica receives its G micro-batches together, as one batch of
G x micro-batch rows, and the training step walks through them one at a time: forward, backward, add
the gradients, and after the last one apply their mean. So the effective batch, the number of optimizer
steps and per-micro-batch statistics (BatchNorm) match the IPU run, and memory holds one micro-batch of
activations at a time.

Under a mixed-float16 policy (GPUs), Keras wraps the optimizer in a LossScaleOptimizer: each micro-batch's
loss is scaled before its float16 backward pass, as Keras' own training step does, and the mean gradient
is unscaled once before the update.
"""

import tensorflow as tf


def split_micro_batches(tensor, micro_batches: int):
  """(G*B, ...) -> (G, B, ...), with static shapes."""
  tensor = tf.convert_to_tensor(tensor)
  shape = tensor.shape.as_list()
  return tf.reshape(tensor, [micro_batches, shape[0] // micro_batches] + shape[1:])


def accumulated_gradients(model: tf.keras.Model, x, y, micro_batches: int):
  """Mean gradient over `micro_batches` consecutive slices of (x, y); updates the compiled metrics.

  Each slice's loss is its own mean, so the mean of the slice gradients equals the gradient of the
  mean loss over the whole batch (exactly, for layers without batch statistics).
  """
  xs, ys = split_micro_batches(x, micro_batches), split_micro_batches(y, micro_batches)
  variables = model.trainable_variables
  scaler = _loss_scale_optimizer(model)

  def body(i, totals):
    with tf.GradientTape() as tape:
      predictions = model(xs[i], training=True)
      loss = model.compiled_loss(ys[i], predictions, regularization_losses=model.losses)
      if scaler:  # float16 gradients this small would flush to zero unscaled
        loss = scaler.get_scaled_loss(loss)
    gradients = tape.gradient(loss, variables)
    model.compiled_metrics.update_state(ys[i], predictions)
    return i + 1, [t + g for t, g in zip(totals, gradients)]

  # A graph loop, not an unrolled one: one micro-batch of activations is alive at a time.
  _, totals = tf.while_loop(lambda i, _: i < micro_batches, body,
                            (tf.constant(0), [tf.zeros_like(v) for v in variables]))
  means = [t / tf.cast(micro_batches, t.dtype) for t in totals]
  return scaler.get_unscaled_gradients(means) if scaler else means


def _loss_scale_optimizer(model: tf.keras.Model):
  """The model's optimizer if it scales the loss (Keras' compile wraps it so under mixed_float16)."""
  optimizer = getattr(model, "optimizer", None)
  return optimizer if isinstance(optimizer, tf.keras.mixed_precision.LossScaleOptimizer) else None


class AccumulatingModel(tf.keras.Model):
  """A functional Keras model whose training step accumulates gradients over micro-batches."""

  def __init__(self, *args, micro_batches: int = 1, **kwargs):
    super().__init__(*args, **kwargs)
    self.micro_batches = micro_batches

  def train_step(self, data):
    if self.micro_batches == 1:
      return super().train_step(data)
    x, y = data
    gradients = accumulated_gradients(self, x, y, self.micro_batches)
    self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
    return {metric.name: metric.result() for metric in self.metrics}


def with_accumulation(model: tf.keras.Model, micro_batches: int) -> tf.keras.Model:
  """The same layers and weights as `model`, training with `micro_batches`-step accumulation."""
  if micro_batches == 1:
    return model
  return AccumulatingModel(inputs=model.inputs, outputs=model.outputs, name=model.name,
                           micro_batches=micro_batches)
