"""Training draft heads for a target (``eyrie train-draft``) and model surgery beside it.

``corpus`` reads and tokenizes text, ``targets`` runs the target to get features and labels,
``unroll`` is the multi-step (training-time test) objective, ``heads`` builds and writes the heads in
their public formats, ``evaluate`` measures acceptance, ``trainer`` is the loop with its checkpoints,
``widen`` grows a trained pair to a wider shape without changing what it computes.
"""
