"""Who may run, in which lane, and when: keys, the gate, targets, isolation, grants."""
