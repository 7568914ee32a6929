"""Evaluation of trained runs outside the training loop.

* :mod:`canonlm.eval.load` -- rebuild a trained model from a run directory or a Lightning checkpoint.
* :mod:`canonlm.eval.reallife` -- ``python -m canonlm.eval.reallife``: multi-hop birth-year and Babilong accuracy
  (paper App. B, Fig. 23) of a trained run.
"""
