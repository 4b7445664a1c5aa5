"""Online learning while serving (Alchemist): train on user feedback, reusing the server's prefill.

- recorder.py: a prompt's forward kept with autograd (`record_prompt`), and the two ways to get a
  sample's loss: `reuse_loss` (response tokens only, attending to the record) and the baseline
  `recompute_loss`; both give the same gradient.
- store.py: records by response id under device and host byte budgets (offload, eviction).
- transfer.py: offload and reload copies off the compute stream (CUDA), reloads one layer ahead.
- slices.py: a training step run in slices between serving steps, parked at layer boundaries.
- feedback.py: the durable feedback log (SQLite WAL): responses, feedback, which step trained it.
- trainer.py: config, cost model, the per-sample reuse/recompute planner, the trainer, checkpoints.
- lora.py: low-rank adapters for training with the base weights frozen.
- learner.py: `OnlineLearner`, the one object the server holds.
- colocate.py: training between the serving engine's steps (`serve --learn`).
- demo.py: `demo_online`, the model learning a correction while it serves (reclaim demo).

`reclaim bench online` (reclaim/bench/online.py) measures reuse against recompute and serving
with and without co-located training.
"""
