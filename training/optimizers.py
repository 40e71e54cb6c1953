"""Optimizer registry: `--optimizer` names to Keras 2 optimizers.

Keras 2 has two optimizer families with different checkpoint layouts: the legacy `OptimizerV2` (the
only one before TF 2.11; slots stored beside each weight, fused update kernels) and the `Optimizer`
of TF >= 2.11 (state under `optimizer/_variables`). `FORMATS` names them; a resumed run must build the
family its checkpoint was written with, or the optimizer state would silently start from zero.
"""

import functools

import tensorflow as tf

from errors import UserError


def _adamw(learning_rate, **kwargs):
  if not hasattr(tf.keras.optimizers, "AdamW"):  # Keras gained AdamW in TensorFlow 2.11.
    raise UserError("--optimizer=adamw needs TensorFlow >= 2.11; this is TensorFlow %s: use "
                    "--optimizer=adam" % tf.__version__)
  # PyTorch's AdamW default decay, as in the reference's poptorch.optim.AdamW.
  return tf.keras.optimizers.AdamW(learning_rate=learning_rate, weight_decay=0.01, **kwargs)


LEGACY, KERAS_2_11 = "optimizer_v2", "optimizer_2.11"
TORCH_ADAM_EPSILON = 1e-8  # torch.optim.Adam's default
FORMATS = (LEGACY, KERAS_2_11)


def optimizer_format(optimizer) -> str:
  """Which family `optimizer` belongs to (see the module docstring)."""
  return LEGACY if hasattr(optimizer, "get_slot_names") else KERAS_2_11


def _legacy_adam_class():
  legacy = getattr(tf.keras.optimizers, "legacy", None)  # On TF < 2.11, tf.keras.optimizers.Adam is it.
  return legacy.Adam if legacy is not None else tf.keras.optimizers.Adam


class _TorchEpsilon:
  """Mixin for the legacy Adam: epsilon added where PyTorch's Adam (the reference's) adds it.

  Keras adds epsilon to sqrt(v) before the bias correction ("epsilon hat"); PyTorch adds it to the
  bias-corrected sqrt(v / (1 - beta_2^t)). Scaling it by sqrt(1 - beta_2^t) gives PyTorch's update
  exactly, so with PyTorch's default 1e-8 the steps are those of torch.optim.Adam. Keras' own 1e-7,
  uncorrected, is 3e-6 in PyTorch's terms at the first step: it damps the small-gradient weights
  (batch-norm scales) for the first epochs. Variables, slots and checkpoints are those of Adam.
  """

  def _prepare_local(self, var_device, var_dtype, apply_state):
    super()._prepare_local(var_device, var_dtype, apply_state)  # pylint: disable=no-member
    coefficients = apply_state[(var_device, var_dtype)]
    coefficients["epsilon"] = coefficients["epsilon"] * tf.sqrt(1 - coefficients["beta_2_power"])


@functools.lru_cache(maxsize=None)
def _torch_adam_class():
  """The legacy Adam with PyTorch's epsilon placement (one class per process, made on first use)."""
  return type("Adam", (_TorchEpsilon, _legacy_adam_class()), {})


def _adam(learning_rate, checkpoint_format=None, **kwargs):
  # Keras' optimizer of TF >= 2.11 updates each variable with about ten element-wise ops (fused only
  # under XLA, which it uses on GPUs alone); the legacy class runs one fused ResourceApplyAdam kernel
  # per variable, the same update rule.
  if checkpoint_format == KERAS_2_11:  # a run started before the switch resumes with its own class
    return tf.keras.optimizers.Adam(learning_rate=learning_rate, **kwargs)
  kwargs.setdefault("epsilon", TORCH_ADAM_EPSILON)
  return _torch_adam_class()(learning_rate=learning_rate, **kwargs)


OPTIMIZERS = {
    "sgd": tf.keras.optimizers.SGD,
    "adam": _adam,
    "adamw": _adamw,
}


def make_optimizer(name: str, learning_rate, factories=None, checkpoint_format=None,
                   **backend_kwargs) -> tf.keras.optimizers.Optimizer:
  """The optimizer `name`. The backend may supply replacement `factories` (IPU-specific optimizers)
  and `backend_kwargs` (e.g. the IPU's gradient averaging over replicas). `checkpoint_format` is the
  family of the checkpoint a resumed run continues from (None for a new run). `learning_rate` is a
  number or a Keras LearningRateSchedule of the update count. A backend's "adam" factory is given
  PyTorch's epsilon and must add it where PyTorch does, to the bias-corrected sqrt(v), as `_adam` does:
  one Adam on every backend."""
  if name not in OPTIMIZERS:
    raise UserError("unknown optimizer %r; valid optimizers: %s" % (name, ", ".join(sorted(OPTIMIZERS))))
  if name == "adam" and name not in (factories or {}):
    return _adam(learning_rate, checkpoint_format, **backend_kwargs)
  factory = (factories or {}).get(name, OPTIMIZERS[name])
  if name == "adam":
    backend_kwargs.setdefault("epsilon", TORCH_ADAM_EPSILON)
  return factory(learning_rate=learning_rate, **backend_kwargs)


def create_slots(optimizer, variables) -> None:
  """Creates the optimizer's state (slots, step counter) now, inside the caller's strategy scope.

  Left to Keras, the first traced training step creates it, and a tf.function whose first trace
  creates variables is traced a second time: about half a second of start-up for ontra4, which no
  executable cache can save. Both Keras 2 families (and the loss-scale wrappers) have the hook.
  """
  if hasattr(optimizer, "_create_all_weights"):  # legacy OptimizerV2 family (TF 2.4+)
    optimizer._create_all_weights(variables)  # pylint: disable=protected-access
  elif hasattr(optimizer, "build"):  # the TF >= 2.11 family
    optimizer.build(variables)
