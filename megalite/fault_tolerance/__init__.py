"""Recovery without a restart (the blueprint's decision 16, replica groups fail alone;
docs/fault_tolerance.md): replica groups agree a quorum every step, finish a step without a group that
died in it, and heal a restarted group from a live peer at a step boundary."""
