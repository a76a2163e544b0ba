"""Predictors of a batch's routing, and their accuracy (docs/design.md, "Online replay and prediction").

The floor below ``policies``: Libra's per-batch policy plans from a predictor, and the online replay feeds it
(:mod:`~moebalance.prediction.predictors`: Libra's lookahead, Lina's path table, the previous window, the truth).
"""

from moebalance.prediction.predictors import (
    EXACT,
    PREDICTORS,
    Prediction,
    Predictor,
    PredictorInputs,
    demand_of,
    make_predictor,
)

__all__ = ["EXACT", "PREDICTORS", "Prediction", "Predictor", "PredictorInputs", "demand_of", "make_predictor"]
