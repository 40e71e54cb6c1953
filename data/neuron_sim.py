"""A four-compartment conductance-based neuron, the source of synthetic cellSpike data.

The cell is a soma with three cylinders attached to it (axon, apical dendrite, basal dendrite): the four
recording sites of the Neuron-Inverter data, in its `featureName` order. Each compartment carries a leak
and Hodgkin-Huxley channels with the kinetics of the Blue Brain / Hay et al. (2011) layer-5 pyramidal
cell models (the models that produced the real data, whose channel names are the 15 parameter names).
Each of the 15 varied conductances sits in the compartment its name says and equals base_k * 10**u_k
with u_k in [-1, 1]; three channels that the real data keep fixed are fixed here as well.

Integration (units: mV, ms, uF/cm2, mS/cm2, uA/cm2): exponential Euler for the gates, whose steady
states and decay factors come from tables over voltage (linear interpolation, as NEURON's TABLE does;
the calcium-gated SK channel's steady state from a table over calcium), then one backward-Euler step
for the four voltages (a 4x4 system solved in closed form because the compartments form a star around
the soma), then the calcium pools. Backward Euler is unconditionally stable, so the strongest draws
(somatic Na up to 10 S/cm2) cannot oscillate or overflow.

The time loop is a numba kernel written out from the channel layout (`_kernel_source`): every voltage,
gate and calcium level of a cell is a local variable rather than an array element, and each statement
is repeated for LANES cells so that the CPU overlaps their dependency chains. Data version v3 differs
from v2 (the batched numpy formulation, up to commit 0343a8d) only in the SK table, which replaced a
`pow` per step; every other operation and each sum's order are v2's, with no fused multiply-adds. The
tables, initial states and constants are computed by numpy. Nothing here imports TensorFlow: the
generator runs where only numpy and numba are installed.
"""

import collections
import functools
import hashlib
import importlib.util
import os
import sys
import tempfile

import numpy as np

from host import atomic_files

PAR_NAMES = (
    "gNaTs2.tbar.NaTs2.t.api", "gSKv3.1bar.SKv3.1.api", "gImbar.Im.api", "gNaTa.tbar.NaTa.t.axn",
    "gK.Tstbar.K.Tst.axn", "gNap.Et2bar.Nap.Et2.axn", "gSK.E2bar.SK.E2.axn", "gCa.HVAbar.Ca.HVA.axn",
    "gK.Pstbar.K.Pst.axn", "gCa.LVAstbar.Ca.LVAst.axn", "gSKv3.1bar.SKv3.1.som",
    "gNaTs2.tbar.NaTs2.t.som", "gIhbar.Ih.som", "gCa.LVAstbar.Ca.LVAst.som", "gIhbar.Ih.den")
FEATURE_NAMES = ("soma", "axon_150um", "apic_dend_150um", "soma_dend_50um")
NUM_PAR = len(PAR_NAMES)
NUM_FEATURES = len(FEATURE_NAMES)
NUM_TIME_BINS = 1600
BIN_MS = 0.125                     # 8 kHz
DT = 0.025                         # ms; 5 steps per output bin
STEPS_PER_BIN = 5
DURATION_MS = NUM_TIME_BINS * BIN_MS

SOMA, AXON, APIC, BASAL = range(4)  # compartment index = probe index (FEATURE_NAMES order)
COMPARTMENT_NAMES = ("soma", "axon", "apical", "basal")

# Base conductances (S/cm2), order of PAR_NAMES: 10**centP of the real data's conductName table (the
# centre of its log range), except five set so that this small cell stays physiological over the whole
# +-1 decade and every parameter leaves a recoverable trace: NaTs2.api x3 and K_Tst.axn x3 (otherwise
# masked by the soma and the axon's fixed Kv3.1), Ca_LVAst.axn x5 (otherwise too small to move the
# axon), K_Pst.axn x1/3 (a slow K that otherwise silences the cell after one spike), SKv3.1.som = Hay et
# al.'s 0.693 (with the real centre, 1 draw in 5 ends in depolarisation block).
BASE_S_PER_CM2 = np.array([
    5.313e-2, 4.529e-3, 3.783e-4, 3.543e0, 2.883e-2, 7.408e-4, 2.643e-2, 5.502e-4, 2.153e-1,
    1.238e-3, 6.930e-1, 9.625e-1, 8.000e-5, 1.512e-3, 8.000e-5])

# Channels the real model has but the data keep fixed (rawIndex 9, 12, 13 are missing from
# conductName), in S/cm2: the soma's Ca-activated adaptation (Hay et al.'s Ca_HVA, a tenth of their
# SK_E2, whose full value silences this small cell) and the axon's fast delayed rectifier (half of
# theirs), which keeps the axon from locking in depolarisation block.
FIXED_S_PER_CM2 = {"SK_E2.som": 4.41e-3, "Ca_HVA.som": 9.92e-4, "SKv3_1.axn": 1.0}

# Passive properties and geometry. Areas (um2) and the soma-to-compartment axial conductances (nS) set
# how strongly each probe follows the soma: the axon and basal dendrite closely, the apical dendrite
# 150 um away with attenuated, slowed back-propagating spikes.
CM = 1.0                            # uF/cm2
G_LEAK = 0.05                       # mS/cm2 (membrane time constant 20 ms)
E_LEAK = -80.0
AREA_UM2 = np.array([2000.0, 600.0, 3000.0, 1500.0])
G_AXIAL_NS = np.array([0.0, 60.0, 10.0, 20.0])     # soma <-> axon, apical, basal
E_NA, E_K, E_H, E_CA = 50.0, -85.0, -45.0, 132.0

# Calcium pools (CaDynamics_E2): d[Ca]/dt = -k * gamma * ica - ([Ca] - CA_MIN) / decay.
CA_MIN = 1e-4                       # mM
CA_COMPARTMENTS = (SOMA, AXON)
CA_GAMMA = np.array([0.0006, 0.0005])   # fraction of Ca entry left free, soma and axon
CA_DECAY = np.array([80.0, 80.0])   # ms
CA_DEPTH_UM = 0.1
FARADAY = 96485.309

# Somatic current clamp (nA), piecewise in time: a hyperpolarising pulse (Ih sag, input resistance,
# the T-type rebound after it), a pause, then a step with a ramp on top (spiking at two drives).
STIM_NA = (
    (10.0, 50.0, -0.06, -0.06),     # (start ms, end ms, amplitude at start, amplitude at end)
    (60.0, 190.0, 0.40, 1.00),
)

SETTLE_MS = 150.0                   # simulated before t=0 at a coarse step so each cell starts at rest
SETTLE_DT = 0.25
V_INIT = -75.0

# Temperature factor of Hay et al.'s kinetics (rates measured at 21 C, simulated at 34 C).
_QT = 2.3 ** ((34.0 - 21.0) / 10.0)

# Voltage grid of the gate tables; voltages are clipped into it, far outside anything reached.
_V_MIN, _V_MAX, _V_STEP = -150.0, 100.0, 0.05


def _vtrap(x: np.ndarray, k: float) -> np.ndarray:
  """x / (1 - exp(-x / k)), with its limit k at x = 0 (the removable singularity of HH rates)."""
  x = np.asarray(x, dtype=np.float64)
  small = np.abs(x / k) < 1e-6
  safe = np.where(small, 1.0, x)
  return np.where(small, k + x / 2.0, safe / (-np.expm1(-safe / k)))


def _from_rates(alpha, beta, qt=1.0):
  return alpha / (alpha + beta), 1.0 / ((alpha + beta) * qt)


# Gate kinetics, each v -> (steady state, time constant in ms), from the Hay et al. mod files.
def _nats2_m(v):
  return _from_rates(0.182 * _vtrap(v + 32.0, 6.0), 0.124 * _vtrap(-(v + 32.0), 6.0), _QT)


def _nats2_h(v):
  return _from_rates(0.015 * _vtrap(-(v + 60.0), 6.0), 0.015 * _vtrap(v + 60.0, 6.0), _QT)


def _nata_m(v):
  return _from_rates(0.182 * _vtrap(v + 38.0, 6.0), 0.124 * _vtrap(-(v + 38.0), 6.0), _QT)


def _nata_h(v):
  return _from_rates(0.015 * _vtrap(-(v + 66.0), 6.0), 0.015 * _vtrap(v + 66.0, 6.0), _QT)


def _nap_m(v):
  inf = 1.0 / (1.0 + np.exp(-(v + 52.6) / 4.6))
  alpha, beta = 0.182 * _vtrap(v + 38.0, 6.0), 0.124 * _vtrap(-(v + 38.0), 6.0)
  return inf, 6.0 / ((alpha + beta) * _QT)


def _nap_h(v):
  inf = 1.0 / (1.0 + np.exp((v + 48.8) / 10.0))
  alpha, beta = 2.88e-6 * _vtrap(-(v + 17.0), 4.63), 6.94e-6 * _vtrap(v + 64.4, 2.63)
  return inf, 1.0 / ((alpha + beta) * _QT)


def _ktst_m(v):
  v = v + 10.0
  return 1.0 / (1.0 + np.exp(-v / 19.0)), (0.34 + 0.92 * np.exp(-((v + 71.0) / 59.0) ** 2)) / _QT


def _ktst_h(v):
  v = v + 10.0
  return 1.0 / (1.0 + np.exp((v + 66.0) / 10.0)), (8.0 + 49.0 * np.exp(-((v + 73.0) / 23.0) ** 2)) / _QT


def _kpst_m(v):
  v = v + 10.0
  tau = np.where(v < -50.0, 1.25 + 175.03 * np.exp(0.026 * v), 1.25 + 13.0 * np.exp(-0.026 * v))
  return 1.0 / (1.0 + np.exp(-(v + 1.0) / 12.0)), tau / _QT


def _kpst_h(v):
  v = v + 10.0
  tau = 360.0 + (1010.0 + 24.0 * (v + 55.0)) * np.exp(-((v + 75.0) / 48.0) ** 2)
  return 1.0 / (1.0 + np.exp((v + 54.0) / 11.0)), tau / _QT


def _skv31_m(v):
  return 1.0 / (1.0 + np.exp((v - 18.7) / -9.7)), 4.0 / (1.0 + np.exp((v + 46.56) / -44.14))


def _im_m(v):
  return _from_rates(3.3e-3 * np.exp(0.1 * (v + 35.0)), 3.3e-3 * np.exp(-0.1 * (v + 35.0)), _QT)


def _ih_m(v):
  return _from_rates(6.43e-3 * _vtrap(-(v + 154.9), 11.9), 0.193 * np.exp(v / 33.1))


def _cahva_m(v):
  return _from_rates(0.055 * _vtrap(v + 27.0, 3.8), 0.94 * np.exp((-75.0 - v) / 17.0))


def _cahva_h(v):
  return _from_rates(4.57e-4 * np.exp((-13.0 - v) / 50.0), 6.5e-3 / (np.exp((-v - 15.0) / 28.0) + 1.0))


def _calva_m(v):
  v = v + 10.0
  return 1.0 / (1.0 + np.exp((v + 30.0) / -6.0)), (5.0 + 20.0 / (1.0 + np.exp((v + 25.0) / 5.0))) / _QT


def _calva_h(v):
  v = v + 10.0
  return 1.0 / (1.0 + np.exp((v + 80.0) / 6.4)), (20.0 + 50.0 / (1.0 + np.exp((v + 40.0) / 7.0))) / _QT


# One row per channel: compartment, activation kinetics and power, inactivation kinetics (None: no h
# gate; "ca": the SK gate driven by the calcium pool), reversal, and either a PAR_NAMES index or a key
# of FIXED_S_PER_CM2.
Channel = collections.namedtuple("Channel", ["name", "comp", "m", "power", "h", "rev", "par"])
CHANNELS = (
    Channel("NaTs2_t", APIC, _nats2_m, 3, _nats2_h, E_NA, 0),
    Channel("SKv3_1", APIC, _skv31_m, 1, None, E_K, 1),
    Channel("Im", APIC, _im_m, 1, None, E_K, 2),
    Channel("NaTa_t", AXON, _nata_m, 3, _nata_h, E_NA, 3),
    Channel("K_Tst", AXON, _ktst_m, 4, _ktst_h, E_K, 4),
    Channel("Nap_Et2", AXON, _nap_m, 3, _nap_h, E_NA, 5),
    Channel("SK_E2", AXON, "ca", 1, None, E_K, 6),
    Channel("Ca_HVA", AXON, _cahva_m, 2, _cahva_h, E_CA, 7),
    Channel("K_Pst", AXON, _kpst_m, 2, _kpst_h, E_K, 8),
    Channel("Ca_LVAst", AXON, _calva_m, 2, _calva_h, E_CA, 9),
    Channel("SKv3_1", SOMA, _skv31_m, 1, None, E_K, 10),
    Channel("NaTs2_t", SOMA, _nats2_m, 3, _nats2_h, E_NA, 11),
    Channel("Ih", SOMA, _ih_m, 1, None, E_H, 12),
    Channel("Ca_LVAst", SOMA, _calva_m, 2, _calva_h, E_CA, 13),
    Channel("Ih", BASAL, _ih_m, 1, None, E_H, 14),
    Channel("SK_E2", SOMA, "ca", 1, None, E_K, "SK_E2.som"),
    Channel("Ca_HVA", SOMA, _cahva_m, 2, _cahva_h, E_CA, "Ca_HVA.som"),
    Channel("SKv3_1", AXON, _skv31_m, 1, None, E_K, "SKv3_1.axn"),
)

_DTYPE = np.float64
_SK_KD, _SK_HILL, _SK_TAU = 4.3e-4, 4.8, 1.0      # mM, Hill coefficient, ms (SK_E2.mod)
# The SK gate's steady state is read from a table over calcium, as the other gates' are over voltage
# (the `pow` it replaces took a third of the simulation). The grid spans 0 to 10 uM in 1 nM steps: the
# pools stay below 2 uM, and above 10 uM the gate is 1 - 3e-7 (the last row is used there).
_CA_STEP, _CA_TABLE_MAX = 1e-6, 1e-2                 # mM


class _Layout:
  """Index bookkeeping shared by every batch: which gate row feeds which channel and compartment.

  Gate rows: first the table-driven gates (voltage dependent), then one SK gate per SK channel (driven
  by its compartment's calcium), then a constant row of ones standing in for a missing h gate.
  Channels are kept in compartment order so per-compartment sums are sums over row slices.
  """

  def __init__(self):
    self.channels = sorted(CHANNELS, key=lambda c: c.comp)
    comps = [c.comp for c in self.channels]
    if sorted(set(comps)) != list(range(NUM_FEATURES)):
      raise AssertionError("every compartment needs at least one channel")
    starts = [comps.index(k) for k in range(NUM_FEATURES)]
    self.comp_slices = list(zip(starts, starts[1:] + [len(comps)]))
    self.table_kinetics, self.table_comp = [], []
    sk_channels = [c for c in self.channels if c.m == "ca"]
    num_table = sum((c.m != "ca") + (c.h is not None) for c in self.channels)
    self.ones_row = num_table + len(sk_channels)
    self.sk_rows, self.sk_pool = [], []
    m_rows, h_rows = [], []
    for channel in self.channels:
      if channel.m == "ca":
        self.sk_rows.append(num_table + len(self.sk_rows))
        self.sk_pool.append(CA_COMPARTMENTS.index(channel.comp))
        m_rows.append(self.sk_rows[-1])
      else:
        m_rows.append(self._add_table_gate(channel.m, channel.comp))
      h_rows.append(self.ones_row if channel.h is None else self._add_table_gate(channel.h, channel.comp))
    self.num_table = num_table
    self.m_rows, self.h_rows = np.array(m_rows), np.array(h_rows)
    self.sk_rows, self.sk_pool = np.array(self.sk_rows), np.array(self.sk_pool)
    self.table_comp = np.array(self.table_comp)
    powers = np.array([c.power for c in self.channels])
    # Rows of the activation block raised once more for each power above 1 (m^3 = m * m * m).
    self.power_rows = [np.nonzero(powers >= p)[0] for p in (2, 3, 4)]
    self.rev = np.array([c.rev for c in self.channels], dtype=_DTYPE)[:, None]
    self.ca_channels = [np.array([i for i, c in enumerate(self.channels) if c.rev == E_CA and c.comp == k])
                        for k in CA_COMPARTMENTS]
    self.par_index = [c.par for c in self.channels]

  def _add_table_gate(self, kinetics, comp):
    self.table_kinetics.append(kinetics)
    self.table_comp.append(comp)
    return len(self.table_kinetics) - 1


_LAYOUT = _Layout()
_TABLES = {}


def _gate_table(dt: float) -> np.ndarray:
  """(gates * grid, 4) rows [inf, d inf, decay, d decay] per voltage grid point, for exponential Euler.

  Built once per time step. The slope columns turn linear interpolation into one gather and two
  multiply-adds per gate.
  """
  if dt not in _TABLES:
    grid = np.arange(_V_MIN, _V_MAX + _V_STEP / 2, _V_STEP)
    blocks = []
    for kinetics in _LAYOUT.table_kinetics:
      inf, tau = kinetics(grid)
      inf = np.broadcast_to(inf, grid.shape)
      decay = np.exp(-dt / np.broadcast_to(tau, grid.shape))
      block = np.zeros((len(grid), 4))
      for col, values in ((0, inf), (2, decay)):
        block[:, col] = values
        block[:-1, col + 1] = np.diff(values)
      blocks.append(block)
    table = np.concatenate(blocks).astype(_DTYPE)
    if not np.all(np.isfinite(table)):
      raise AssertionError("non-finite gate table: a kinetics formula is wrong")
    _TABLES[dt] = table
  return _TABLES[dt]


@functools.lru_cache(maxsize=None)
def _sk_table() -> np.ndarray:
  """(grid, 2) rows [inf, d inf] of the SK gate's steady state over calcium, 0 to _CA_TABLE_MAX mM."""
  grid = np.arange(0.0, _CA_TABLE_MAX + _CA_STEP / 2, _CA_STEP)
  with np.errstate(divide="ignore"):
    inf = 1.0 / (1.0 + (_SK_KD / grid) ** _SK_HILL)          # 0 at no calcium
  table = np.zeros((len(grid), 2))
  table[:, 0] = inf
  table[:-1, 1] = np.diff(inf)
  return table


def conductances(u: np.ndarray) -> np.ndarray:
  """Physical conductances (S/cm2) base * 10**u of unit parameters u, shape (n, 15)."""
  u = np.asarray(u, dtype=np.float64)
  if u.ndim != 2 or u.shape[1] != NUM_PAR:
    raise ValueError("u must have shape (n, %d), got %s" % (NUM_PAR, u.shape))
  return BASE_S_PER_CM2 * 10.0 ** u


def stimulus_na(t_ms: np.ndarray) -> np.ndarray:
  """Somatic current clamp (nA) at times t_ms (ms from the start of the recorded window)."""
  t_ms = np.asarray(t_ms, dtype=np.float64)
  current = np.zeros_like(t_ms)
  for start, end, amp_start, amp_end in STIM_NA:
    on = (t_ms >= start) & (t_ms < end)
    current[on] += amp_start + (amp_end - amp_start) * (t_ms[on] - start) / (end - start)
  return current


def _initial_state(u: np.ndarray):
  """Per-cell arrays at the start of the settling phase: conductances, voltages, gates, calcium.

  Each array is (cells, rows), so that one cell's state is contiguous for the integration kernel.
  Every gate starts at its steady state at V_INIT; the SK gates at that of the resting calcium.
  """
  lay = _LAYOUT
  batch = len(u)
  g_par = conductances(u) * 1e3                      # mS/cm2
  gbar = np.empty((batch, len(lay.channels)), dtype=_DTYPE)
  for row, par in enumerate(lay.par_index):
    gbar[:, row] = g_par[:, par] if isinstance(par, int) else FIXED_S_PER_CM2[par] * 1e3
  v = np.full((batch, NUM_FEATURES), V_INIT, dtype=_DTYPE)
  ca = np.full((batch, len(CA_COMPARTMENTS)), CA_MIN, dtype=_DTYPE)
  gates = np.ones((batch, lay.ones_row + 1), dtype=_DTYPE)
  table = _gate_table(DT)
  rest = int(round((V_INIT - _V_MIN) / _V_STEP))
  gates[:, :lay.num_table] = table[np.arange(lay.num_table) * _grid_len() + rest, 0]
  gates[:, lay.sk_rows] = 1.0 / (1.0 + (_SK_KD / ca[:, lay.sk_pool]) ** _SK_HILL)
  return gbar, v, gates, ca


def _grid_len() -> int:
  return len(_gate_table(DT)) // _LAYOUT.num_table


def _phase_constants(dt: float) -> np.ndarray:
  """Step-size dependent factors [dt, C/dt, SK gate decay, Ca pool decays...], computed by numpy."""
  return np.array([dt, CM / dt, np.exp(-dt / _SK_TAU)] + [np.exp(-dt / tau) for tau in CA_DECAY])


# Cells advanced together by the kernel, each statement written once per lane so that the CPU overlaps
# their dependency chains (one cell's step is a chain: voltage, table row, gates, currents, voltage).
# With the SK table, 2 to 4 lanes simulate within the noise of each other and 2 compile fastest
# (docs/performance.md, "The built-in dataset's generation"); more lanes spill registers.
LANES = 2


def _literal(value) -> str:
  """A constant as the kernel's source writes it: the shortest text that reads back as the same float64
  (as a Python float: numpy 2 would write a float64 as "np.float64(...)", numpy 1 as the number, and the
  two venvs would then compile and cache two kernels)."""
  return repr(float(value))


def _step_lines():
  """One time step of one cell as Python statements; per-cell names end in `_L` (the lane's number).

  The order: gates, SK gates, channel currents summed per compartment in channel order, the star-shaped
  backward-Euler solve, then the calcium pools (each operation and sum as in data v2's numpy code).
  """
  lay, grid = _LAYOUT, _grid_len()
  lines = []
  for k in range(NUM_FEATURES):      # table row and fraction of each compartment's voltage
    lines += ["pos_L = min(max((v%d_L - v_min) * inv_step, 0.0), top)" % k,
              "i%d_L = np.uint64(pos_L)" % k,     # unsigned: no negative-index wrap-around code
              "f%d_L = pos_L - float(i%d_L)" % (k, k)]
  for j, k in enumerate(lay.table_comp):   # exponential Euler, tables interpolated linearly
    lines += ["r_L = (np.uint64(%d) + i%d_L) * np.uint64(4)" % (j * grid, k),
              "inf_L = table[r_L] + f%d_L * table[r_L + np.uint64(1)]" % k,
              "decay_L = table[r_L + np.uint64(2)] + f%d_L * table[r_L + np.uint64(3)]" % k,
              "x%d_L = (x%d_L - inf_L) * decay_L + inf_L" % (j, j)]
  for row, pool in zip(lay.sk_rows, lay.sk_pool):
    lines += ["pos_L = min(c%d_L * %s, %s)" % (pool, _literal(1.0 / _CA_STEP),
                                              _literal(len(_sk_table()) - 1)),
              "j_L = np.uint64(pos_L)",
              "r_L = j_L * np.uint64(2)",
              "sk_L = sk_table[r_L] + (pos_L - float(j_L)) * sk_table[r_L + np.uint64(1)]",
              "x%d_L = sk_L + (x%d_L - sk_L) * sk_decay" % (row, row)]
  lines += _current_lines()
  lines += _voltage_lines()
  for pool, k in enumerate(CA_COMPARTMENTS):   # entry through the Ca channels at the new voltage
    lines += ["ica_L = ca%d_L * (v%d_L - %s)" % (pool, k, _literal(E_CA)),
              "influx_L = -1e4 * (ica_L * 1e-3) * %s / %s" % (_literal(CA_GAMMA[pool]),
                                                                 _literal(2.0 * FARADAY * CA_DEPTH_UM)),
              "c%d_L = max(%s + (c%d_L - %s) * ca_decay%d + dt * influx_L, 1e-6)" % (
                  pool, _literal(CA_MIN), pool, _literal(CA_MIN), pool)]
  return lines


def _current_lines():
  """Channel conductances g = m^p h gbar, summed per compartment (gt: total, sr: times reversal) and
  per calcium pool (ca)."""
  lay = _LAYOUT
  lines, first = [], set()
  for c, channel in enumerate(lay.channels):
    opened = " * ".join(["x%d_L" % lay.m_rows[c]] * channel.power)
    if channel.h is not None:
      opened = "(%s) * x%d_L" % (opened, lay.h_rows[c])
    lines.append("g_L = (%s) * gbar_L[%d]" % (opened, c))
    sums = ["gt%d_L" % channel.comp, "sr%d_L" % channel.comp] + [
        "ca%d_L" % pool for pool, rows in enumerate(lay.ca_channels) if c in rows]
    terms = ["g_L", "g_L * %s" % _literal(channel.rev)] + ["g_L"] * (len(sums) - 2)
    for total, term in zip(sums, terms):
      lines.append("%s %s %s" % (total, "+=" if total in first else "= 0.0 +", term))
      first.add(total)
  return lines


def _voltage_lines():
  """Backward Euler for C dV/dt = -gt V + sr + axial + stimulus. The compartments are a star around the
  soma: eliminating the three branches gives the soma's voltage, then each branch's follows from it."""
  g_couple = G_AXIAL_NS * 100.0 / AREA_UM2
  g_couple_soma = G_AXIAL_NS * 100.0 / AREA_UM2[SOMA]
  leak_rev, leak = _literal(G_LEAK * E_LEAK), _literal(G_LEAK)
  lines = []
  for k in range(1, NUM_FEATURES):
    lines += ["gt%d_L = (c_dt + (gt%d_L + %s)) + %s" % (k, k, leak, _literal(g_couple[k])),
              "sr%d_L = c_dt * v%d_L + (sr%d_L + %s)" % (k, k, k, leak_rev),
              "branch_L = %s / gt%d_L" % (_literal(g_couple_soma[k]), k),
              "num_L %s branch_L * sr%d_L" % ("= 0.0 +" if k == 1 else "+=", k),
              "den_L %s branch_L * %s" % ("= 0.0 +" if k == 1 else "+=", _literal(g_couple[k]))]
  lines += ["diag0_L = (c_dt + (gt0_L + %s)) + %s" % (leak, _literal(g_couple_soma[1:].sum())),
            "rhs0_L = (c_dt * v0_L + (sr0_L + %s)) + stim_now" % leak_rev,
            "v0_L = (rhs0_L + num_L) / (diag0_L - den_L)"]
  lines += ["v%d_L = (sr%d_L + %s * v0_L) / gt%d_L" % (k, k, _literal(g_couple[k]), k)
            for k in range(1, NUM_FEATURES)]
  return lines


def _per_lane(lines, indent: int) -> str:
  """Each line once per lane, lane after lane for every statement."""
  return "\n".join(" " * indent + line.replace("_LANE", str(lane)).replace("_L", "_%d" % lane)
                   for line in lines for lane in range(LANES))


def _kernel_source() -> str:
  """A module with the numba kernel `integrate` (see simulate), every state variable a local."""
  num_gates, num_pools = _LAYOUT.ones_row, len(CA_COMPARTMENTS)
  state = ([("v[cell + _LANE, %d]" % k, "v%d_L" % k) for k in range(NUM_FEATURES)]
           + [("gates[cell + _LANE, %d]" % j, "x%d_L" % j) for j in range(num_gates)]
           + [("ca[cell + _LANE, %d]" % p, "c%d_L" % p) for p in range(num_pools)])
  load = ["gbar_L = gbar[cell + _LANE]"] + ["%s = %s" % (name, where) for where, name in state]
  store = ["%s = %s" % (where, name) for where, name in state]
  mean = ["out[cell + _LANE, step // steps_per_bin, %d] = a%d_L * (1.0 / steps_per_bin)" % (k, k)
          for k in range(NUM_FEATURES)]
  return "\n".join([
      '"""Written by data/neuron_sim.py from its channel layout (%d lanes); not to be edited."""' % LANES,
      "import numba",
      "import numpy as np",
      "",
      "",
      '@numba.njit(cache=True, error_model="numpy")',
      "def integrate(gbar, v, gates, ca, table, sk_table, phase, stim, steps_per_bin, out):",
      "  dt, c_dt, sk_decay, ca_decay0, ca_decay1 = phase[0], phase[1], phase[2], phase[3], phase[4]",
      "  inv_step, v_min, top = %s, %s, %s" % (_literal(1.0 / _V_STEP), _literal(_V_MIN),
                                                _literal(_grid_len() - 1)),
      "  for cell in range(0, len(gbar), %d):" % LANES,
      _per_lane(load + ["a%d_L = 0.0" % k for k in range(NUM_FEATURES)], 4),
      "    for step in range(len(stim)):",
      "      stim_now = stim[step]",
      _per_lane(_step_lines(), 6),
      "      if steps_per_bin > 0:",
      _per_lane(["a%d_L += v%d_L" % (k, k) for k in range(NUM_FEATURES)], 8),
      "        if step % steps_per_bin == steps_per_bin - 1:",
      _per_lane(mean + ["a%d_L = 0.0" % k for k in range(NUM_FEATURES)], 10),
      _per_lane(store, 4),
      ""])


_KERNEL = {}     # "integrate": the kernel, once loaded in this process


def _kernel_folders():
  """Where the kernel's source may go: beside this module, else (a read-only tree, as in a container
  image) the temporary folder."""
  return (os.path.join(os.path.dirname(os.path.abspath(__file__)), "__pycache__"),
          os.path.join(tempfile.gettempdir(), "neuron_sim_kernels"))


def _kernel_file(filename: str, source: str) -> str:
  """The kernel's module file in the first of `_kernel_folders()` that can hold it; the name is the
  content's hash, so an existing file is the right one."""
  for folder in _kernel_folders():
    path = os.path.join(folder, filename)
    try:
      if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        atomic_files.write_text(path, source)
      return path
    except OSError:
      continue
  raise OSError("no writable folder for the simulation kernel: %s" % " or ".join(_kernel_folders()))


def _kernel():
  """The compiled kernel. Its source is written to a file named by its hash so that numba can cache the
  machine code there (about 4 s of compilation otherwise in every process that simulates)."""
  if "integrate" not in _KERNEL:
    source = _kernel_source()
    name = "neuron_kernel_%s" % hashlib.sha1(source.encode()).hexdigest()[:16]
    path = _kernel_file(name + ".py", source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module      # numba's cache finds the module again by its name
    spec.loader.exec_module(module)
    _KERNEL["integrate"] = module.integrate
  return _KERNEL["integrate"]


def simulate(u: np.ndarray) -> np.ndarray:
  """Voltage traces (n, 1600, 4) float32 in mV of cells with unit parameters u (n, 15).

  Each cell first settles at rest without stimulus, then the 200 ms window is integrated at DT and
  every output bin is the mean of its STEPS_PER_BIN voltages (rebinning to 8 kHz as the real data).
  Samples are independent: a cell's trace does not depend on the others in the batch.
  """
  u = np.asarray(u, dtype=np.float64)
  count = len(u)
  u = np.concatenate([u, np.repeat(u[-1:], -count % LANES, axis=0)])   # whole groups of lanes
  gbar, v, gates, ca = _initial_state(u)
  num_steps = NUM_TIME_BINS * STEPS_PER_BIN
  stim = stimulus_na(np.arange(1, num_steps + 1) * DT) * 1e5 / AREA_UM2[SOMA]    # uA/cm2
  out = np.empty((len(u), NUM_TIME_BINS, NUM_FEATURES), dtype=np.float32)
  integrate = _kernel()
  sk_table = _sk_table().ravel()
  integrate(gbar, v, gates, ca, _gate_table(SETTLE_DT).ravel(), sk_table, _phase_constants(SETTLE_DT),
            np.zeros(int(round(SETTLE_MS / SETTLE_DT))), 0, out)
  integrate(gbar, v, gates, ca, _gate_table(DT).ravel(), sk_table, _phase_constants(DT), stim,
            STEPS_PER_BIN, out)
  out = out[:count]
  if not np.all(np.isfinite(out)):
    raise FloatingPointError("non-finite voltage in the simulation: a bug in the model, not the data")
  return out


Sensitivity = collections.namedtuple("Sensitivity", ["rel_rms", "rms_mv"])


def _rms(x: np.ndarray, axis) -> np.ndarray:
  return np.sqrt(np.mean(np.square(x, dtype=np.float64), axis=axis))


def parameter_sensitivity(num_draws: int = 8, seed: int = 0, low: float = -0.8,
                          high: float = 0.8) -> Sensitivity:
  """How much each parameter alone changes the traces, around `num_draws` random cells.

  For each draw u0 ~ U[-1, 1]^15 and each parameter k, simulates u0 with u_k = low and with
  u_k = high (all other u fixed) and measures the RMS difference of the two unnormalised traces over
  all bins and probes. Returns (num_draws, 15) arrays: `rms_mv` (mV) and `rel_rms` (divided by the
  RMS of the two traces, about 70 mV, as the traces sit near rest most of the time).
  """
  base = np.random.default_rng(seed).uniform(-1.0, 1.0, size=(num_draws, NUM_PAR))
  u = np.repeat(base[:, None, None, :], 2, axis=2).repeat(NUM_PAR, axis=1)   # (draw, k, lo/hi, par)
  for k in range(NUM_PAR):
    u[:, k, 0, k], u[:, k, 1, k] = low, high
  traces = simulate(u.reshape(-1, NUM_PAR)).reshape(num_draws, NUM_PAR, 2, NUM_TIME_BINS, NUM_FEATURES)
  rms_mv = _rms(traces[:, :, 1] - traces[:, :, 0], axis=(2, 3))
  scale = np.sqrt(0.5 * (_rms(traces[:, :, 0], axis=(2, 3)) ** 2 + _rms(traces[:, :, 1], axis=(2, 3)) ** 2))
  return Sensitivity(rel_rms=rms_mv / scale, rms_mv=rms_mv)


def format_sensitivity(result: Sensitivity, threshold: float = 0.01) -> str:
  """A text table, one row per parameter: mean / median / min relative RMS change, mean mV change,
  and the fraction of draws above `threshold`."""
  lines = ["%-27s %-7s %8s %8s %8s %9s %7s" % ("parameter", "where", "mean%", "median%", "min%",
                                              "mean mV", ">%g%%" % (100 * threshold))]
  where = {c.par: COMPARTMENT_NAMES[c.comp] for c in CHANNELS if isinstance(c.par, int)}
  for k, name in enumerate(PAR_NAMES):
    rel = result.rel_rms[:, k]
    lines.append("%-27s %-7s %8.2f %8.2f %8.2f %9.2f %7.2f" % (
        name, where[k], 100 * rel.mean(), 100 * np.median(rel), 100 * rel.min(),
        result.rms_mv[:, k].mean(), np.mean(rel > threshold)))
  return "\n".join(lines)
