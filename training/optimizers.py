"""Optimizer registry: `--optimizer` names to Keras 2 optimizers, with decoupled weight decay and
gradient clipping on every backend.

Keras 2 has two optimizer families with different checkpoint layouts: the legacy `OptimizerV2` (the
only one before TF 2.11; slots stored beside each weight, fused update kernels) and the `Optimizer`
of TF >= 2.11 (state under `optimizer/_variables`). `FORMATS` names them; a resumed run must build the
family its checkpoint was written with, or the optimizer state would silently start from zero.

`--weight_decay` and `--clip_norm` act in the legacy family, which every TensorFlow from 2.6 has: the
decay through `_DecoupledWeightDecay` (so AdamW is the project's Adam with it), the clip as the last of
the optimizer's `gradient_transformers`. Neither adds a variable: checkpoints keep the plain
optimizer's layout.
"""

import functools

import tensorflow as tf

from errors import UserError

LEGACY, KERAS_2_11 = "optimizer_v2", "optimizer_2.11"
TORCH_ADAM_EPSILON = 1e-8  # torch.optim.Adam's default
FORMATS = (LEGACY, KERAS_2_11)


def optimizer_format(optimizer) -> str:
  """Which family `optimizer` belongs to (see the module docstring)."""
  return LEGACY if hasattr(optimizer, "get_slot_names") else KERAS_2_11


def _legacy_module():
  """Where the legacy family's classes are: tf.keras.optimizers.legacy from TF 2.11, before it
  tf.keras.optimizers itself."""
  return getattr(tf.keras.optimizers, "legacy", None) or tf.keras.optimizers


def _legacy_adam_class():
  return _legacy_module().Adam


class _TorchEpsilon:
  """Mixin for the legacy Adam: epsilon added where PyTorch's Adam (the reference's) adds it.

  Keras adds epsilon to sqrt(v) before the bias correction ("epsilon hat"); PyTorch adds it to the
  bias-corrected sqrt(v / (1 - beta_2^t)). Scaling it by sqrt(1 - beta_2^t) gives PyTorch's update
  exactly, so with PyTorch's default 1e-8 the steps are those of torch.optim.Adam. Keras' own 1e-7,
  uncorrected, is 3e-6 in PyTorch's terms at the first step: it damps the small-gradient weights
  (batch-norm scales) for the first epochs. Variables, slots and checkpoints are those of Adam.
  Keras' private method it overrides is registered in tf_workarounds.py.
  """

  def _prepare_local(self, var_device, var_dtype, apply_state):
    super()._prepare_local(var_device, var_dtype, apply_state)  # pylint: disable=no-member
    coefficients = apply_state[(var_device, var_dtype)]
    coefficients["epsilon"] = coefficients["epsilon"] * tf.sqrt(1 - coefficients["beta_2_power"])


@functools.lru_cache(maxsize=None)
def _torch_adam_class():
  """The legacy Adam with PyTorch's epsilon placement (one class per process, made on first use)."""
  return type("Adam", (_TorchEpsilon, _legacy_adam_class()), {})


class _DecoupledWeightDecay:
  """Mixin for a legacy-family optimizer: PyTorch's decoupled weight decay (torch.optim.AdamW's rule).

  Before the optimizer's own update of a weight p, p <- p * (1 - lr_t * weight_decay), with lr_t the
  learning rate of that step (the schedule's value at `iterations`, as the update uses). The factor is
  computed in float32 and the product rounded once to the weight's dtype: exact for float32 weights,
  and for 16-bit ones a change below half a unit in the last place is kept only by stochastic rounding.
  It acts where the optimizer applies each update (`_resource_apply_dense`), so a LossScaleOptimizer
  that skips a step with non-finite gradients skips the decay too, as PyTorch's GradScaler does. The
  update rules of Adam and SGD do not read the weight, so decaying first is PyTorch's order exactly.
  The decay is a Python float, not a Keras hyperparameter: no variable is added to checkpoints.
  Keras' private methods it overrides and calls are registered in tf_workarounds.py.
  """

  def __init__(self, *args, weight_decay=0.0, **kwargs):
    super().__init__(*args, **kwargs)
    self._decoupled_weight_decay = float(weight_decay)

  def _prepare_local(self, var_device, var_dtype, apply_state):
    super()._prepare_local(var_device, var_dtype, apply_state)  # pylint: disable=no-member
    coefficients = apply_state[(var_device, var_dtype)]
    # The update's own lr_t is in the weight's dtype; a float16 rate (IPU 16.16) would be rounded.
    if var_dtype == tf.float32:
      rate = coefficients["lr_t"]
    else:
      rate = self._decayed_lr(tf.float32)  # pylint: disable=no-member
    coefficients["decay_factor"] = 1.0 - rate * self._decoupled_weight_decay

  def _decay(self, var, apply_state):
    key = (var.device, var.dtype.base_dtype)
    coefficients = (apply_state or {}).get(key) or self._fallback_apply_state(*key)  # pylint: disable=no-member
    decayed = tf.cast(var, tf.float32) * coefficients["decay_factor"]
    return var.assign(tf.cast(decayed, var.dtype), read_value=False)

  def _resource_apply_dense(self, grad, var, apply_state=None):
    with tf.control_dependencies([self._decay(var, apply_state)]):
      return super()._resource_apply_dense(grad, var, apply_state=apply_state)  # pylint: disable=no-member

  def _resource_apply_sparse_duplicate_indices(self, grad, var, indices, **kwargs):
    # The entry point of sparse updates (Keras' SGD updates there without `_resource_apply_sparse`); the
    # whole weight decays, as in PyTorch.
    with tf.control_dependencies([self._decay(var, kwargs.get("apply_state"))]):
      return super()._resource_apply_sparse_duplicate_indices(grad, var, indices, **kwargs)  # pylint: disable=no-member

  def get_config(self):
    return dict(super().get_config(), weight_decay=self._decoupled_weight_decay)  # pylint: disable=no-member


@functools.lru_cache(maxsize=None)
def _with_weight_decay(optimizer_class):
  """`optimizer_class` (a legacy-family optimizer) with `_DecoupledWeightDecay`; same name and slots."""
  return type(optimizer_class.__name__, (_DecoupledWeightDecay, optimizer_class), {})


def clip_by_global_norm(clip_norm: float):
  """A gradient transformer: the gradients scaled so that their global norm is at most `clip_norm`.

  Keras' OptimizerV2 applies its transformers after the cross-replica sum and in order, after the IPU's
  division by the replica count (strategies/ipu.py `optimizer_kwargs`), so the clip sees the averaged
  gradient of the whole batch; Keras' own `global_clipnorm` comes before the transformers, refuses to
  be set with them (both in keras 2.6 and tf_keras optimizer_v2.py) and refuses CentralStorageStrategy,
  the CPU replicas' (optimizers/utils.py). 16-bit gradients are clipped in float32, whose squares would
  overflow float16; float32 ones get `global_clipnorm`'s arithmetic exactly.
  """
  def clip(grads_and_vars):
    grads, variables = zip(*grads_and_vars)
    clipped, _ = tf.clip_by_global_norm([tf.cast(grad, tf.float32) for grad in grads], clip_norm)
    return [(tf.cast(new, grad.dtype), var) for new, grad, var in zip(clipped, grads, variables)]
  return clip


def _adam(learning_rate, **kwargs):
  # Keras' optimizer of TF >= 2.11 updates each variable with about ten element-wise ops (fused only
  # under XLA, which it uses on GPUs alone); the legacy class runs one fused ResourceApplyAdam kernel
  # per variable, the same update rule.
  kwargs.setdefault("epsilon", TORCH_ADAM_EPSILON)
  return _torch_adam_class()(learning_rate=learning_rate, **kwargs)


# What a new run builds without weight decay or clipping. SGD is Keras' default class (the TF >= 2.11
# family there), as runs have always built it; "adamw" is Adam with decoupled weight decay.
OPTIMIZERS = {
    "sgd": tf.keras.optimizers.SGD,
    "adam": _adam,
    "adamw": _adam,
}
# The legacy-family class behind each name, extended by the decay, for a run that decays or clips.
_LEGACY_CLASSES = {"sgd": lambda: _legacy_module().SGD, "adam": _torch_adam_class, "adamw": _torch_adam_class}


def _keras_2_11_optimizer(name, learning_rate, weight_decay, clip_norm, **kwargs):
  """The TF >= 2.11 family's own class, for a run checkpointed with it. Its weight decay is the same
  decoupled rule (variable -= variable * weight_decay * lr before the update, tf_keras
  optimizers/optimizer.py `_apply_weight_decay`) and its `global_clipnorm` clips after the replicas' sum."""
  if not hasattr(tf.keras.optimizers, "AdamW"):  # Keras gained this family in TensorFlow 2.11.
    raise UserError("--resume: the checkpoint holds the optimizer state of TensorFlow >= 2.11's Keras "
                    "optimizers; this is TensorFlow %s: resume it with TensorFlow >= 2.11" % tf.__version__)
  if clip_norm:
    kwargs["global_clipnorm"] = clip_norm
  if name == "adamw":
    return tf.keras.optimizers.AdamW(learning_rate=learning_rate, weight_decay=weight_decay, **kwargs)
  if weight_decay:
    kwargs["weight_decay"] = weight_decay
  optimizer_class = tf.keras.optimizers.Adam if name == "adam" else tf.keras.optimizers.SGD
  return optimizer_class(learning_rate=learning_rate, **kwargs)


def make_optimizer(name: str, learning_rate, factories=None, checkpoint_format=None, weight_decay=0.0,
                   clip_norm=0.0, **backend_kwargs) -> tf.keras.optimizers.Optimizer:
  """The optimizer `name`, with decoupled `weight_decay` (0: none) and the gradients' global norm
  clipped to `clip_norm` (0: no clip).

  `learning_rate` is a number or a Keras LearningRateSchedule of the update count. The backend may
  supply `factories` (name -> (legacy-family class, its fixed keyword arguments): IPU-specific
  optimizers) and `backend_kwargs` (e.g. the IPU's gradient averaging over replicas). A backend's
  "adam" class is given PyTorch's epsilon and must add it where PyTorch does, to the bias-corrected
  sqrt(v), as `_TorchEpsilon` does: one Adam on every backend. `checkpoint_format` is the family of
  the checkpoint a resumed run continues from (None for a new run)."""
  if name not in OPTIMIZERS:
    raise UserError("unknown optimizer %r; valid optimizers: %s" % (name, ", ".join(sorted(OPTIMIZERS))))
  if checkpoint_format == KERAS_2_11:  # a run started with Keras' own class resumes with it
    return _keras_2_11_optimizer(name, learning_rate, weight_decay, clip_norm, **backend_kwargs)
  base = "adam" if name == "adamw" else name
  if base == "adam":
    backend_kwargs.setdefault("epsilon", TORCH_ADAM_EPSILON)
  if clip_norm:  # after the backend's own transformers (the IPU's average over replicas)
    backend_kwargs["gradient_transformers"] = (list(backend_kwargs.get("gradient_transformers") or [])
                                               + [clip_by_global_norm(clip_norm)])
  factory = (factories or {}).get(base)
  if factory is None and not (weight_decay or clip_norm or checkpoint_format == LEGACY):
    return OPTIMIZERS[name](learning_rate=learning_rate, **backend_kwargs)
  optimizer_class, fixed = factory or (_LEGACY_CLASSES[name](), {})
  if weight_decay:
    optimizer_class, fixed = _with_weight_decay(optimizer_class), dict(fixed, weight_decay=weight_decay)
  return optimizer_class(learning_rate=learning_rate, **fixed, **backend_kwargs)


def create_slots(optimizer, variables) -> None:
  """Creates the optimizer's state (slots, step counter) now, inside the caller's strategy scope.

  Left to Keras, the first traced training step creates it, and a tf.function whose first trace
  creates variables is traced a second time: about half a second of start-up for ontra4, which no
  executable cache can save. Both Keras 2 families (and the loss-scale wrappers) have the hook; the
  legacy family's, a private method, is registered in tf_workarounds.py, whose test fails without it.
  """
  if hasattr(optimizer, "_create_all_weights"):  # legacy OptimizerV2 family (TF 2.4+)
    optimizer._create_all_weights(variables)  # pylint: disable=protected-access
  elif hasattr(optimizer, "build"):  # the TF >= 2.11 family
    optimizer.build(variables)
