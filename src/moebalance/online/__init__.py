"""Online replay and prediction (docs/design.md, "Online replay and prediction").

A server plans while it serves: :mod:`~moebalance.prediction.predictors` predicts a batch's routing (Libra's
lookahead, Lina's path table, the previous window, the truth), and :mod:`~moebalance.online.replay` replays a
trace batch by batch with static policies planned once or periodically, and dynamic ones (``libra``) planned
per batch from a predictor.
"""
