"""Backend selection: CPU replicas as logical devices, clear errors for missing GPUs and IPU software."""

import dataclasses
import inspect
import json
import os
import subprocess
import sys
import tempfile

import pytest
import tensorflow as tf

from data.splits import eval_layout
from errors import UserError
from host import cpuinfo
from run_config import RunConfig
import model
from strategies import cpu, environment, gpu, ipu, multiworker, select
from strategies import precision as precision_lib
from strategies.backend import Hardware
from tests.support.helpers import REPO_ROOT, assert_names


def test_auto_picks_cpu_here():
  if tf.config.list_physical_devices("GPU"):
    pytest.skip("this machine has a GPU")
  assert select.resolve_kind("auto") == "cpu"


def test_one_cpu_replica_uses_the_default_strategy():
  backend = select.select_backend(RunConfig(model="mnist", backend="cpu", replicas=1))
  assert backend.strategy is tf.distribute.get_strategy() and not tf.distribute.has_strategy()
  assert backend.replicas == 1 and backend.label == "CPU"


def test_two_cpu_replicas_keep_one_copy_of_the_variables_and_compute_on_two_logical_devices():
  backend = select.select_backend(RunConfig(model="mnist", backend="cpu", replicas=2))
  assert isinstance(backend.strategy, tf.distribute.experimental.CentralStorageStrategy)
  with backend.strategy.scope():
    variable = tf.Variable(1.0)
  assert len(backend.strategy.experimental_local_results(variable)) == 1   # not one per replica
  assert backend.replicas == 2 and len(set(backend.devices)) == 2
  # tf.distribute splits a short global batch too: evaluation reads every sample (training never).
  assert eval_layout(backend.layout(16)).keeps_tail and not backend.layout(16).keeps_tail
  # The replicas really compute separately: each sees its own replica id.
  ids = backend.strategy.run(lambda: tf.distribute.get_replica_context().replica_id_in_sync_group)
  assert sorted(int(t) for t in backend.strategy.experimental_local_results(ids)) == [0, 1]


def test_cpu_replicas_with_gradient_accumulation_keep_mirrored_strategy():
  backend = select.select_backend(RunConfig(model="mnist", backend="cpu", replicas=2,
                                            gradient_accumulation=2))
  assert isinstance(backend.strategy, tf.distribute.MirroredStrategy)
  assert backend.replicas == 2 and len(set(backend.devices)) == 2


def test_jit_compile_is_refused_with_several_cpu_replicas_and_where_keras_lacks_it():
  with pytest.raises(UserError, match="--jit_compile"):  # one CPU replica only, or Keras lacks it
    select.select_backend(RunConfig(model="mnist", backend="cpu", replicas=2, jit_compile=True))
  one = RunConfig(model="mnist", backend="cpu", replicas=1, jit_compile=True)
  if "jit_compile" in inspect.signature(tf.keras.Model.compile).parameters:   # Keras 2.8 on
    assert select.select_backend(one).compile_kwargs(10)["jit_compile"] is True
  else:                                                                           # TensorFlow 2.6
    with pytest.raises(UserError) as caught:
      select.select_backend(one)
    assert_names(caught.value, "--jit_compile", "compile(jit_compile=")


def test_replica_input_pipelines_are_not_autotuned():
  """An autotuned per-device pipeline stalls the end of every fit (strategies/device_pipelines.py)."""
  backend = select.select_backend(RunConfig(model="mnist", backend="cpu", replicas=2))
  iterator = iter(backend.strategy.experimental_distribute_dataset(tf.data.Dataset.range(8).batch(4)))
  device_iterators = iterator._iterators[0]._iterator._device_iterators  # pylint: disable=protected-access
  assert len(device_iterators) == 2
  for device_iterator in device_iterators:
    options = device_iterator._dataset.options()  # pylint: disable=protected-access
    autotune = options.autotune.enabled if hasattr(options, "autotune") else \
        options.experimental_optimization.autotune
    assert autotune is False


def test_too_many_cpu_replicas_after_start_is_a_clear_error():
  tf.config.list_logical_devices("CPU")  # TensorFlow's runtime starts here, whatever ran before in this worker
  with pytest.raises(UserError) as caught:
    select.select_backend(RunConfig(model="mnist", backend="cpu", replicas=8))
  assert_names(caught.value, "--replicas=8", "8 logical CPU devices")


@pytest.mark.parametrize("replicas, cores, environ, threads", [
    (4, 2, {}, (1, 4)), (2, 2, {}, (1, 2)), (8, 8, {}, (1, 8)),
    (1, 1, {}, None), (1, 2, {}, None), (2, 4, {}, None),          # fewer replicas than cores: TF's
    (4, 2, {"TF_NUM_INTRAOP_THREADS": "2"}, None),                  # the user's choice stands
    (4, 2, {"TF_NUM_INTEROP_THREADS": "8"}, None), (4, 2, {"TF_NUM_INTRAOP_THREADS": ""}, (1, 4))])
def test_replicas_on_as_many_cores_run_their_ops_side_by_side(replicas, cores, environ, threads):
  assert cpu.side_by_side_threads(replicas, cores, environ) == threads


def test_gpu_replicas_need_visible_gpus():
  visible = len(tf.config.list_physical_devices("GPU"))
  wanted = visible + 1
  hint = "no NVIDIA device" if not environment.nvidia_device_nodes() else "CUDA_VISIBLE_DEVICES"
  with pytest.raises(UserError) as caught:
    select.select_backend(RunConfig(model="mnist", backend="gpu", replicas=wanted))
  assert_names(caught.value, "--replicas=%d" % wanted, "%d %s" % (wanted, "GPU" if wanted == 1 else "GPUs"),
               "sees %d" % visible, hint)


def test_ipu_without_graphcore_tensorflow_says_what_to_install():
  assert not ipu.graphcore_tensorflow_available()
  with pytest.raises(UserError) as caught:
    select.select_backend(RunConfig(model="mnist", backend="ipu"))
  assert_names(caught.value, "--backend=ipu", "Graphcore's TensorFlow", "pip install")


def test_keras_is_version_2():
  assert select.keras_version().startswith("2.")
  assert os.environ["TF_USE_LEGACY_KERAS"] == "1"


def test_keras_started_without_pandas_and_scipy():
  """This process imported TensorFlow after environment.prepare (conftest.py), as main.py does."""
  for package in ("pandas", "scipy"):  # not imported: Keras went without
    assert package in sys.modules and sys.modules[package] is None, package
  assert tf.keras.Sequential([tf.keras.layers.Dense(2)])(tf.ones((1, 3))).shape == (1, 2)


_AVX2 = "fpu sse4_2 avx avx2 fma f16c"  # an AVX2-only CPU's flags, as /proc/cpuinfo lists them (a Zen 3)
_VNNI = _AVX2 + " avx512f avx512_vnni"   # a Cascade Lake's


@pytest.mark.parametrize("version, vendor, flags, user, expected", [
    ("2.6.3", "GenuineIntel", _AVX2, None, "1"),         # the Poplar SDK's version, from PyPI
    ("2.8.4", "GenuineIntel", _VNNI, None, "1"),
    ("2.6.3", "AuthenticAMD", _AVX2, None, None),        # its oneDNN crashed with SIGFPE on a Zen 4
    ("2.6.3", "GenuineIntel", _AVX2, "0", "0"),          # the user's choice is kept
    ("2.6.3", "AuthenticAMD", _AVX2, "1", "1"),
    ("2.9.0", "GenuineIntel", _VNNI, None, None),        # on by default there...
    ("2.21.0", "AuthenticAMD", _AVX2 + " avx512_bf16", None, None),
    ("2.21.0", "GenuineIntel", _AVX2 + " avx_vnni", None, None),
    ("2.21.0", "GenuineIntel", _AVX2 + " amx_tile", None, None),
    ("2.21.0", "AuthenticAMD", _AVX2, None, "1"),        # ...but off on an AVX2-only CPU, 2.5x slower
    ("2.9.0", "GenuineIntel", _AVX2 + " avx512f", None, "1"),  # AVX-512 without VNNI: off too
    ("2.21.0", "AuthenticAMD", _AVX2, "0", "0"),
    ("2.21.0", "", None, None, None),                    # not x86 (no flags): the build decides
    ("2.6.3+gc3.1.0+246224+2b7af067dae+amd_znver1", "GenuineIntel", _AVX2, None, None),  # Graphcore's wheel
])
def test_onednn_kernels_are_switched_on_where_tensorflow_had_them_off_by_default(monkeypatch, caplog, version,
                                                                                  vendor, flags, user, expected):
  monkeypatch.setattr(environment, "installed_tensorflow", lambda: version)
  processor = {"vendor_id": vendor} if flags is None else {"vendor_id": vendor, "flags": flags}
  monkeypatch.setattr(environment.cpuinfo, "first_processor", lambda: processor)
  # setenv first: delenv of an absent variable records nothing, so the value set below would outlive
  # the test and reach every process this worker starts (on an AMD CPU, a oneDNN that crashes).
  monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "")
  monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS")
  if user is not None:
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", user)
  environment.cpu_variables(RunConfig(model="mnist", backend="cpu"))
  assert os.environ.get("TF_ENABLE_ONEDNN_OPTS") == expected
  # Only the combination that crashed is warned of (kept: it is the user's choice).
  crashed = version == "2.6.3" and vendor == "AuthenticAMD" and user == "1"
  assert ("SIGFPE" in caplog.text) == crashed, caplog.text
  if crashed:
    assert_names(caplog.text, "TF_ENABLE_ONEDNN_OPTS=1", "TensorFlow 2.6.3", "AuthenticAMD")


def test_the_machine_signature_names_tensorflows_kernel_set_where_it_is_chosen(monkeypatch):
  """Autotune timings are keyed by the signature: timings of the Eigen kernels must not serve oneDNN's."""
  monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
  default = cpu.machine_signature()
  assert "TF_ENABLE_ONEDNN_OPTS" not in default
  monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "1")
  assert cpu.machine_signature() == default + "; TF_ENABLE_ONEDNN_OPTS=1"


# A fresh process started as main.py starts: the environment for a backend, then (for the CPU backend)
# TensorFlow's import with the garbage collector kept out of it, then what TensorFlow decided. One
# process serves the tests below (an import of TensorFlow is seconds of the suite's time).
_FRESH_PROCESS_SCRIPT = """
import gc, os, sys
from run_config import RunConfig
from strategies import environment
environment.prepare(RunConfig(model="mnist", backend=sys.argv[1]))
print(os.environ.get("TF_ENABLE_ONEDNN_OPTS"))
if sys.argv[1] == "cpu":
  with environment.imports_kept_from_the_collector():
    paused = not gc.isenabled()
    import tensorflow
  frozen = gc.get_freeze_count()
  with environment.imports_kept_from_the_collector():  # TensorFlow is in: the block runs untouched
    paused_again = not gc.isenabled()
  class Node: pass
  node = Node(); node.self = node; del node   # a cycle made after the import: still collected
  print(paused, frozen, paused_again, gc.get_freeze_count() == frozen, gc.isenabled(), gc.collect() > 0)
  from tensorflow.python.util import _pywrap_util_port
  print(_pywrap_util_port.IsMklEnabled())
"""


@pytest.fixture(scope="module")
def fresh_processes():
  """The output lines of _FRESH_PROCESS_SCRIPT for each backend, without a TF_ENABLE_ONEDNN_OPTS of ours."""
  env = {k: v for k, v in os.environ.items() if k != "TF_ENABLE_ONEDNN_OPTS"}
  return {backend: subprocess.run([sys.executable, "-c", _FRESH_PROCESS_SCRIPT, backend], cwd=REPO_ROOT, env=env,
                                  capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()
          for backend in ("cpu", "auto", "gpu")}


def test_the_cpu_start_up_runs_for_the_cpu_and_auto_backends_with_the_installed_tensorflow(fresh_processes):
  """In a fresh process, as main.py runs it: TensorFlow then runs oneDNN's kernels on this CPU, unless it
  is the TensorFlow 2.6 stack on an AMD CPU (Eigen's kept; make test-tf26); another backend's start-up
  leaves the variable alone. Before 2.9, IsMklEnabled() tells how TensorFlow was built, not what it runs
  (False for PyPI's wheels whatever the variable), so there the variable is what decides."""
  old_tensorflow = environment.installed_tensorflow_version() < environment.ONEDNN_DEFAULT_SINCE
  if old_tensorflow:
    amd = cpuinfo.generation()[0] == "AuthenticAMD"
    assert fresh_processes["cpu"][0] == ("None" if amd else "1"), fresh_processes
  else:
    assert fresh_processes["cpu"][2] == "True", fresh_processes
  assert fresh_processes["auto"] == fresh_processes["cpu"][:1], fresh_processes  # the variable of --backend=cpu
  assert fresh_processes["gpu"] == ["None"], fresh_processes


def test_environment_refuses_to_run_after_tensorflow_import():
  with pytest.raises(RuntimeError, match="before TensorFlow"):
    environment.prepare(RunConfig(model="mnist"))


def test_tensorflows_import_is_kept_from_the_garbage_collector(fresh_processes):
  """A fresh process (as main.py and the tools start): the collector is paused while TensorFlow is
  imported, its objects are then frozen, and later garbage is collected as before."""
  paused, frozen, paused_again, unchanged, enabled, collected = fresh_processes["cpu"][1].split()
  assert paused == "True" and int(frozen) > 100000  # TensorFlow's objects: about 660,000 with 2.21
  assert (paused_again, unchanged, enabled, collected) == ("False", "True", "True", "True")


def test_autographs_bytecode_is_removed_from_the_temporary_folder(tmp_path, monkeypatch):
  """A function AutoGraph converts becomes a module in the temporary folder, whose bytecode Python's
  import caches in its __pycache__, where it stayed after every run. The cleanup removes that bytecode
  and the folder it emptied; what other processes left there stays, and so does a folder not empty."""
  monkeypatch.setattr(sys, "dont_write_bytecode", False)      # as on a user's machine
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

  def count_down(n):
    while n > 0:        # a loop on a tensor: AutoGraph converts it
      n -= 1
    return n

  assert int(tf.autograph.to_graph(count_down)(tf.constant(3))) == 0
  cache = tmp_path / "__pycache__"
  assert len(list(cache.iterdir())) == 1, list(tmp_path.iterdir())
  environment.remove_autograph_bytecode()
  assert not cache.exists()

  def halve(n):
    if n > 1:           # a branch on a tensor
      n //= 2
    return n

  tf.autograph.to_graph(halve)(tf.constant(2))
  (cache / "another_process.cpython-38.pyc").write_bytes(b"")
  environment.remove_autograph_bytecode()
  assert [path.name for path in cache.iterdir()] == ["another_process.cpython-38.pyc"]


@pytest.mark.parametrize("precision, kind, policy", [
    ("32.32", "cpu", "float32"), ("16.32", "cpu", "mixed_bfloat16"), ("16.16", "cpu", "bfloat16"),
    ("16.32", "gpu", "mixed_float16"), ("16.32", "ipu", "mixed_float16"), ("16.16", "ipu", "float16"),
])
def test_precision_maps_to_keras_policies(precision, kind, policy):
  try:
    assert select.set_precision(precision, kind) == policy
    assert tf.keras.mixed_precision.global_policy().name == policy
  finally:
    tf.keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("requested, kind, native, resolved", [
    ("auto", "cpu", True, "16.32"), ("auto", "cpu", False, "32.32"), ("auto", "gpu", True, "16.32"),
    ("auto", "gpu", False, "32.32"), ("auto", "ipu", False, "16.32"), ("32.32", "cpu", True, "32.32"),
    ("16.16", "gpu", False, "16.16"),
])
def test_auto_precision_is_mixed_only_where_the_processor_has_16_bit_units(monkeypatch, requested, kind,
                                                                           native, resolved):
  monkeypatch.setattr(cpu, "bfloat16_outruns_float32", lambda: native)
  monkeypatch.setattr(cpu, "bfloat16_kernels_available", lambda: True)
  monkeypatch.setattr(gpu, "has_tensor_cores", lambda: native)
  assert select.resolve_precision(requested, kind) == resolved


def test_cpu_bfloat16_detection_reads_this_machines_cpu_flags(monkeypatch):
  monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
  monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
  with open("/proc/cpuinfo") as cpuinfo:
    flags = next(line for line in cpuinfo if line.startswith("flags")).split()
  assert cpu.has_bfloat16_units() == ("amx_bf16" in flags or "avx512_bf16" in flags)


@pytest.mark.parametrize("flags, vendor, outruns", [
    ({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "GenuineIntel", True),  # Sapphire Rapids
    ({"avx2", "avx512f", "avx512_bf16"}, "AuthenticAMD", True),                        # Zen 4
    ({"avx2", "avx512f", "avx512_bf16"}, "GenuineIntel", False),   # Intel, AMX absent or hidden
    ({"avx2", "avx512f"}, "GenuineIntel", False),
    ({"avx2"}, "AuthenticAMD", False),                                                  # Zen 1
])
def test_auto_precision_is_bfloat16_only_where_it_was_measured_faster_than_float32(flags, vendor, outruns):
  assert cpu.bfloat16_outruns_float32(flags, vendor) == outruns


def test_a_onednn_isa_cap_hides_the_features_it_caps():
  zen4 = {"fma", "avx2", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"}
  spr = zen4 | {"amx_bf16", "amx_tile"}
  assert cpu._cpu_flags(zen4, {"ONEDNN_MAX_CPU_ISA": "avx2"}) == {"fma", "avx2"}
  assert cpu._cpu_flags(spr, {"DNNL_MAX_CPU_ISA": "AVX512_CORE_BF16"}) == zen4
  assert cpu._cpu_flags(spr, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}) == zen4 - {"avx512_bf16"}
  assert cpu._cpu_flags(spr, {"ONEDNN_MAX_CPU_ISA": "ALL"}) == spr
  assert cpu._cpu_flags(spr, {}) == spr
  # What the capped CPU shows a model (its Hardware's cpu_features): an AVX2 CPU's, whose forms it then picks.
  assert cpu._cpu_flags(spr, {"ONEDNN_MAX_CPU_ISA": "AVX2"}) == {"fma", "avx2"}


def test_the_cpus_hardware_is_this_machine_as_onednn_sees_it(monkeypatch):
  monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
  hardware = cpu.hardware(precision_lib.FLOAT32)
  assert hardware == Hardware("cpu", precision_lib.FLOAT32, cpu.cpu_features(), cpuinfo.generation(),
                              cpu.machine_signature())
  assert hardware.cpu_features == frozenset(cpu._cpu_flags()) and not any(
      feature.startswith(("avx512", "amx")) for feature in hardware.cpu_features)


def test_cpu_generation_is_read_from_this_machine():
  vendor, family = cpuinfo.generation()
  with open("/proc/cpuinfo") as proc:
    text = proc.read()
  assert vendor and vendor in text and "cpu family\t: %d" % family in text


def test_every_backend_describes_its_hardware_at_its_precision():
  backend = cpu.create(RunConfig(model="mnist", backend="cpu", precision="32.32"))
  assert backend.hardware == cpu.hardware(backend.precision)
  fields = gpu._fields(RunConfig(model="mnist", backend="gpu", precision="16.32"))  # pylint: disable=protected-access
  assert fields["hardware"] == Hardware("gpu", precision_lib.MIXED) and "precision" not in fields
  # The precision has one owner, the Hardware; a backend made without one is its kind's processor in float32.
  bare = ipu.IPUBackend("ipu", tf.distribute.get_strategy(), ("/device:IPU:0",))
  assert bare.hardware == Hardware("ipu", precision_lib.FLOAT32) and bare.precision == precision_lib.FLOAT32
  half = dataclasses.replace(bare, hardware=Hardware("ipu", precision_lib.HALF))
  assert half.precision == precision_lib.HALF


def test_auto_precision_stays_float32_where_tensorflow_lacks_cpu_bfloat16_kernels(monkeypatch):
  monkeypatch.setattr(cpu, "has_bfloat16_units", lambda: True)
  monkeypatch.setattr(cpu, "bfloat16_kernels_available", lambda: False)
  assert select.resolve_precision("auto", "cpu") == "32.32"
  with pytest.raises(UserError) as caught:
    cpu.check_precision("16.32")
  assert_names(caught.value, "--precision=16.32", "TensorFlow >= 2.9")


@pytest.mark.parametrize("flags, vendor, cap, outcome", [
    ("fma avx2 avx512f avx512_bf16", "AuthenticAMD", "", "runs"),        # a Zen 4: the units are there
    ("fma avx2 avx512f avx512_bf16", "AuthenticAMD", "AVX2", "refused"),  # the cap hides them from oneDNN
    ("fma avx2", "AuthenticAMD", "", "emulated"),                        # a Zen 1: TensorFlow emulates
    ("fma avx2 avx512f avx512_bf16", "GenuineIntel", "", "slower"),      # Intel without AMX
])
def test_bfloat16_is_refused_under_a_cap_that_hides_the_units_and_a_warning_where_it_is_slow(
    monkeypatch, flags, vendor, cap, outcome):
  monkeypatch.setattr(cpu, "bfloat16_kernels_available", lambda: True)
  monkeypatch.setattr(cpuinfo, "first_processor", lambda: {"flags": flags, "vendor_id": vendor})
  # The cap as the backend reads it, without setting the variable in this process: oneDNN reads it
  # once, at its first kernel, and later tests in this worker must not inherit a cap.
  monkeypatch.setattr(cpu, "_isa_cap", lambda environ=None: "" if environ == {} else cap)
  warnings = []
  monkeypatch.setattr(cpu.logging, "warning", lambda message, *args: warnings.append(message % args))
  if outcome == "refused":
    with pytest.raises(UserError, match="^--precision=16.32:") as caught:
      cpu.check_precision("16.32")
    assert_names(caught.value, "ONEDNN_MAX_CPU_ISA=AVX2", "bfloat16 units", "--precision=32.32")
    return
  cpu.check_precision("16.32")
  cpu.check_precision("32.32")
  assert [w.split(":")[0] for w in warnings] == (["--precision=16.32"] if outcome != "runs" else [])
  assert all({"emulated": "no bfloat16 units", "slower": "slower than float32"}[outcome] in w
             for w in warnings)


def test_cpu_bfloat16_kernels_are_known_from_the_tensorflow_version():
  major, minor = (int(part) for part in tf.__version__.split(".")[:2])
  assert cpu.bfloat16_kernels_available() == ((major, minor) >= (2, 9))


def test_backend_reports_the_resolved_precision():
  config, backend = select.settle(RunConfig(model="mnist", backend="cpu", precision="auto"))
  try:
    assert backend.precision.name in ("16.32", "32.32") and backend.precision.name == select.resolve_precision(
        "auto", "cpu") == config.precision
  finally:
    tf.keras.mixed_precision.set_global_policy("float32")


def test_a_precision_is_parsed_from_its_name_and_says_what_it_means():
  assert [precision_lib.parse(name).name for name in ("32.32", "16.32", "16.16")] == ["32.32", "16.32", "16.16"]
  single, mixed, half = (precision_lib.parse(name) for name in precision_lib.NAMES)
  assert (single.sixteen_bit, single.mixed, single.half_weights) == (False, False, False)
  assert (mixed.sixteen_bit, mixed.mixed, mixed.half_weights) == (True, True, False)
  assert (half.sixteen_bit, half.mixed, half.half_weights) == (True, False, True)
  assert precision_lib.parse(mixed) is mixed and str(mixed) == "16.32"
  for text in ("auto", "8.8", "16", None):
    with pytest.raises(ValueError, match="32.32, 16.32, 16.16"):
      precision_lib.parse(text)


def test_mixed_precision_model_keeps_float32_outputs():
  import model  # pylint: disable=import-outside-toplevel
  try:
    select.set_precision("16.32", "cpu")
    net = model.get_model_module("neuron_inverter").build(RunConfig(model="neuron_inverter", model_options={"design": "dev"}))
    assert net.get_layer("conv1").compute_dtype == "bfloat16"
    assert net.get_layer("conv1").dtype == "float32"            # weights stay float32
    assert net.output.dtype == tf.float32
  finally:
    tf.keras.mixed_precision.set_global_policy("float32")


def test_every_registered_backend_module_states_what_select_asks_of_it():
  import importlib  # pylint: disable=import-outside-toplevel
  import flags  # pylint: disable=import-outside-toplevel
  from strategies import registry  # pylint: disable=import-outside-toplevel
  assert flags.BACKENDS == ("auto",) + tuple(registry.BACKENDS)
  for kind, name in registry.BACKENDS.items():
    module = importlib.import_module(name)
    for precision in precision_lib.PRECISIONS.values():  # a policy for every precision it accepts
      try:
        module.check_precision(precision)
      except UserError:
        continue
      assert precision.name in module.POLICIES, (kind, precision)
    for function in ("present", "has_16bit_units", "check_precision", "create"):
      assert callable(getattr(module, function)), (kind, function)
  for kind, function in registry.START_UP.items():   # set before TensorFlow loads, TensorFlow-free
    assert kind in registry.BACKENDS and callable(getattr(environment, function)), (kind, function)
  for kind in registry.FLAG_RULES:
    values = {"backend": kind, "replicas": 1, "ipus_per_replica": 1, "precision": "auto"}
    assert kind in registry.BACKENDS and registry.flag_problem(values) is None, kind


def test_a_backends_flag_rules_apply_to_it_alone():
  from strategies import registry  # pylint: disable=import-outside-toplevel
  values = {"replicas": 3, "ipus_per_replica": 1, "precision": "auto"}
  assert "powers of two" in registry.flag_problem(dict(values, backend="ipu"))
  assert registry.flag_problem(dict(values, backend="cpu")) is None


def test_a_registry_entry_without_its_module_is_named(monkeypatch):
  from strategies import registry  # pylint: disable=import-outside-toplevel
  monkeypatch.setitem(registry.BACKENDS, "cpu", "strategies.no_such_module")
  with pytest.raises(UserError) as caught:
    select.backend_module("cpu")
  assert_names(caught.value, "registry.py", "'strategies.no_such_module'", "backend 'cpu'")


def test_resolve_settles_auto_before_the_backend_is_built():
  config = select.resolve(RunConfig(model="mnist", backend="auto", precision="auto"))
  assert config.backend == select.resolve_kind("auto") and config.precision in ("16.32", "32.32")
  assert config.precision == select.resolve_precision("auto", config.backend)
  assert select.resolve(config) == config


@pytest.mark.parametrize("updates_moving_statistics, requested, settled", [
    (False, "auto", "batch"), (True, "auto", "moving"), (False, "moving", "moving"), (True, "batch", "batch")])
def test_batch_norm_statistics_are_each_batchs_own_only_where_moving_ones_cannot_be_kept(
    updates_moving_statistics, requested, settled):
  """The model settles its own "auto" option from a fact of the hardware (Hardware.updates_moving_statistics,
  False in pipelined IPU training: keras/ipu/extensions/extensions_base.py); select.resolve leaves it."""
  config = select.resolve(RunConfig(model="neuron_inverter", backend="cpu",
                                    model_options={"batch_norm_statistics": requested}))
  assert config.model_options == {"batch_norm_statistics": requested}
  hardware = Hardware(device="cpu", precision=precision_lib.FLOAT32,
                      updates_moving_statistics=updates_moving_statistics)
  settled_config = model.settle_options(config, hardware)
  assert settled_config.model_options == {"design": "ontra4", "batch_norm_statistics": settled}


def test_a_worker_alone_keeps_the_runs_precision_and_hardware_choices():
  """--predict after a multi-worker run evaluates in one process at the precision it trained with."""
  from strategies.multiworker import MultiWorkerBackend  # pylint: disable=import-outside-toplevel
  worker = MultiWorkerBackend("cpu", tf.distribute.get_strategy(), ("/cpu:0", "/cpu:1"), replicas=4,
                              gradient_accumulation=2, rank=0, world_size=2,
                              local_replicas=2, hardware=Hardware("cpu", precision_lib.MIXED, frozenset({"avx2"}),
                                                                  ("AuthenticAMD", 25), "a cpu"))
  alone = worker.alone()
  assert type(alone).__name__ == "Backend" and alone.world_size == 1 and alone.replicas == 1
  assert alone.devices == ("/cpu:0",) and alone.gradient_accumulation == 1
  assert alone.precision == precision_lib.MIXED and alone.hardware == worker.hardware


def test_the_config_holds_what_the_backend_decided(tmp_path):
  """run_config.yaml, the HParams row and summary.yaml's params record the config: after the start it
  holds the backend's kind, precision, replicas of all workers, steps per execution, stages and cache."""
  from strategies.multiworker import MultiWorkerBackend  # pylint: disable=import-outside-toplevel
  worker = MultiWorkerBackend("cpu", tf.distribute.get_strategy(), ("/cpu:0",), replicas=4, world_size=4,
                              hardware=Hardware("cpu", precision_lib.MIXED), cache_dir=None, local_replicas=1)
  typed = RunConfig(model="neuron_inverter", backend="auto", precision="auto", pipeline_stages=2,
                    cache_dir=str(tmp_path / "cache"))
  settled = select.config_with_decisions(typed, worker)
  assert (settled.backend, settled.precision, settled.replicas, settled.steps_per_execution,
          settled.pipeline_stages, settled.cache_dir) == ("cpu", "16.32", 4, 1, 1, typed.cache_dir)
  assert dataclasses.replace(settled, backend="auto", precision="auto", replicas=1, steps_per_execution=0,
                             pipeline_stages=2) == typed  # nothing else changes
  # IPUs place the stages, and derive the steps per execution when compiling (0 stays 0).
  pipelined = ipu.IPUBackend("ipu", tf.distribute.get_strategy(), ("/device:IPU:0",), replicas=2,
                             steps_per_execution=0, pipeline_stages=2)
  settled = select.config_with_decisions(typed, pipelined)
  assert (settled.backend, settled.replicas, settled.steps_per_execution, settled.pipeline_stages) == ("ipu", 2, 0, 2)
  # The executable cache in effect: XLA's inside --cache_dir keeps it; one elsewhere (poprun's) replaces it.
  xla = dataclasses.replace(worker, cache_dir=str(tmp_path / "cache" / "xla"))
  assert select.config_with_decisions(typed, xla).cache_dir == typed.cache_dir
  poprun = dataclasses.replace(worker, cache_dir="/popdist/cache")
  assert select.config_with_decisions(typed, poprun).cache_dir == "/popdist/cache"
  assert select.config_with_decisions(dataclasses.replace(typed, cache_dir=""), poprun).cache_dir == "/popdist/cache"


@pytest.mark.parametrize("fields, refused", [
    ({"model name": "QEMU Virtual CPU version 2.5+", "flags": "fpu sse sse2 ssse3 sse4_1 sse4_2"}, True),
    ({"model name": "AMD EPYC", "flags": "fpu sse4_2 avx avx2 fma"}, False),
    ({"model name": "Intel Sandy Bridge", "flags": "fpu sse4_2 avx"}, False),  # AVX without AVX2 runs
    ({"CPU implementer": "0x41", "Features": "fp asimd"}, False),             # ARM: nothing known
    ({}, False),                                                              # no /proc/cpuinfo
])
def test_a_cpu_without_avx_is_refused_before_tensorflow_is_imported(fields, refused):
  reason = cpuinfo.tensorflow_unsupported_reason(fields)
  if refused:
    assert_names(reason, "QEMU Virtual CPU", "AVX")
    assert "\n" not in reason
  else:
    assert reason is None


def _cgroup_tree(root, files: dict):
  for relative, text in files.items():
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize("proc_cgroup, files, quota", [
    # cgroup v2, a container's own cgroup seen as the root (docker --cpus=1.5)
    ("0::/\n", {"cpu.max": "150000 100000\n"}, 1.5),
    # cgroup v2 without a cgroup namespace: the job's folder and, tighter, its parent
    ("0::/system.slice/job.scope\n", {"system.slice/job.scope/cpu.max": "max 100000\n",
                                      "system.slice/cpu.max": "50000 100000\n"}, 0.5),
    # cgroup v1, the cpu controller mounted with cpuacct; -1 is "no quota"
    ("4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n",
     {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "200000\n", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
      "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, 2.0),
    ("4:cpu,cpuacct:/\n", {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
     None),
    ("0::/\n", {}, None),  # no cpu controller files
])
def test_the_cgroup_cpu_quota_is_read_from_v1_and_v2_trees(tmp_path, proc_cgroup, files, quota):
  _cgroup_tree(tmp_path / "fs", files)
  (tmp_path / "cgroup").write_text(proc_cgroup)
  assert cpuinfo.cgroup_cpu_quota(str(tmp_path / "cgroup"), str(tmp_path / "fs")) == quota


def test_usable_cores_are_the_affinity_capped_by_the_quota(tmp_path, monkeypatch):
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
  _cgroup_tree(tmp_path / "fs", {"cpu.max": "150000 100000\n"})
  (tmp_path / "cgroup").write_text("0::/\n")
  assert cpuinfo.usable_cores(str(tmp_path / "cgroup"), str(tmp_path / "fs")) == 2   # 1.5 cores: 2 threads
  assert cpuinfo.usable_cores(str(tmp_path / "missing"), str(tmp_path / "fs")) == 8


# --- Multi-worker clusters from the environment -----------------------------------------------------------

_TWO_WORKERS = {"worker": ["127.0.0.1:20001", "127.0.0.1:20002"]}


@pytest.mark.parametrize("tf_config, names", [
    ("[1, 2]", ["JSON object"]),
    ({"cluster": {"worker": "127.0.0.1:20001"}}, ["cluster", "host:port strings"]),
    ({"cluster": {"worker": [20001, 20002]}}, ["cluster", "host:port strings"]),
    ({"cluster": _TWO_WORKERS}, ['needs "task"']),
    ({"cluster": _TWO_WORKERS, "task": {"type": "chief", "index": 0}}, ['needs "task"', "one of worker"]),
    ({"cluster": _TWO_WORKERS, "task": {"type": "worker", "index": 5}}, ["index 5", "2 worker task", "0 to 1"]),
    ({"cluster": _TWO_WORKERS, "task": {"type": "worker", "index": "1"}}, ["index '1'"])])
def test_a_malformed_tf_config_is_one_user_error(monkeypatch, tf_config, names):
  """TensorFlow's resolver would fail on each of these with a traceback (AttributeError, ValueError)."""
  monkeypatch.setenv("TF_CONFIG", tf_config if isinstance(tf_config, str) else json.dumps(tf_config))
  with pytest.raises(UserError, match="TF_CONFIG ") as caught:
    multiworker.cluster_source()
  assert_names(caught.value, *names)


def test_a_well_formed_tf_config_names_its_source(monkeypatch):
  monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": _TWO_WORKERS, "task": {"type": "worker", "index": 1}}))
  assert multiworker.cluster_source() == "tf_config"
  monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["127.0.0.1:20001"]}}))  # one worker
  assert multiworker.cluster_source() is None


@pytest.mark.parametrize("variables, name", [
    ({"SLURM_STEP_NUM_TASKS": "abc", "SLURM_PROCID": "0"}, "SLURM_STEP_NUM_TASKS"),
    ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "x", "SLURM_STEP_NODELIST": "localhost",
      "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_JOB_ID": "7"}, "SLURM_PROCID"),
    ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0", "SLURM_STEP_NODELIST": "localhost",
      "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_JOB_ID": "seven"}, "SLURM_JOB_ID")])
def test_slurm_variables_that_are_not_numbers_are_one_user_error(monkeypatch, variables, name):
  monkeypatch.delenv("TF_CONFIG", raising=False)
  for key, value in variables.items():
    monkeypatch.setenv(key, value)
  with pytest.raises(UserError) as caught:
    source = multiworker.cluster_source()
    multiworker.slurm_cluster.resolver("CPU") if source == "slurm" else None
  assert_names(caught.value, name + "=", "whole number")


def test_settings_for_another_backends_hardware_are_named_in_the_log():
  """--ipu_model and friends mean nothing on a CPU: not an error (an IPU user's flag file also serves CPU
  runs), but the log names them."""
  config = RunConfig(model="mnist", backend="cpu", precision="32.32", ipu_model=True,
                     available_memory_proportion=0.3)
  assert select.other_backends_settings(config) == {
      "ipu": ["--ipu_model=True", "--available_memory_proportion=0.3"]}
  assert select.other_backends_settings(dataclasses.replace(config, backend="ipu")) == {}
  assert select.other_backends_settings(RunConfig(model="mnist", backend="cpu")) == {}
