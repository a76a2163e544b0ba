"""One module per command of the ``moebalance`` command line, each with ``add_parser(sub)`` (its sub-parser, whose
``func`` is ``run``) and ``run(args)``; :data:`COMMANDS` lists them in the order ``--help`` shows them.

Options several commands share live in :mod:`moebalance.app.options`; ``import_`` is ``moebalance import``
(``import`` is a Python keyword).
"""

from moebalance.app.commands import (
    advise,
    calibrate,
    capture,
    compare,
    cost,
    demo,
    evaluate,
    export,
    import_,
    online,
    plan,
    predict,
    run,
    stats,
    sweep,
    synth,
    watch,
)

__all__ = ["COMMANDS"]

COMMANDS = (synth, plan, evaluate, compare, sweep, stats, demo, import_, export, cost, calibrate, predict, online,
            advise, watch, capture, run)
