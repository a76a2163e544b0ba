"""moebalance: expert placement, replication and routing for MoE inference under expert parallelism.

Glossary
--------
layer ``l``
    One MoE layer; ``L`` layers in the model.
logical expert ``e``
    An expert of the model; ``E`` per layer.
physical slot / replica
    One copy of an expert's weights on one GPU. Expert ``e`` of layer ``l`` has ``r[l, e] >= 1`` replicas.
GPU ``g``, node ``n``
    ``G = num_nodes * gpus_per_node`` GPUs; GPU ``g`` is on node ``g // gpus_per_node``.
slots per GPU
    How many experts a GPU hosts in a layer; may differ across layers and GPUs (CRAFT).
extra (redundant) replicas
    Physical slots minus logical experts, summed over layers: the memory a plan costs.
load ``W[b, l, e]``
    Tokens routed to expert ``e`` of layer ``l`` in batch ``b``; a token counts once per picked expert.
router
    The run-time rule that picks, for each token and chosen expert, which replica serves it.
"""

from importlib.metadata import PackageNotFoundError, version

from moebalance.core.errors import BudgetError, InputError, MoebalanceError, PlanError

try:  # the one place the version is written is pyproject.toml; the installed metadata carries it
    __version__ = version("moebalance")
except PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "unknown"

__all__ = ["BudgetError", "InputError", "MoebalanceError", "PlanError", "__version__"]
