"""Drafter training: data (samples, buffer, recorder), loss (EAGLE's loss and steps), acceptance
(greedy replay), online (the rollout engine's drafter trained between rollouts), train (`reclaim
drafter train`), eagle3 (EAGLE-3's training-time test), bundled (the bundled model's drafter)."""
