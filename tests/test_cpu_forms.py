"""The Neuron-Inverter's choice of the forms of its conv blocks (model/neuron_inverter/cpu_forms.py): each
measured choice per CPU and precision, the forms --autotune may time, the defaults off CPUs; and that this
knowledge stays the model's (strategies/ names none of it)."""

import ast
import os

import pytest

import model
from model.neuron_inverter import cpu_forms, kernel_build
from model.neuron_inverter.designs import CONV_OPTION_DEFAULTS
from strategies import precision as precision_lib
from strategies.backend import Hardware

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AVX2, AVX512 = {"avx2", "fma"}, {"avx2", "fma", "avx512f", "avx512_bf16"}
AMX = {"avx2", "avx512f", "amx_bf16"}
ZEN1, ZEN4, XEON = ("AuthenticAMD", 23), ("AuthenticAMD", 25), ("GenuineIntel", 6)


def cpu(precision, features, generation=ZEN4):
  """A CPU's Hardware as strategies/cpu.py fills it."""
  return Hardware("cpu", precision_lib.parse(precision), frozenset(features), generation, "test cpu")


def test_16_bit_pads_channels_and_float32_does_not():
  assert cpu_forms.cpu_options(cpu("32.32", AVX2))["channel_multiple"] == 1
  assert cpu_forms.cpu_options(cpu("16.32", AMX))["channel_multiple"] == 32


def test_cpu_options_follow_the_measurements_per_cpu():
  def options(precision, features, generation):
    return cpu_forms.cpu_options(cpu(precision, features, generation))

  assert not options("32.32", AVX2, ZEN1)["input_grad_by_forward_conv"]
  assert options("16.32", AMX, XEON)["input_grad_by_forward_conv"]
  assert not options("32.32", AMX, XEON)["input_grad_by_forward_conv"]
  assert options("32.32", AVX2, ZEN1)["kernel_grad_by_matmul"]
  assert not options("32.32", AMX, XEON)["kernel_grad_by_matmul"]
  assert options("32.32", AVX2, ZEN1)["pooling"] == "maximum"
  assert options("32.32", AVX2, ZEN1)["phases_max_in_channels"] >= 4  # the 4-probe block
  assert options("16.32", AMX, ZEN1)["pooling"] == "max_pool"
  for other in (ZEN4, XEON):
    assert options("32.32", AVX2, other)["pooling"] == "max_pool"
    assert options("32.32", AVX2, other)["phases_max_in_channels"] == 0
  assert options("32.32", AVX2, ZEN4)["first_block_library"] == ""  # the op only where forms() builds it


def test_every_form_gives_every_builder_option_with_its_type():
  """tools/benchmark_forms.py and the summaries read them as the builder's options (designs.py)."""
  for hardware in (cpu("32.32", AVX2, ZEN1), cpu("16.32", AMX, XEON), cpu("32.32", AVX512, XEON)):
    chosen = cpu_forms.cpu_options(hardware)
    for form in (chosen,) + cpu_forms.alternatives(hardware, chosen):
      assert {name: type(value) for name, value in form.items()} == {
          name: type(value) for name, value in CONV_OPTION_DEFAULTS.items()}


@pytest.mark.parametrize("generation", [ZEN1, ZEN4])
def test_float32_alternatives_are_the_product_of_the_uncertain_choices_builtin_first(generation):
  hardware = cpu("32.32", AVX2, generation)
  chosen = cpu_forms.cpu_options(hardware)
  alternatives = cpu_forms.alternatives(hardware, chosen)
  assert len(alternatives) == 4 and alternatives[0] == chosen
  assert len({tuple(sorted(form.items())) for form in alternatives}) == 4
  assert {form["pooling"] for form in alternatives} == {"max_pool", "maximum"}
  assert {form["kernel_grad_by_matmul"] for form in alternatives} == {True, False}
  # The phases go with the maxima form, never with MaxPool.
  assert all((form["phases_max_in_channels"] > 0) == (form["pooling"] == "maximum") for form in alternatives)


def test_with_avx512_the_input_gradient_is_timed_instead_of_the_pooling():
  hardware = cpu("32.32", AVX512, XEON)
  chosen = cpu_forms.cpu_options(hardware)
  alternatives = cpu_forms.alternatives(hardware, chosen)
  assert len(alternatives) == 4 and alternatives[0] == chosen
  assert {(form["input_grad_by_forward_conv"], form["kernel_grad_by_matmul"]) for form in alternatives} == {
      (False, False), (False, True), (True, False), (True, True)}
  assert {form["pooling"] for form in alternatives} == {"max_pool"}  # MaxPool, measured on two CPUs


@pytest.mark.parametrize("features", [AVX2, AVX512])
def test_a_compiled_first_block_is_timed_against_the_builtin_forms_without_it(features, monkeypatch):
  """Measured on one AVX2 CPU only: one more form, the built-in one on TensorFlow's ops."""
  built = []
  monkeypatch.setattr(kernel_build, "conv_pool_library", lambda cache: built.append(cache) or "/k/op.so")
  forms = cpu_forms.forms(cpu("32.32", features))
  assert len(forms) == 5 and len(built) == 1
  assert forms[-1] == dict(forms[0], first_block_library="")
  assert all(form["first_block_library"] == "/k/op.so" for form in forms[:-1])


def test_sixteen_bit_has_one_form_and_no_op(monkeypatch):
  monkeypatch.setattr(kernel_build, "conv_pool_library", lambda cache: pytest.fail("built in 16 bits"))
  hardware = cpu("16.32", AVX512)
  assert cpu_forms.alternatives(hardware, cpu_forms.cpu_options(hardware)) == ()
  assert cpu_forms.forms(hardware) == (cpu_forms.cpu_options(hardware),)


@pytest.mark.parametrize("device", ["gpu", "ipu"])
def test_off_cpus_the_builder_defaults_alone(device, monkeypatch):
  monkeypatch.setattr(kernel_build, "conv_pool_library", lambda cache: pytest.fail("built off the CPU"))
  for precision in (precision_lib.FLOAT32, precision_lib.MIXED):
    assert cpu_forms.forms(Hardware(device, precision)) == (CONV_OPTION_DEFAULTS,)


def test_a_model_without_forms_of_its_own_has_one_empty_form():
  assert model.layer_forms(model.get_model_module("mnist"), cpu("32.32", AVX2)) == ({},)


def _strategies_sources() -> dict:
  folder, sources = os.path.join(ROOT, "strategies"), {}
  for name in sorted(os.listdir(folder)):
    if name.endswith(".py"):
      with open(os.path.join(folder, name)) as source:
        sources[name] = source.read()
  return sources


def test_strategies_hold_no_model_knowledge():
  """The hardware layer gives facts (Hardware); the forms of a model's layers, their option names and
  its kernels are the model's: strategies/ imports nothing of model/ and names no conv_ option."""
  for name, source in _strategies_sources().items():
    assert "conv_" not in source, name
    for node in ast.walk(ast.parse(source, name)):
      if isinstance(node, ast.Import):
        imported = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom):
        imported = [node.module or ""]
      else:
        continue
      assert not any(module == "model" or module.startswith("model.") for module in imported), (name, imported)
