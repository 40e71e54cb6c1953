"""HPC launch tools: container definitions (parsed with spython), the container launcher (with a
stand-in `singularity`), Slurm/poprun scripts and the TensorBoard tunnel helper."""

import glob
import os
import shlex
import shutil
import stat
import subprocess
import sys

import pytest

from tests.support.helpers import REPO_ROOT, assert_names, assert_one_line_error

TOOLS = os.path.join(REPO_ROOT, "tools")


@pytest.mark.parametrize("name, base", [("ipu-tensorflow2.def", "graphcore/tensorflow:2"),
                                        ("tensorflow.def", "tensorflow/tensorflow:2.21.0-gpu")])
def test_definition_files_parse(name, base):
  parsers = pytest.importorskip("spython.main.parse.parsers")
  (recipe,) = parsers.SingularityParser(os.path.join(TOOLS, "containers", name)).recipe.values()
  assert recipe.fromHeader == base
  assert recipe.files == _files_lines(name)
  installs = " ".join(recipe.install)
  assert "pip install" in installs and "tensorflow-cpu" not in installs
  if "ipu" in name:  # never a PyPI TensorFlow over Graphcore's wheel, nor other versions of its packages
    assert "requirements-ipu.txt" in installs
    words = installs.split()
    assert words[words.index("/opt/neuron_inverter/requirements-sdk-constraints.txt") - 1] == "-c"
    assert recipe.install[-1] == "python3 -m pip check"
  assert shlex.split(recipe.cmd) == ["exec", "python3", "/opt/neuron_inverter/main.py", "$@"]


def _files_lines(name):
  """The lines of a definition file's %files section."""
  with open(os.path.join(TOOLS, "containers", name)) as definition:
    sections = definition.read().split("\n%")
  (files,) = [section for section in sections if section.startswith("files\n")]
  return [line.strip() for line in files.splitlines()[1:] if line.strip()]


def test_the_images_get_the_application_and_nothing_of_the_checkout(tmp_path):
  """%files copied as Apptainer does (internal/pkg/build/files/copy.go: the source globbed in the build's
  folder, a destination ending in '/' made a folder, then `cp -fLr`): the copy runs main.py on its own,
  and a checkout's .venv, logs and tests stay out (`%files . /opt/...` took them, gigabytes)."""
  lines = _files_lines("tensorflow.def")
  assert lines == _files_lines("ipu-tensorflow2.def")
  root = tmp_path / "rootfs"
  for line in lines:
    source, destination = line.split()
    assert destination.endswith("/")
    (root / destination.lstrip("/")).mkdir(parents=True, exist_ok=True)
    for path in glob.glob(os.path.join(REPO_ROOT, source)):
      subprocess.run(["cp", "-fLr", path, str(root / destination.lstrip("/"))], check=True)
  app = root / "opt" / "neuron_inverter"
  copied = set(os.listdir(app))
  needed = {entry for entry in os.listdir(REPO_ROOT)
            if entry.endswith(".py") or os.path.isfile(os.path.join(REPO_ROOT, entry, "__init__.py"))}
  assert needed - {"tests"} <= copied and {"requirements.txt", "requirements-ipu.txt", "configs"} <= copied
  assert "requirements-sdk-constraints.txt" in copied  # requirements-ipu.txt's -c line names it
  assert not copied & {".venv", ".venv-tf26", ".venv-torch", "logs", "tests", ".git", "docs"}
  result = subprocess.run([sys.executable, str(app / "main.py"), "--model=neuron_inverter", "--design=dev",
                           "--synthetic_data", "--epochs=1", "--steps_per_epoch=2", "--eval_steps=1",
                           "--logdir=" + str(tmp_path / "run")], cwd=str(tmp_path), capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert (tmp_path / "run" / "summary.yaml").exists()


def _stand_in(tmp_path, name):
  """An executable that records its arguments, one per line."""
  record = tmp_path / (name + ".args")
  path = tmp_path / "bin" / name
  path.parent.mkdir(exist_ok=True)
  path.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done > %s\n' % record)
  path.chmod(path.stat().st_mode | stat.S_IEXEC)
  return record


def _path_of(tmp_path, *tools):
  """A folder for PATH that holds only `tools` (links to this machine's), as `_stand_in` adds to it."""
  folder = tmp_path / "bin"
  folder.mkdir(exist_ok=True)
  for tool in tools:
    (folder / tool).symlink_to(shutil.which(tool))
  return folder

@pytest.mark.parametrize("has_compiler", [True, False])
def test_the_stock_image_gets_a_compiler_only_when_it_lacks_one(tmp_path, has_compiler):
  """The stock image's %post, run by `sh -e` as Apptainer runs it, with stand-ins for pip and apt-get:
  g++ (for the first conv block's CPU kernel) is installed when the base image has none, and only then."""
  folder = _path_of(tmp_path, "sh")
  pip_record = _stand_in(tmp_path, "python3")
  apt_record = _stand_in(tmp_path, "apt-get")
  if has_compiler:
    _stand_in(tmp_path, "g++")
  _stand_in(tmp_path, "rm")
  with open(os.path.join(TOOLS, "containers", "tensorflow.def")) as definition:
    (post,) = [section for section in definition.read().split("\n%") if section.startswith("post\n")]
  subprocess.run(["sh", "-e", "-c", post.split("\n", 1)[1]], env={"PATH": str(folder)}, check=True)
  assert "requirements.txt" in pip_record.read_text().split("\n")[-2]
  if has_compiler:
    assert not apt_record.exists()
  else:  # the last call: the stand-in keeps one call's arguments
    assert apt_record.read_text().split() == ["install", "-y", "--no-install-recommends", "g++"]


def test_container_launcher_forwards_everything(tmp_path):
  record = _stand_in(tmp_path, "singularity")
  env = dict(os.environ, PATH="%s:%s" % (tmp_path / "bin", os.environ["PATH"]), SINGULARITY="singularity",
             IMAGE="app.sif", DATA_DIR="/data", CACHE_DIR=str(tmp_path / "cache"),
             LOG_DIR=str(tmp_path / "logs"))
  (tmp_path / "app.sif").touch()
  subprocess.run([os.path.join(TOOLS, "run_container.sh"), "--model=neuron_inverter", "--replicas=4",
                  "--data_path=/data/x.h5"], env=env, check=True, cwd=str(tmp_path))
  args = record.read_text().split("\n")[:-1]
  ipuof = ["--bind", "/etc/ipuof.conf.d"] if os.path.isdir("/etc/ipuof.conf.d") else []
  cache, logs = str(tmp_path / "cache" / "neuron_inverter"), str(tmp_path / "logs")
  assert args == (["exec"] + ipuof + ["--bind", "/data:/data", "--bind", "%s:%s" % (cache, cache),
                                      "--bind", "%s:%s" % (logs, logs), "app.sif", "env",
                                      "XDG_CACHE_HOME=" + str(tmp_path / "cache"), "python3",
                                      "/opt/neuron_inverter/main.py", "--model=neuron_inverter",
                                      "--replicas=4", "--data_path=/data/x.h5"])


def test_container_launcher_runs_every_model(tmp_path):
  """With an `apptainer` that runs the container's command on this host (the image's /opt copy being
  this checkout): --model=mnist ran into main.py's "--data_cache is not used by --model=mnist", as the
  launcher passed --data_cache to every model. The caches still land in the bound CACHE_DIR."""
  runtime = tmp_path / "bin" / "apptainer"
  runtime.parent.mkdir()
  runtime.write_text('#!/bin/bash\nuntil [ "$1" = app.sif ]; do shift; done; shift\nargs=()\n'
                     'for a in "$@"; do case $a in python3) args+=(%s);; /opt/neuron_inverter/main.py) '
                     'args+=(%s);; *) args+=("$a");; esac; done\nexec "${args[@]}"\n'
                     % (shlex.quote(sys.executable), shlex.quote(os.path.join(REPO_ROOT, "main.py"))))
  runtime.chmod(0o755)
  (tmp_path / "app.sif").touch()
  env = dict(os.environ, PATH="%s:%s" % (runtime.parent, os.environ["PATH"]), IMAGE="app.sif",
             CACHE_DIR=str(tmp_path / "cache"), LOG_DIR=str(tmp_path / "logs"))
  env.pop("SINGULARITY", None)
  result = subprocess.run([os.path.join(TOOLS, "run_container.sh"), "--model=mnist", "--synthetic_data",
                           "--epochs=1", "--steps_per_epoch=2", "--eval_steps=1",
                           "--logdir=" + str(tmp_path / "logs" / "run")], env=env, cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  with open(str(tmp_path / "logs" / "run" / "run_config.yaml")) as f:
    config = f.read()
  assert "cache_dir: %s" % (tmp_path / "cache" / "neuron_inverter" / "executables") in config, config


def test_container_launcher_keeps_a_cache_dir_set_the_old_way(tmp_path):
  """CACHE_DIR named the application's cache folder before it named their root: such a folder called
  neuron_inverter is still used as it is; one under another name holding the caches is refused, not
  replaced by an empty CACHE_DIR/neuron_inverter (data generated and executables compiled again)."""
  record = _stand_in(tmp_path, "apptainer")
  (tmp_path / "app.sif").touch()
  old = tmp_path / "caches" / "neuron_inverter"
  (old / "executables").mkdir(parents=True)
  env = dict(os.environ, PATH="%s:%s" % (tmp_path / "bin", os.environ["PATH"]), IMAGE="app.sif",
             CACHE_DIR=str(old), LOG_DIR=str(tmp_path / "logs"))
  env.pop("SINGULARITY", None)
  subprocess.run([os.path.join(TOOLS, "run_container.sh"), "--model=mnist"], env=env, check=True,
                 cwd=str(tmp_path))
  args = record.read_text().split("\n")
  assert "%s:%s" % (old, old) in args and "XDG_CACHE_HOME=%s" % (tmp_path / "caches") in args
  renamed = tmp_path / "my_cache"
  old.rename(renamed)
  env["CACHE_DIR"] = str(renamed)
  result = subprocess.run([os.path.join(TOOLS, "run_container.sh"), "--model=mnist"], env=env,
                          capture_output=True, text=True, cwd=str(tmp_path), timeout=30)
  assert result.returncode == 1 and result.stderr.startswith("error: CACHE_DIR=%s " % renamed), result.stderr
  assert "caches directly" in result.stderr
  assert not (renamed / "neuron_inverter").exists()


@pytest.mark.parametrize("case", ["no runtime", "named runtime missing", "no image"])
def test_container_launcher_without_its_runtime_or_image_is_one_line(tmp_path, case):
  """Not `exec: singularity: not found` from bash's last line, nor the runtime's own failure later, and
  no cache or log folders made on the way."""
  folder = _path_of(tmp_path, "bash", "mkdir")  # without apptainer or singularity, whatever this machine has
  env = dict(os.environ, PATH=str(folder), IMAGE=str(tmp_path / "app.sif"), CACHE_DIR=str(tmp_path / "cache"),
             LOG_DIR=str(tmp_path / "logs"))
  expected = ["apptainer", "singularity", "PATH"]
  if case == "named runtime missing":
    env["SINGULARITY"] = "apptainer-1.3"
    expected = ["SINGULARITY=apptainer-1.3", "no such command"]
  elif case == "no image":
    _stand_in(tmp_path, "apptainer")
    expected = ["IMAGE=%s" % env["IMAGE"], "no such image"]
  result = subprocess.run([os.path.join(TOOLS, "run_container.sh"), "--model=mnist"], env=env,
                          capture_output=True, text=True, timeout=30)
  assert_one_line_error(result, *expected)
  assert not (tmp_path / "cache").exists() and not (tmp_path / "logs").exists()


def test_poprun_script_maps_to_our_flags(tmp_path):
  record = _stand_in(tmp_path, "poprun")
  env = dict(os.environ, PATH="%s:%s" % (tmp_path / "bin", os.environ["PATH"]), CACHE_DIR="/cache",
             POPRUN_ARGS="--vipu-partition=slurm_7 --vipu-server-host=10.1.3.101")
  subprocess.run([os.path.join(TOOLS, "slurm", "poprun.sh"), "2", "4", "2", "--pipeline_stages=2"],
                 env=env, check=True)
  assert record.read_text().split("\n")[:-1] == [
      "--vipu-partition=slurm_7", "--vipu-server-host=10.1.3.101", "--num-instances=2", "--num-replicas=4", "--ipus-per-replica=2", "--executable-cache-path=/cache",
      "python3", "main.py", "--model=neuron_inverter", "--backend=ipu", "--replicas=4",
      "--ipus_per_replica=2", "--pipeline_stages=2"]



def test_poprun_script_without_the_sdk_is_one_line(tmp_path):
  folder = _path_of(tmp_path, "bash")  # without poprun
  result = subprocess.run([os.path.join(TOOLS, "slurm", "poprun.sh"), "2", "4", "2"], capture_output=True,
                          text=True, env=dict(os.environ, PATH=str(folder)), timeout=30)
  assert_one_line_error(result, "poprun is not on the PATH", "Poplar SDK")


@pytest.mark.parametrize("script", ["ipu.sbatch", "gpu.sbatch", "poprun.sh", "scan.sbatch", "local_cluster.sh"])
def test_slurm_scripts_are_valid_bash(script):
  subprocess.run(["bash", "-n", os.path.join(TOOLS, "slurm", script)], check=True)


@pytest.mark.parametrize("script,status,args", [("ipu.sbatch", 143, ["--epochs=9", "--cell_name=a b"]),
                                                ("gpu.sbatch", 130, []), ("ipu.sbatch", 0, [])])
def test_a_job_script_gives_main_py_its_resubmission_and_keeps_the_status(tmp_path, script, status, args):
  """With a stand-in srun that shows what it was given: the job's sbatch command and flags, quoted for
  the shell, reach main.py (training/summary.py RESUBMIT_VARIABLE), and the job exits with srun's status."""
  fake = tmp_path / "srun"
  fake.write_text('#!/bin/sh\necho "resubmit: $NEURON_INVERTER_RESUBMIT"\nexit %d\n' % status)
  fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
  env = dict(os.environ, PATH="%s:%s" % (tmp_path, os.environ["PATH"]), SLURM_JOB_ID="77",
             SLURM_SUBMIT_DIR=str(tmp_path), APP_DIR="/app")
  result = subprocess.run(["bash", os.path.join(TOOLS, "slurm", script)] + args,
                          env=env, capture_output=True, text=True, timeout=30)
  assert result.returncode == status, result.stderr
  line = result.stdout.splitlines()[0]
  command = "IPUS=4 sbatch --ipus=4 /app/tools/slurm/" if script == "ipu.sbatch" else "sbatch /app/tools/slurm/"
  assert shlex.split(line) == ["resubmit:"] + shlex.split(command + script) + args, line
  assert ("TensorBoard: " in result.stdout) == (status == 0)


@pytest.mark.parametrize("ipus, args, expected", [
    (None, [], ["--ipus=4", "--replicas=4"]),
    ("8", ["--ipus_per_replica=2", "--pipeline_stages=2"], ["--ipus=8", "--replicas=4"]),
    ("8", ["--ipus_per_replica", "4", "--pipeline_stages=4"], ["--ipus=8", "--replicas=2"]),
    ("8", ["--ipus_per_replica=4", "--ipus_per_replica=2"], ["--ipus=8", "--replicas=4"]),  # the last wins
])
def test_the_ipu_job_trains_as_many_replicas_as_its_ipus_hold(tmp_path, ipus, args, expected):
  """srun asks for IPUS IPUs and main.py for IPUS / --ipus_per_replica replicas of that many each:
  together exactly the IPUs that `sbatch --ipus` reserved (a replica of 2 IPUs is half a replica
  per IPU)."""
  fake = tmp_path / "srun"
  fake.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\necho "resubmit: $NEURON_INVERTER_RESUBMIT"\n')
  fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
  env = dict(os.environ, PATH="%s:%s" % (tmp_path, os.environ["PATH"]), SLURM_JOB_ID="77",
             SLURM_SUBMIT_DIR=str(tmp_path), APP_DIR="/app")
  env.pop("IPUS", None)
  if ipus:
    env["IPUS"] = ipus
  result = subprocess.run(["bash", os.path.join(TOOLS, "slurm", "ipu.sbatch")] + args, env=env,
                          capture_output=True, text=True, timeout=30)
  assert result.returncode == 0, result.stderr
  given = result.stdout.splitlines()
  resubmit = next(line for line in given if line.startswith("resubmit: "))
  main_flags = given[given.index("/app/main.py") + 1:given.index(resubmit)]
  assert given[0] == expected[0] and [f for f in main_flags if f.startswith("--replicas=")] == expected[1:]
  assert main_flags[len(main_flags) - len(args):] == args  # the user's flags last: they win
  assert resubmit.split()[:4] == ["resubmit:", "IPUS=%s" % (ipus or "4"), "sbatch", "--ipus=%s" % (ipus or "4")]


@pytest.mark.parametrize("ipus, args", [("4", ["--ipus_per_replica=3"]), ("four", []),
                                        ("4", ["--ipus_per_replica=0"])])
def test_the_ipu_job_refuses_ipus_that_replicas_cannot_divide(tmp_path, ipus, args):
  fake = tmp_path / "srun"
  fake.write_text("#!/bin/sh\necho ran\n")
  fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
  env = dict(os.environ, PATH="%s:%s" % (tmp_path, os.environ["PATH"]), IPUS=ipus, SLURM_SUBMIT_DIR=str(tmp_path))
  result = subprocess.run(["bash", os.path.join(TOOLS, "slurm", "ipu.sbatch")] + args, env=env,
                          capture_output=True, text=True, timeout=30)
  assert result.returncode == 2 and "ran" not in result.stdout
  assert_one_line_error(result, "IPUS=%s" % ipus, "whole multiple", "--ipus_per_replica")


def test_tensorboard_tunnel_prints_the_ssh_command(tmp_path):
  result = subprocess.run([sys.executable, os.path.join(TOOLS, "tensorboard_tunnel.py"),
                           "--logdir=" + str(tmp_path), "--port=9998", "--login_host=login.example.org",
                           "--user=ann", "--nostart"], capture_output=True, text=True, check=True)
  import socket  # pylint: disable=import-outside-toplevel
  assert_names(result.stdout, "ssh -N -L 9998:%s:9998" % socket.gethostname(), "ann@login.example.org")
  assert "http://localhost:9998/" in result.stdout


@pytest.mark.parametrize("args, expected", [
    (["--port=70000"], ["tensorboard_tunnel.py: ", "--port=70000", "[1, 65535]"]),
    (["--nostart", "logs/run", "extra"], ["tensorboard_tunnel.py: ", "logs/run extra", "flags only"]),
])
def test_tensorboard_tunnel_refuses_bad_input_before_printing_the_ssh_line(tmp_path, args, expected):
  """A port out of range was printed in the ssh line, then refused by serve_tensorboard.py; stray
  words were ignored."""
  result = subprocess.run([sys.executable, os.path.join(TOOLS, "tensorboard_tunnel.py"),
                           "--logdir=" + str(tmp_path)] + args, capture_output=True, text=True, timeout=60)
  assert_one_line_error(result, *expected)
  assert result.returncode == 2 and result.stdout == ""


@pytest.mark.parametrize("port", [["--port", "99999"], ["--port=-1"]])
def test_serve_tensorboard_bounds_the_port_before_starting(tmp_path, port):
  """TensorBoard's own --port: its range said in one line, before TensorFlow's start (TensorBoard's
  own error came after it, in two lines)."""
  result = subprocess.run([sys.executable, os.path.join(TOOLS, "serve_tensorboard.py"), "--logdir",
                           str(tmp_path)] + port, capture_output=True, text=True, timeout=60)
  assert_one_line_error(result, "error: --port=%s" % port[-1].split("=")[-1], "0 to 65535")


def test_local_cluster_writes_a_slurm_conf_for_this_node(tmp_path):
  """The conf the one-node cluster runs on (tools/slurm/local_cluster.sh; `make test-slurm` starts it)."""
  script = os.path.join(TOOLS, "slurm", "local_cluster.sh")
  # The script's functions (everything above its `case` dispatcher), then write_conf alone.
  subprocess.run(["bash", "-c", 'source <(sed "/^case /,\\$d" "$1") && write_conf "$2"', "bash", script,
                  str(tmp_path)], check=True)
  conf = dict(line.split("=", 1) for line in (tmp_path / "slurm.conf").read_text().splitlines()
              if "=" in line and not line.startswith("#") and not line.startswith(("NodeName", "PartitionName")))
  assert conf["AuthInfo"] == "socket=%s/munge.socket" % tmp_path
  assert conf["StateSaveLocation"] == "%s/state" % tmp_path and conf["ProctrackType"] == "proctrack/linuxproc"
  assert "CPUs=%d" % len(os.sched_getaffinity(0)) in (tmp_path / "slurm.conf").read_text()
  bad = subprocess.run([script, "frobnicate"], capture_output=True, text=True)
  assert bad.returncode == 2 and "usage:" in bad.stderr
