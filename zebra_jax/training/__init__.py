"""Training: the state, optimizer, loss scaling, the train loop with its
evaluation, and preemption."""
