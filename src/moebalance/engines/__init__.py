"""What serving engines record and load (docs/design.md, "Engines"; field-by-field sources in docs/formats.md).

- :mod:`~moebalance.engines.sglang`: SGLang's expert-distribution ``stat`` dumps (read) and its
  ``--init-expert-location`` placement files (read and write);
- :mod:`~moebalance.engines.trtllm`: TensorRT-LLM's expert statistics folders (read) and its MoE load-balancer
  YAML (read and write);
- :mod:`~moebalance.engines.vllm`: a per-MoE-layer physical-to-logical JSON (write);
- :mod:`~moebalance.engines.slots`: plans as engines need them, the same slots on every GPU and layer (with
  padding that buys the most balance);
- :mod:`~moebalance.engines.detect`: one entry point that reads any supported load or placement file;
- :mod:`~moebalance.engines.layers`: which model an engine file is for (from its shape, when one model fits) and
  which of the model's decoder layers, MTP layers included, each plan row is;
- :mod:`~moebalance.engines.files`: JSON and ``.npy`` reading that checks sizes before allocating;
- :mod:`~moebalance.engines.stream`: ``moebalance import`` of SGLang's per-token dump folders and vLLM's routed
  experts one file at a time, in memory that does not grow with the tokens.

Engines number layers as the model does, dense layers included: loads keep them as all-zero rows, so that a
plan's layer ``l`` is the engine's layer ``l`` on the way back.
"""

from moebalance.engines.detect import (
           LOAD_FORMATS,
           PLAN_FORMATS,
           OpenedLoad,
           open_load,
           read_any_load,
           read_any_plan,
)
from moebalance.engines.layers import EngineLayers, plan_layers
from moebalance.engines.slots import SlotTable, pad_plan, slot_table

__all__ = ["LOAD_FORMATS", "PLAN_FORMATS", "EngineLayers", "OpenedLoad", "SlotTable", "open_load", "pad_plan",
           "plan_layers", "read_any_load", "read_any_plan", "slot_table"]
