"""Evaluating the model being trained: greedy answers (`generate`), the before/after evaluation judged by
readable rules (`before_after`, eval.json), the held-out and retention losses measured during training
(`held_out`), and the evaluations one run of `sft` makes (`run_evaluations`)."""
