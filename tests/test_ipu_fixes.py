"""The IPU path's numerics and rules against Graphcore's sources: one set of BatchNormalization statistics
over the replicas, one Adam on every backend, the pipeline's stage rule, Poplar's device failures as one
line wherever they surface, and --backend=auto only where an IPU is listed.

Stand-ins this file adds beside tests/support/fake_ipu.py (each a monkeypatch of one test):
- `tensorflow.python.ipu.ops.cross_replica_ops.cross_replica_mean` (graphcore/tensorflow
  tensorflow/python/ipu/ops/cross_replica_ops.py: the mean of a tensor over all replicas), played by
  tf.distribute's replica all-reduce over 2 logical CPU replicas, or by the identity where the
  stand-in's model runs as one replica;
- AdamIpuOptimizer's update (graphcore/ipu_tensorflow_addons r2.6/sdk-release-3.4
  ipu_tensorflow_addons/keras/optimizers/adam_optimizer.py, `_prepare_local` and `_adam_step`,
  unchanged from SDK 2.6), transcribed onto Keras' legacy Adam;
- `gc-info --list-devices`, a script printing the listing of Graphcore's command-line tools guide.
"""

import os
import stat
import sys
import types

import numpy as np
import pytest
import tensorflow as tf

from errors import UserError
from run_config import RunConfig
from strategies import ipu as ipu_backend
from strategies import pipeline_rules
from tests.support import fake_ipu
from tests.support.helpers import assert_names
from training import optimizers

CROSS_REPLICA_OPS = "tensorflow.python.ipu.ops.cross_replica_ops"


def _config(**kwargs):
  options = dict({"design": "dev"}, **kwargs.pop("model_options", {}))
  base = dict(model="neuron_inverter", backend="ipu", model_options=options, seed=7)
  base.update(kwargs)
  return RunConfig(**base)


def _install_cross_replica_mean(monkeypatch, mean):
  """The stand-in IPU module (fake_ipu.install) with `ipu.ops.cross_replica_ops.cross_replica_mean`."""
  ipu = fake_ipu.install(monkeypatch)
  module = types.ModuleType(CROSS_REPLICA_OPS)
  module.cross_replica_mean = mean
  monkeypatch.setattr(ipu.ops, "cross_replica_ops", module, raising=False)
  monkeypatch.setitem(sys.modules, CROSS_REPLICA_OPS, module)
  return ipu


def _replica_all_reduce_mean(x, replica_group_size=None, name=None):
  """cross_replica_mean over tf.distribute's replicas (the stand-in's replicas are MirroredStrategy's)."""
  del replica_group_size, name
  return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.MEAN, x)


# --- BatchNormalization: one set of moving statistics -------------------------------------------------

def _batch_norm_net(rank: int) -> tf.keras.Model:
  """Dense features into BatchNormalization (rank 2: Keras' moving-average update), or a convolution's
  (rank 4: the fused kernel, whose update assigns the new average)."""
  if rank == 2:
    inputs = tf.keras.Input((3,))
    features = tf.keras.layers.Dense(4, kernel_initializer="ones")(inputs)
  else:
    inputs = tf.keras.Input((2, 2, 1))
    features = tf.keras.layers.Conv2D(3, 1, kernel_initializer="ones")(inputs)
  return tf.keras.Model(inputs, tf.keras.layers.BatchNormalization(momentum=0.9, name="bn")(features))


def _replica_copies(strategy, rank: int, share: bool):
  """Each replica's moving mean and variance after 3 training-mode steps in which replica r's batches
  are shifted and scaled by r (so the replicas' statistics differ), and the value a read gives."""
  with strategy.scope():
    net = _batch_norm_net(rank)
    if share:
      ipu_backend.share_moving_statistics(net)
  shape = (4, 3) if rank == 2 else (4, 2, 2, 1)

  @tf.function
  def steps():
    def step(k):
      replica = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
      x = tf.reshape(tf.range(np.prod(shape), dtype=tf.float32), shape) * (1.0 + replica) + 5.0 * replica + k
      net(x, training=True)
    for k in range(3):
      strategy.run(step, args=(float(k),))
  steps()
  bn = net.get_layer("bn")
  copies = [[v.numpy() for v in strategy.experimental_local_results(var)]
            for var in (bn.moving_mean, bn.moving_variance)]
  return copies, [bn.moving_mean.numpy(), bn.moving_variance.numpy()]


@pytest.mark.parametrize("rank", [2, 4])
def test_replicas_update_one_set_of_moving_statistics_the_cpu_paths_mean(monkeypatch, rank):
  """The IPU's replicas, played by 2 MirroredStrategy replicas with cross_replica_mean as their
  all-reduce: without the sharing, each replica's copy follows its own data (the host of an IPU would
  read replica 0's, poplar_executor.cc ConnectReplicatedDeviceToHost); with it, both copies are the
  copies' mean that CPU/GPU runs read and save (a SyncOnRead MEAN read)."""
  _install_cross_replica_mean(monkeypatch, _replica_all_reduce_mean)
  # Reduced through one device: collective all-reduces keyed alike by two strategies of one process can
  # clash (the keys restart with each strategy, and the second's tensors have other shapes).
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                            cross_device_ops=tf.distribute.ReductionToOneDevice())
  (own_means, own_variances), cpu_read = _replica_copies(strategy, rank, share=False)
  assert not np.allclose(own_means[0], own_means[1], rtol=1e-3)   # the replicas' own statistics differ
  assert not np.allclose(own_means[0], cpu_read[0], rtol=1e-3)    # replica 0's is not the mean
  (means, variances), read = _replica_copies(strategy, rank, share=True)
  for copies, expected in ((means, cpu_read[0]), (variances, cpu_read[1])):
    np.testing.assert_allclose(copies[0], copies[1], rtol=1e-6)
    np.testing.assert_allclose(copies[0], expected, rtol=1e-5)
  np.testing.assert_allclose(read[0], cpu_read[0], rtol=1e-5)


def test_replicated_unpipelined_ipu_models_average_their_statistics_updates(monkeypatch):
  """prepare_model shares the statistics where replicas keep copies: unpipelined, R > 1 (a pipelined
  model normalises by batch statistics or is warned about, and one replica has one copy)."""
  _install_cross_replica_mean(monkeypatch, lambda x, replica_group_size=None, name=None: x)

  def shared(**kwargs):
    backend = ipu_backend.create(_config(**kwargs))
    with backend.strategy.scope():
      inputs = tf.keras.Input((3,))
      hidden = tf.keras.layers.Dense(4, name="hidden")(inputs)
      net = tf.keras.Model(inputs, tf.keras.layers.BatchNormalization(name="bn")(hidden))
      net = backend.prepare_model(net, ("hidden",))
    return "_assign_moving_average" in vars(net.get_layer("bn"))

  assert shared(replicas=2) and shared(replicas=4, gradient_accumulation=2)
  assert not shared(replicas=1)
  assert not shared(replicas=2, ipus_per_replica=2, pipeline_stages=2, gradient_accumulation=4)


# --- Adam: PyTorch's epsilon on IPUs too --------------------------------------------------------------

class _AdamIpuOptimizer(optimizers._legacy_adam_class()):  # pylint: disable=protected-access
  """AdamIpuOptimizer's arithmetic (see the module docstring): Keras' Adam slots, its own update, in
  float32: m_hat / (sqrt(v_hat) + epsilon) with bias-corrected m_hat and v_hat."""

  def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7, amsgrad=False,
               name="Adam", m_dtype=None, v_dtype=None, vhat_dtype=None, debiasing=True, **kwargs):
    del m_dtype, v_dtype, vhat_dtype, debiasing
    super().__init__(learning_rate=learning_rate, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon,
                     amsgrad=amsgrad, name=name, **kwargs)

  def _prepare_local(self, var_device, var_dtype, apply_state):
    super()._prepare_local(var_device, var_dtype, apply_state)
    local_step = tf.cast(self.iterations + 1, tf.float32)
    beta_1_t = tf.identity(self._get_hyper("beta_1", tf.float32))
    beta_2_t = tf.identity(self._get_hyper("beta_2", tf.float32))
    apply_state[(var_device, var_dtype)].update(dict(
        epsilon=tf.convert_to_tensor(self.epsilon, tf.float32), beta_1_t=beta_1_t, beta_2_t=beta_2_t,
        beta_1_power=tf.pow(beta_1_t, local_step), beta_2_power=tf.pow(beta_2_t, local_step)))

  def _resource_apply_dense(self, grad, var, apply_state=None):
    coefficients = ((apply_state or {}).get((var.device, var.dtype.base_dtype))
                    or self._fallback_apply_state(var.device, var.dtype.base_dtype))
    m, v = self.get_slot(var, "m"), self.get_slot(var, "v")
    next_m = m * coefficients["beta_1_t"] + grad * (1.0 - coefficients["beta_1_t"])
    next_v = v * coefficients["beta_2_t"] + tf.square(grad) * (1.0 - coefficients["beta_2_t"])
    m_hat = next_m / (1.0 - coefficients["beta_1_power"])
    v_hat = next_v / (1.0 - coefficients["beta_2_power"])
    update = m_hat / (tf.sqrt(v_hat) + coefficients["epsilon"])
    return tf.group(var.assign(var - coefficients["lr_t"] * update), m.assign(next_m), v.assign(next_v))


def _torch_adam(gradients, lr, eps=1e-8, beta_1=0.9, beta_2=0.999):
  """torch.optim.Adam's update in float64: the weights after each step, from 0."""
  weight, m, v, out = 0.0, 0.0, 0.0, []
  for t, g in enumerate(gradients, 1):
    m, v = beta_1 * m + (1 - beta_1) * g, beta_2 * v + (1 - beta_2) * g * g
    weight = weight - lr / (1 - beta_1 ** t) * m / (np.sqrt(v) / np.sqrt(1 - beta_2 ** t) + eps)
    out.append(weight)
  return np.array(out)


def _trained(optimizer, gradients):
  """A weight of 0 after one step per gradient (a small-gradient weight, as a batch-norm scale)."""
  weight = tf.Variable(np.zeros_like(gradients[0]), dtype=tf.float32)
  steps = []
  for g in gradients:
    optimizer.apply_gradients([(tf.constant(g, tf.float32), weight)])
    steps.append(weight.numpy().copy())
  return np.array(steps)


def test_ipu_adam_with_sixteen_bit_weights_makes_the_other_backends_steps(monkeypatch):
  """--precision=16.16 --optimizer=adam on IPUs builds AdamIpuOptimizer, which adds epsilon to the
  bias-corrected sqrt(v), PyTorch's place: given PyTorch's 1e-8 it steps as the CPU/GPU Adam and
  torch.optim.Adam do. Its default 1e-7 would move small-gradient weights measurably less."""
  fake_ipu.install(monkeypatch)
  for name, module in fake_ipu.build_addons().items():
    monkeypatch.setitem(sys.modules, name, module)
  monkeypatch.setattr(sys.modules["ipu_tensorflow_addons.keras.optimizers"], "AdamIpuOptimizer",
                      _AdamIpuOptimizer)
  factories = ipu_backend.create(_config(replicas=2, precision="16.16")).optimizer_factories()
  ipu_adam = optimizers.make_optimizer("adam", 0.01, factories)
  assert isinstance(ipu_adam, _AdamIpuOptimizer) and ipu_adam.epsilon == optimizers.TORCH_ADAM_EPSILON
  rng = np.random.default_rng(3)
  # Weight 0 gets a steady gradient of 1e-8, the others random ones from about 1e-10 to 1e-4.
  gradients = [np.concatenate([[1e-8], rng.normal(0, 1e-6, 7) * np.logspace(-2, 2, 7)]) for _ in range(5)]
  ipu_steps = _trained(ipu_adam, gradients)
  np.testing.assert_allclose(ipu_steps, _trained(optimizers.make_optimizer("adam", 0.01), gradients),
                             rtol=1e-4, atol=1e-9)
  np.testing.assert_allclose(ipu_steps, _torch_adam(gradients, 0.01), rtol=1e-4, atol=1e-9)
  # With its own default epsilon, 1e-7, weight 0 would move 1e-8 / 1.1e-7 = 0.09 of the learning rate a
  # step instead of 1e-8 / 2e-8 = 0.5: 0.18 of the distance.
  own_epsilon = _trained(_AdamIpuOptimizer(learning_rate=0.01), gradients)
  np.testing.assert_allclose(own_epsilon[:, 0] / ipu_steps[:, 0], 1 / 1.1 / 5, rtol=1e-3)
  np.testing.assert_allclose(ipu_steps[:, 0], -0.005 * np.arange(1, 6), rtol=1e-4)


# --- The pipeline's stage rule ------------------------------------------------------------------------

def test_a_saved_config_with_fewer_stages_than_ipus_per_replica_is_refused(monkeypatch):
  """The rule flags.py applied alone now sits in pipeline_rules.pipeline_problem, which both call: IPU
  Keras would count a replica's IPUs from the stage mapping (extensions_base.py `_get_shard_count`)."""
  problem = pipeline_rules.pipeline_problem("grouped", 1, 2, 2)
  assert problem.startswith("--pipeline_stages")
  assert_names(problem, "at least", "--ipus_per_replica")
  assert pipeline_rules.pipeline_problem("grouped", 2, 2, 4) is None
  fake_ipu.install(monkeypatch)
  with pytest.raises(UserError) as caught:
    ipu_backend.create(_config(replicas=2, ipus_per_replica=2, pipeline_stages=1))
  assert_names(caught.value, "--pipeline_stages=1", "--ipus_per_replica=2")
  # flags.py's parse-time check is the same function: its message, with the numbers, on the command line.
  from absl import flags as absl_flags  # pylint: disable=import-outside-toplevel
  from absl.testing import flagsaver  # pylint: disable=import-outside-toplevel
  import flags  # pylint: disable=import-outside-toplevel
  flags.define_flags()
  with flagsaver.flagsaver(), pytest.raises(absl_flags.IllegalFlagValueError) as caught:
    absl_flags.FLAGS.unparse_flags()
    absl_flags.FLAGS(["main.py", "--backend=ipu", "--ipus_per_replica=2", "--pipeline_stages=1",
                      "--gradient_accumulation=4"])
  assert_names(caught.value, "--pipeline_stages=1", "--ipus_per_replica=2")


# --- Poplar's device failures, wherever they surface --------------------------------------------------

# poplar_executor.cc (graphcore/tensorflow r2.6/sdk-release-2.6 to -3.4): AttachToPoplarDevice and
# FailureMessageAttachToTFDevice; TensorFlow adds the op on a line of its own.
_CAUSES = (" This device was expected to have 4 IPU(s). Common causes of this error include: incorrect "
           "configuration of your V-IPU partition, requesting more IPUs than are available on your system, "
           "or IPUs being used by another program. Use `gc-info -l` and `gc-monitor` to check your "
           "configuration.")
_DEVICE = "TensorFlow virtual device /device:IPU:0."
ATTACH_FAILURES = {
    "no matching device": tf.errors.InvalidArgumentError(
        None, None, "No device matches the requested configuration for " + _DEVICE + _CAUSES
        + "\n\t [[{{node StatefulPartitionedCall}}]]"),
    "busy": tf.errors.InternalError(
        None, None, "Graph execution error:\n\nCould not find an available device for " + _DEVICE + _CAUSES),
    "time-out": tf.errors.InternalError(
        None, None, "Timed out trying to find an available device for " + _DEVICE + _CAUSES
        + "\n\t [[{{node StatefulPartitionedCall}}]] [Op:__inference_train_function_123]"),
}


@pytest.mark.parametrize("case", sorted(ATTACH_FAILURES))
def test_attach_failures_in_fit_and_evaluate_are_one_line(monkeypatch, case):
  """With on_demand (the default) the IPUs are attached at the first execution
  (poplar_executable.cc), so the failure comes out of fit or evaluate: through the training loop's
  calls it is one line with Poplar's reason, not an XLA traceback."""
  from training import loop  # pylint: disable=import-outside-toplevel
  fake_ipu.install(monkeypatch)
  backend = ipu_backend.create(_config(replicas=2))
  error = ATTACH_FAILURES[case]

  def fail(*args, **kwargs):
    raise error

  net = types.SimpleNamespace(fit=fail, evaluate=fail, non_trainable_weights=[])
  split = types.SimpleNamespace(dataset=tf.data.Dataset.range(4), steps=2,
                                epochs_from=lambda *args: tf.data.Dataset.range(4))
  splits = types.SimpleNamespace(train=split, validation=split, test=split)
  config = _config(replicas=2, epochs=1)
  for call in (lambda: loop._fit(net, config, backend, splits, 0, 0, []),  # pylint: disable=protected-access
               lambda: loop._evaluate_test(net, backend, splits, 0)):  # pylint: disable=protected-access
    with pytest.raises(UserError) as raised:
      call()
    line = str(raised.value)
    assert line.startswith("--backend=ipu: ")
    assert "\n" not in line and "[[" not in line and "Graph execution error" not in line
    assert (" for " + _DEVICE) in line and "gc-info -l" in line
    assert ("on_demand_device_timeout" in line) == (case == "time-out")


def test_other_errors_and_other_backends_pass_through(monkeypatch):
  fake_ipu.install(monkeypatch)
  backend = ipu_backend.create(_config())
  other = tf.errors.InvalidArgumentError(None, None, "Incompatible shapes: [2,3] vs. [2,4]")
  with pytest.raises(tf.errors.InvalidArgumentError, match="Incompatible shapes"):
    with backend.device_errors():
      raise other
  from strategies.backend import Backend  # pylint: disable=import-outside-toplevel
  with pytest.raises(tf.errors.InternalError):
    with Backend(kind="cpu", strategy=tf.distribute.get_strategy(), devices=("/cpu:0",)).device_errors():
      raise ATTACH_FAILURES["busy"]


def test_configuring_with_always_translates_the_same_failures(monkeypatch):
  """--ipu_connection=always attaches in configure_ipu_system: the same one line there."""
  fake_ipu.install(monkeypatch)
  monkeypatch.setattr(fake_ipu, "FAIL_CONFIGURE", "Could not find an available device for " + _DEVICE + _CAUSES)
  with pytest.raises(UserError, match="^--backend=ipu: ") as caught:
    ipu_backend.create(_config(ipu_connection="always"))
  assert_names(caught.value, "available device", "TensorFlow")


# --- --backend=auto: only where an IPU is listed ------------------------------------------------------

# `gc-info --list-devices` on an IPU-POD (Graphcore's command-line tools guide, gc-info).
LISTING = """Graphcore device listing:
Partition: p1 [active]
-+- Id: [0], target: [Fabric], IPU-M host: [10.1.5.10], IPU#: [3]
-+- Id: [1], target: [Fabric], IPU-M host: [10.1.5.10], IPU#: [2]
-+- Id: [4], target: [Multi IPU]
 |--- Id: [0], DNC Id: [0], IPU-M host: [10.1.5.10], IPU#: [3]
 |--- Id: [1], DNC Id: [1], IPU-M host: [10.1.5.10], IPU#: [2]
"""


def _gc_info(tmp_path, monkeypatch, output: str, status: int = 0):
  script = tmp_path / "gc-info"
  script.write_text("#!/bin/sh\n[ \"$1\" = --list-devices ] || exit 9\ncat <<'EOF'\n%sEOF\nexit %d\n"
                    % (output, status))
  script.chmod(script.stat().st_mode | stat.S_IEXEC)
  monkeypatch.setenv("PATH", "%s:%s" % (tmp_path, os.environ["PATH"]))


@pytest.mark.parametrize("output, status, present", [
    (LISTING, 0, True),
    ("Graphcore device listing:\n", 0, False),           # an SDK host outside any partition
    ("", 1, False),                                        # gc-info failing
])
def test_auto_takes_the_ipu_only_where_gc_info_lists_a_device(monkeypatch, tmp_path, output, status,
                                                             present):
  from strategies import select  # pylint: disable=import-outside-toplevel
  fake_ipu.install(monkeypatch)  # Graphcore's TensorFlow importable
  monkeypatch.delenv("TF_POPLAR_FLAGS", raising=False)
  monkeypatch.setenv("IPUOF_CONFIG_PATH", str(tmp_path / "ipuof.conf"))  # an SDK host's set-up
  _gc_info(tmp_path, monkeypatch, output, status)
  assert ipu_backend.present() is present
  assert (select.resolve_kind("auto") == "ipu") is present


def test_the_ipu_model_counts_and_no_tools_no_config_is_no_ipu(monkeypatch, tmp_path):
  fake_ipu.install(monkeypatch)
  monkeypatch.setenv("PATH", str(tmp_path))  # no gc-info
  monkeypatch.delenv("IPUOF_CONFIG_PATH", raising=False)
  monkeypatch.setenv("TF_POPLAR_FLAGS", "--use_ipu_model")
  assert ipu_backend.present()
  monkeypatch.delenv("TF_POPLAR_FLAGS")
  if not os.path.isdir("/etc/ipuof.conf.d"):
    assert not ipu_backend.present()
  assert ipu_backend.lists_a_device(LISTING) and not ipu_backend.lists_a_device("Graphcore device listing:\n")
