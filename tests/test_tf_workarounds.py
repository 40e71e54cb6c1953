"""The private TensorFlow and Keras names each workaround relies on (tf_workarounds.REGISTRY) are in the running
TensorFlow: an upgrade that removes one fails the test named after the workaround."""

import importlib
import inspect
import re

import pytest
import tensorflow as tf

import tf_workarounds


def _version(text: str) -> tuple:
  """(major, minor) of a version such as "2.21.0" or "2.6"."""
  return tuple(int(part) for part in re.match(r"(\d+)\.(\d+)", text).groups())


def _needed_with(versions, running: str) -> bool:
  first, last = versions
  return _version(first) <= _version(running) and (last is None or _version(running) <= _version(last))


def _module(modules):
  """The module of a registry name: `modules` (a name), or the first of its alternatives that imports."""
  alternatives = (modules,) if isinstance(modules, str) else modules
  for name in alternatives[:-1]:
    try:
      return importlib.import_module(name)
    except ImportError:
      pass
  return importlib.import_module(alternatives[-1])


def _has(owner, attribute: str) -> bool:
  """Whether `owner` has `attribute`; a class also where its own code gives its instances that attribute."""
  if hasattr(owner, attribute):
    return True
  return inspect.isclass(owner) and re.search(r"self\.%s\s*=" % attribute, inspect.getsource(owner)) is not None


def _found(modules, dotted: str) -> bool:
  """Whether the module of `modules` has the attribute `dotted` ("name", or "Class.name")."""
  try:
    owner = _module(modules)
    *path, attribute = dotted.split(".")
    for name in path:
      owner = getattr(owner, name)
  except (ImportError, AttributeError):
    return False
  return _has(owner, attribute)


@pytest.mark.parametrize("name", sorted(tf_workarounds.REGISTRY))
def test_the_private_names_a_workaround_relies_on_exist(name):
  entry = tf_workarounds.REGISTRY[name]
  if not _needed_with(entry["versions"], tf.__version__):
    pytest.skip("%s is not needed with TensorFlow %s" % (name, tf.__version__))
  missing = [(modules, dotted) for modules, dotted in entry["names"] if not _found(modules, dotted)]
  assert not missing, "the workaround %s relies on names this TensorFlow (%s) lacks: %s" % (
      name, tf.__version__, missing)


@pytest.mark.parametrize("name", sorted(tf_workarounds.REGISTRY))
def test_each_workaround_names_what_applies_it(name):
  module, _, attribute = tf_workarounds.REGISTRY[name]["where"].rpartition(".")
  assert hasattr(importlib.import_module(module), attribute)


@pytest.mark.parametrize("versions, running, needed", [
    (("2.6", None), "2.6.3", True), (("2.6", None), "2.21.0", True), (("2.6", "2.6"), "2.21.0", False),
    (("2.9", None), "2.6.3", False), (("2.6", "2.21"), "2.22.0rc1", False), (("2.6", "2.6"), "2.6.3", True)])
def test_a_version_range_includes_its_ends_and_their_patch_releases(versions, running, needed):
  assert _needed_with(versions, running) is needed


def test_instance_attributes_are_found_in_their_class_code_only():
  class Holder:
    def __init__(self):
      self._given = 1
  assert _has(Holder, "_given") and not _has(Holder, "_other")
