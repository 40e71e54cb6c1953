"""The Neuron-Inverter's own options (flags of the same names; plain data, no TensorFlow)."""

from model.neuron_inverter.designs import DESIGNS
from model.options import AUTO, Option


def _batch_norm_statistics(hardware) -> str:
  """auto: Keras' moving statistics, except where training cannot update them (pipelined IPU training:
  keras/ipu/extensions/extensions_base.py warns so, graphcore/keras r2.6/sdk-release-3.4); there each
  batch's own, as the reference's IPU model normalises."""
  return "moving" if hardware.updates_moving_statistics else "batch"


OPTIONS = {
    "design": Option("ontra4", "Neuron-Inverter network design.", choices=tuple(sorted(DESIGNS))),
    "batch_norm_statistics": Option(
        AUTO, "What the batch normalisation normalises with in evaluation and prediction: moving = Keras' "
        "moving statistics (the reference's GPU model), batch = each batch's own, in training too (the "
        "reference's IPU model); auto = batch in pipelined IPU training, which cannot update moving "
        "statistics, else moving.", choices=(AUTO, "moving", "batch"), before_recorded="moving",
        settle=_batch_norm_statistics),
}


def batch_dependent(values: dict) -> bool:
  """Batch statistics in evaluation: a sample's outputs depend on its batch."""
  return values["batch_norm_statistics"] == "batch"
