"""Replica groups that meet every step: the quorum in the run's store, the link between groups, and the
rules a group's ranks live by (docs/fault_tolerance.md). Below the training loop, which uses it under
--ft-replica-groups (trainer.py); the standalone runtime and drills of megalite/fault_tolerance/ use it too."""
